"""verl 0.9.1's Sync DAPO replay buffer, run in the reference worker (tests/reference.py).

verl's V1 sync trainer draws a step's groups from `verl/trainer/ppo/v1/replay_buffer.py:
ReplayBuffer.sample`, which polls a TransferQueue (the `transfer_queue` package, not in verl's
pins and absent from the verl venv). `sync_dapo_sample` runs that very method over an in-memory
stand-in of the queue in which every dispatched prompt has finished, all its trajectories
scored, by the next poll: the schedule grpo_jax's `rollout_stage.dynamic_sample` reproduces.
This file runs under verl's interpreter and imports only the standard library at the top.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types


@dataclasses.dataclass
class _KVBatchMeta:
    partition_id: str
    keys: list
    tags: list


class _Queue:
    """The transfer_queue calls ReplayBuffer makes (kv_list, kv_batch_get, kv_clear)."""

    def __init__(self, torch):
        self.torch = torch
        self.tags: dict[str, dict] = {}  # key -> tag, partition "train" only
        self.values: dict[str, float] = {}  # trajectory key -> its metric value
        self.metric = None

    def kv_list(self):
        return {"train": {k: dict(t) for k, t in self.tags.items()}}

    def kv_batch_get(self, keys, partition_id, select_fields):
        assert partition_id == "train" and len(select_fields) == 1
        if select_fields == ["rm_scores"]:  # verl's token-level rewards: float32, summed
            return {"rm_scores": [self.torch.tensor([self.values[k]], dtype=self.torch.float32)
                                  for k in keys]}
        return {"extra_fields": [{"reward_extra_info": {self.metric: self.values[k]}}
                                 for k in keys]}

    def kv_clear(self, partition_id, keys):
        for k in keys:
            self.tags.pop(k, None)
            self.values.pop(k, None)


def _replay_buffer_module(queue):
    """verl's replay_buffer.py loaded on its own (its package __init__ pulls in ray)."""
    fake = types.ModuleType("transfer_queue")
    fake.KVBatchMeta = _KVBatchMeta
    for name in ("kv_list", "kv_batch_get", "kv_clear"):
        setattr(fake, name, getattr(queue, name))
    sys.modules["transfer_queue"] = fake
    import verl

    path = f"{verl.__path__[0]}/trainer/ppo/v1/replay_buffer.py"
    spec = importlib.util.spec_from_file_location("_verl_v1_replay_buffer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sync_dapo_sample(values, *, train_batch_size, max_inflight_gen_batches, metric):
    """One step of verl's Sync DAPO: prepare_step's train batch, then ReplayBuffer.sample.

    Args:
      values: the metric values of the k-th dispatched prompt's n trajectories, for k = 0, 1, ...
        (as many as the step may dispatch).

    Returns:
      {"dispatched": prompts per dispatch (the first is prepare_step's train batch),
       "selected": sorted prompt numbers of the batch, "surplus": those discarded,
       "metrics": the metrics sample() returns}.
    """
    import torch

    queue = _Queue(torch)
    queue.metric = metric
    rb = _replay_buffer_module(queue)
    dispatched = []

    def refill(count):  # trainer_base.py: _add_prompts_to_generate; finished at the next poll
        start = sum(dispatched)
        dispatched.append(count)
        for p in range(start, start + count):
            uid = f"p{p:05d}"
            queue.tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": 1}
            for j, v in enumerate(values[p]):
                queue.tags[f"{uid}_{j}_0"] = {"status": "finished", "global_steps": 1}
                queue.values[f"{uid}_{j}_0"] = v
        return count

    class Recording(rb.ReplayBuffer):
        """Records which groups sample() evicts (DAPO) and which it clears as surplus."""

        cleared, evicted = set(), set()

        def _clear_groups(self, partition_id, uids):
            self.cleared |= set(uids)
            return super()._clear_groups(partition_id, uids)

        def _evict_terminal_groups(self, *args):
            out = super()._evict_terminal_groups(*args)
            self.evicted |= out[0]
            return out

    buffer = Recording(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.0,
        refill_fn=refill,
        filter_groups_metric=metric,
        train_batch_size=train_batch_size,
        gen_batch_size=1,  # trainer_base.py: forced to 1 under DAPO
        max_inflight_gen_batches=max_inflight_gen_batches,
    )
    refill(train_batch_size)  # prepare_step -> _add_batch_to_generate
    batch, metrics = buffer.sample(global_steps=1, partition_id="train",
                                   batch_size=train_batch_size)

    def numbers(uids):
        return sorted(int(u.split("_")[0][1:]) for u in uids)

    return {
        "dispatched": dispatched,
        "selected": numbers({k.split("_")[0] for k in batch.keys}),
        "evicted": numbers(buffer.evicted),
        "surplus": numbers(buffer.cleared - buffer.evicted),
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("_")},
        "filtered_reward_counts": metrics.get(rb.DAPO_FILTERED_REWARD_COUNTS_KEY, {}),
    }


def filter_groups_defaults():
    """`algorithm.filter_groups` of verl's trainer YAML (trainer/config/ppo_trainer.yaml)."""
    import verl
    import yaml

    with open(f"{verl.__path__[0]}/trainer/config/ppo_trainer.yaml") as f:
        return yaml.safe_load(f)["algorithm"]["filter_groups"]
