"""trainer.balance_batch: verl's reorder of a step's rows so that each data-parallel rank holds a
similar workload, and the mini-batches that reorder makes.

verl 0.9.1's v1 trainer (trainer/ppo/v1/trainer_base.py `_balance_batch`, before the log-prob
passes) splits the batch's rows into dp equal-size parts with the Largest Differencing Method
(Karmarkar-Karp) on each row's estimated workload, puts part r (its row indices in ascending
order) on rank r, and the engine worker cuts each rank's rows into consecutive mini-batch
slices: mini-batch k is the k-th slice of every rank's part. Which rows train together in one
optimizer step therefore depends on the data-parallel size. grpo_jax's default (balance_batch
False) keeps whole groups in data order, the same mini-batches on any mesh; on one
data-parallel device the two coincide (one part, every row in order).

The partition follows verl's algorithm (verl/utils/seqlen_balancing.py: `calculate_workload`,
`karmarkar_karp` with equal sizes, its tie-breaks, parts ordered by decreasing sum), so the
same lengths give the same parts; tests/test_balance.py checks it against verl's function.
"""

from __future__ import annotations

import heapq

import numpy as np


def workload(seq_lengths_B) -> np.ndarray:
    """verl's estimated cost of a sequence of each length: 24576 * len + len^2 (the dense FLOPs
    of a 7B transformer block, 12 h^2 s + 2 h s^2 with h = 4096, up to a constant)."""
    s = np.asarray(seq_lengths_B, np.int64)
    return 24576 * s + s * s


class _Part:
    """One part being built: its total and its (index, value) items in insertion order."""

    __slots__ = ("total", "items")

    def __init__(self, items):
        self.items = list(items)
        self.total = sum(v for _, v in self.items)

    def key(self):  # the order verl sorts parts by: total, then size, then the items
        return (self.total, len(self.items), self.items)


class _State:
    """k parts, heaviest first; the differencing method merges the two with the largest spread."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    @property
    def spread(self):
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other):  # heapq pops the largest spread first, then the heaviest part
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()

    def absorb(self, other):
        """Heaviest part of self with the lightest of other, and so on down."""
        for mine, theirs in zip(self.parts, reversed(other.parts)):
            mine.items += theirs.items
            mine.total += theirs.total
        self.parts.sort(key=_Part.key, reverse=True)


def partitions(values_B, k: int) -> list[np.ndarray]:
    """The B rows split into k parts of B / k rows each with balanced sums of `values_B`
    (Largest Differencing Method with equal part sizes): part r's row indices, ascending; parts
    in decreasing order of their sums.

    Rows are taken by increasing value, k at a time, each k forming one state of k one-row
    parts; the two states with the largest spread (heaviest minus lightest part) are merged,
    heaviest part with lightest, until one state is left."""
    values = [int(v) for v in np.asarray(values_B).reshape(-1)]
    if k < 1 or len(values) % k:
        raise ValueError(
            f"trainer.balance_batch splits the batch's {len(values)} rows over {k} data-parallel "
            "ranks in equal parts: the rows must be a multiple of the ranks"
        )
    ranked = sorted((v, i) for i, v in enumerate(values))
    heap = [
        _State([_Part([(i, v)]) for v, i in ranked[start : start + k]])
        for start in range(0, len(ranked), k)
    ]
    heapq.heapify(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.absorb(second)
        heapq.heappush(heap, first)
    return [np.sort(np.array([i for i, _ in p.items], np.int64)) for p in heap[0].parts]


def rank_parts(seq_lengths_B, dp: int) -> list[np.ndarray]:
    """The rows each of the dp data-parallel ranks holds after verl's reorder: the balanced
    parts of the rows' workloads."""
    return partitions(workload(seq_lengths_B), dp)


def balanced_seqlen(seq_lengths_B, parts) -> dict[str, int]:
    """global_seqlen/balanced_{min,max}: the least and most summed lengths of a rank's part
    after the reorder (verl's log_seqlen_unbalance)."""
    s = np.asarray(seq_lengths_B, np.int64)
    sums = [int(s[p].sum()) for p in parts]
    return {"global_seqlen/balanced_min": min(sums), "global_seqlen/balanced_max": max(sums)}
