"""The GRPO trainer: the actor's update (actor), one step as named stages (step), the loop
around it (loop), validation, checkpoints, packing, metrics, perf and the plot."""
