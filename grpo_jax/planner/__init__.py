r"""Memory planner: will this GRPO config fit, and if not, which knob to turn and by how much?

plan.py is its command line; run it on the target hardware, or on any CPU by simulating the
device count:
  python plan.py --config=configs/gsm8k.py --model=qwen2.5-7b --device=h200 --devices=8 \
      --config.model.dtype=bfloat16 --config.model.enable_gradient_checkpointing=True
  python plan.py --config=configs/gsm8k_qwen3_8b.py --model=qwen3-8b --device=h200 --devices=8
  python plan.py --config=configs/gsm8k_qwen3_8b.py:jax --model=qwen3-8b --device=v5p --devices=8
  python train.py --config=... --plan          # the same report, from the trainer

Nothing is materialised: parameters, optimizer state and batches are ``jax.ShapeDtypeStruct``s
carrying their ``NamedSharding``s, and each phase of one GRPO step is AOT-lowered and compiled
for the configured model and mesh (``jax.jit(...).lower(...).compile().memory_analysis()``):

  * sample: ``sampler.sample`` on ``data.train_batch_size`` prompts x ``rollout.n`` (KV cache),
    unless ``rollout.name="vllm"``: then the sidecar samples, and JAX budgets only its
    1 - ``rollout.vllm.gpu_memory_utilization`` share of each device (the server stays
    resident on its GPUs); its own side is estimated (weights, KV-cache room);
  * logprob: ``trainer.compute_log_probs`` (reference / old log-probs), when the config needs it,
    or with ``rollout.log_prob_use_dynamic_bsz`` one packed micro-batch of
    ``log_prob_max_token_len_per_gpu`` tokens a device (``trainer.packed_log_probs_into``);
  * train: ``trainer.train_step`` on one mini-batch with ``actor.ppo_micro_batch_size_per_gpu``,
    or with ``actor.use_dynamic_bsz`` one packed micro-batch of ``ppo_max_token_len_per_gpu``
    tokens a device (``trainer.packed_micro_grads``) and the optimizer step after it
    (``trainer.apply_gradients``). A packed micro-batch is planned at its largest: every row
    full and every position a response token.

Per device it prints parameters, optimizer state and reference parameters (exact, from the
shardings; with LoRA, model.lora_rank > 0, the frozen base, the adapters and their optimizer
state, no reference copy, and what full fine-tuning would hold instead), XLA's argument /
output / temporary sizes for each phase (temporaries are the
activations, gradients being accumulated and the float32 logits chunks), the KV cache and logits
sizes (analytic), the peak of each phase, and then searches (compiling each candidate) for the
largest value of each phase's batch knob (micro-batch size, token budget, prompts per step)
that fits in ``usable_fraction * hbm_gib``. When the step does not fit, `advise` says which
fields to change and to what: the knob of each phase over budget, else gradient checkpointing,
else FSDP over the data devices; it re-plans the step with all the changes and prints them as
``--config`` flags.

--device=h200|v5p sets the memory per device (DEVICE_HBM), --hbm_gib=G any other.
--devices=N sets ``--xla_force_host_platform_device_count=N`` on the CPU backend before JAX is
imported, so an 8-GPU or TPU v5p-16 (8 chips) plan can be computed on a laptop. Caveat: the
numbers are then XLA:CPU's buffer assignment for the same sharded program. Parameter, optimizer,
batch and KV-cache bytes are exact; temporaries can differ from the GPU/TPU compilers (other
fusion decisions, no cuDNN/Pallas flash attention), so keep the default 10 % headroom and re-run
on the real hardware (without --devices) before a long job.

--tpu_topology=v5p:2x2x2 (instead of --devices) removes that caveat for TPUs: the phases compile
ahead of time with the TPU compiler itself (libtpu, `tpu_topology`) for that slice's chips, on
a machine without TPUs. The memory analysis is then the TPU's own buffer assignment, with
Pallas splash attention and the native bf16 layouts; only a TPU compile's time (minutes for an
8B model on a laptop) is the cost.

Peak of a phase = its compiled arguments + outputs - donated (aliased) buffers + temporaries +
what stays resident outside it (the reference parameters; during sampling, log-prob and packed
gradient passes also the optimizer state, which is not an argument there; during the packed
passes the step's batch).

Layout: `devices` (the accelerators' memory, TPU slices), `presets` (model architectures),
`phases` (the Planner: each phase compiled and measured; `from_run`), `advice` (`advise`: the
fields to change) and `render` (`plan` / `report`: the text plan.py prints). The names below are
re-exported here: `planner.from_run`, `planner.plan`, `planner.report`, ...
"""

from grpo_jax.planner.advice import Advice, Fix, advise
from grpo_jax.planner.devices import (
    DEVICE_BACKEND,
    DEVICE_HBM,
    GIB,
    compiles_natively,
    tpu_topology,
)
from grpo_jax.planner.phases import (
    CPU_ONLY_HOIST,
    Knob,
    Phase,
    PhaseMemory,
    Planner,
    Workload,
    bytes_per_device,
    from_run,
    with_overrides,
)
from grpo_jax.planner.presets import PRESETS, preset_config
from grpo_jax.planner.render import plan, report

__all__ = [
    "Advice", "Fix", "advise", "DEVICE_BACKEND", "DEVICE_HBM", "GIB", "compiles_natively",
    "tpu_topology", "CPU_ONLY_HOIST", "Knob", "Phase", "PhaseMemory", "Planner", "Workload",
    "bytes_per_device", "from_run", "with_overrides", "PRESETS", "preset_config", "plan", "report",
]
