"""verl 0.9.1's training metrics, run in the reference worker (tests/reference.py).

Each function feeds verl's own code what verl's V1 trainer (verl/trainer/ppo/v1/trainer_base.py)
and its engine workers hand it, from plain lists and arrays:

* `step_metrics`: `PPOTrainer._compute_metrics` of one step. verl keeps every sample unpadded
  (nested jagged tensors in its TransferQueue) and pads them to the batch's longest before
  `compute_data_metrics`, `compute_timing_metrics` and `compute_throughout_metrics`.
* `actor_update_metrics`: the actor's metrics of `_update_actor` for given micro-batches: verl's
  `ppo_loss` (workers/utils/losses.py) per micro-batch, gathered and reduced the way
  `TrainingWorker.train_batch` / `train_mini_batch` (workers/engine_workers.py) and the trainer
  (rename_dict, reduce_metrics) do, with one data-parallel rank.
* `lr_after_steps`: the learning rate the engine returns after each training step's scheduler
  step (workers/engine/fsdp/transformer_impl.py `_build_lr_scheduler`, `lr_scheduler_step`).

This file runs under verl's interpreter and imports only the standard library at the top.
"""

from __future__ import annotations


def _nested(rows, dtype):
    """A batch of unpadded per-sample values as verl's TransferQueue returns them: jagged
    nested tensors, even when every sample has the same length."""
    import torch
    from tensordict import TensorDict

    return TensorDict(
        {
            k: torch.nested.as_nested_tensor(
                [torch.tensor(r[k], dtype=dtype[k]) for r in rows], layout=torch.jagged
            )
            for k in rows[0]
        },
        batch_size=[len(rows)],
    )


def _nested_samples(samples, fields, response_lens):
    """`_nested` of samples: placeholder prompt and response tokens of each sample's lengths
    (int64) and its float32 per-token `fields` (those it has)."""
    import torch

    rows = []
    for s, n in zip(samples, response_lens):
        row = {"prompts": [1] * s["prompt_len"], "responses": [1] * n}
        row |= {k: s[k] for k in fields if k in s}
        rows.append(row)
    dtype = {k: torch.float32 for k in fields} | {"prompts": torch.int64, "responses": torch.int64}
    return _nested(rows, dtype)


def step_metrics(samples, timing_raw, n_gpus):
    """compute_data_metrics (no critic) + timing + throughput + training/num_turns/* of a step.

    Args:
      samples: one dict per sample: "prompt_len", "response_len" (ints), "response_mask",
        "advantages", "returns", "rm_scores" and optionally "token_level_rewards" (lists of
        response_len floats: verl's per-token values, the mask after rejection sampling).
      timing_raw: stage -> seconds ("step" among them).
      n_gpus: the trainer's devices.
    """
    import numpy as np
    from verl import DataProto
    from verl.trainer.ppo import metric_utils

    token_fields = ["response_mask", "advantages", "returns", "rm_scores", "token_level_rewards"]
    data = _nested_samples(samples, token_fields, [s["response_len"] for s in samples])
    prompt_length = data["prompts"].offsets().diff()
    response_length = data["responses"].offsets().diff()
    global_token_num = (prompt_length + response_length).tolist()
    data = data.to_padded_tensor()
    data["token_level_scores"] = data["rm_scores"]
    if "token_level_rewards" not in data:
        data["token_level_rewards"] = data["rm_scores"]
    data["prompt_length"] = prompt_length.float()
    data["response_length"] = response_length.float()
    batch = DataProto(batch=data, meta_info={"global_token_num": global_token_num})
    num_turns = np.full(len(samples), 2, dtype=np.int32)  # the single-turn agent loop
    batch.non_tensor_batch["__num_turns__"] = num_turns
    out = metric_utils.compute_data_metrics(batch=batch, use_critic=False)
    out |= metric_utils.compute_timing_metrics(batch=batch, timing_raw=timing_raw)
    out |= metric_utils.compute_throughout_metrics(
        batch=batch, timing_raw=timing_raw, n_gpus=n_gpus
    )
    out |= {f"training/num_turns/{k}": getattr(num_turns, k)() for k in ("mean", "max", "min")}
    return {k: float(v) for k, v in out.items()}


def actor_update_metrics(mini_batches, *, actor_kwargs):
    """The actor/* loss metrics of one `_update_actor` call.

    Args:
      mini_batches: the update's mini-batches in order (epochs included), each a list of
        micro-batches, each a list of samples: dicts of "prompt_len" (int) and the response's
        "log_probs" (current policy), "old_log_probs", "advantages", "response_mask" (the mask
        after rejection sampling), optionally "loss_mask" (as sampled; default response_mask),
        "ref_log_prob" and "rollout_is_weights" (lists of the response's length).
      actor_kwargs: verl.workers.config.ActorConfig fields (loss_agg_mode, clip ratios, ...).
    """
    import itertools

    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric, reduce_metrics
    from verl.utils.py_functional import append_to_dict, rename_dict
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = ActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **actor_kwargs
    )
    per_mini = {}
    for mini in mini_batches:
        samples = [s for micro in mini for s in micro]
        # forward_backward_batch: the mini-batch's tokens as sampled, all-reduced over dp
        num_tokens = sum(sum(s.get("loss_mask", s["response_mask"])) for s in samples)
        gathered = {}
        for micro in mini:
            fields = [
                "old_log_probs",
                "advantages",
                "response_mask",
                "ref_log_prob",
                "rollout_is_weights",
            ]
            data = _nested_samples(micro, fields, [len(s["response_mask"]) for s in micro])
            tu.assign_non_tensor(
                data, dp_size=1, batch_num_tokens=num_tokens, global_batch_size=len(samples)
            )
            # the model's log-probs over prompt + response, position p predicting token p + 1
            seq = [[0.0] * (s["prompt_len"] - 1) + list(s["log_probs"]) + [0.0] for s in micro]
            log_probs = torch.nested.as_nested_tensor(
                [torch.tensor(x, dtype=torch.float32) for x in seq], layout=torch.jagged
            )
            _, metrics = ppo_loss(config, {"log_probs": log_probs}, data)
            append_to_dict(gathered, metrics)  # engine utils.postprocess_batch_func
        # _postprocess_output's all-gather over one dp rank, then train_mini_batch's reduction
        out = {}
        for key, val in gathered.items():
            val = [val]
            out[key] = (
                Metric.aggregate_dp(val)
                if isinstance(val[0], Metric)
                else list(itertools.chain.from_iterable(val))
            )
        append_to_dict(per_mini, out)
    return {k: float(v) for k, v in reduce_metrics(rename_dict(per_mini, "actor/")).items()}


def lr_after_steps(*, lr, kind, warmup_steps, total_steps, min_lr_ratio, steps):
    """get_last_lr() after each of `steps` training steps' optimizer and scheduler steps."""
    import torch
    from verl.utils import torch_functional as F

    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([p], lr=lr)
    if kind == "constant":
        scheduler = F.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps)
    else:
        scheduler = F.get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        )
    out = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out
