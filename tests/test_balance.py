"""trainer.balance_batch (grpo_jax/trainer/balance.py) against verl 0.9.1's own partition and
its metrics (verl/utils/seqlen_balancing.py), on generated sequence lengths."""

import numpy as np
import pytest
import reference

from grpo_jax.trainer import balance, train_stage

SEQLEN = "verl.utils.seqlen_balancing"


def _lengths(seed, rows):
    """Lengths as a GSM8K step has them: prompts of 60-200 tokens, responses of 1-512 with a
    tail at the cap (ties included)."""
    r = np.random.default_rng(seed)
    response = np.minimum(r.geometric(1 / 180, rows), 512)
    return r.integers(60, 200, rows) + response


CASES = [(0, 8, 2), (1, 40, 8), (2, 64, 4), (3, 512, 8), (4, 30, 3), (5, 16, 16)]


@pytest.mark.parametrize("seed,rows,dp", CASES)
def test_partitions_are_verls(verl, seed, rows, dp):
    lengths = _lengths(seed, rows)
    work = balance.workload(lengths)
    theirs_work = verl.run(reference.fn(f"{SEQLEN}:calculate_workload")(lengths)).value
    np.testing.assert_array_equal(work, theirs_work)
    theirs = verl.run(reference.fn(f"{SEQLEN}:get_seqlen_balanced_partitions")(
        work.tolist(), k_partitions=dp, equal_size=True
    )).value  # fmt: skip
    ours = balance.partitions(work, dp)
    assert [p.tolist() for p in ours] == theirs
    stats = verl.run(reference.fn(f"{SEQLEN}:log_seqlen_unbalance")(
        lengths.tolist(), theirs, prefix="global_seqlen"
    )).value  # fmt: skip
    want = {k: v for k, v in stats.items() if "balanced" in k}
    assert balance.balanced_seqlen(lengths, ours) == want


@pytest.mark.parametrize("values", [[5] * 12, [1, 1, 2, 2, 3, 3, 100, 100], list(range(24))])
def test_partitions_with_ties_are_verls(verl, values):
    theirs = verl.run(reference.fn(f"{SEQLEN}:get_seqlen_balanced_partitions")(
        values, k_partitions=4, equal_size=True
    )).value  # fmt: skip
    assert [p.tolist() for p in balance.partitions(np.array(values), 4)] == theirs


def test_partitions_split_every_row_once_in_equal_balanced_parts():
    lengths = _lengths(9, 256)
    parts = balance.partitions(balance.workload(lengths), 8)
    rows = np.concatenate(parts)
    assert sorted(rows.tolist()) == list(range(256))
    assert {len(p) for p in parts} == {32}
    assert all((np.diff(p) > 0).all() for p in parts)
    sums = [int(balance.workload(lengths)[p].sum()) for p in parts]
    assert sums == sorted(sums, reverse=True)
    contiguous = balance.workload(lengths).reshape(8, 32).sum(1)
    assert max(sums) - min(sums) < (contiguous.max() - contiguous.min()) / 10


def test_one_rank_keeps_the_data_order():
    lengths = _lengths(3, 40)
    (part,) = balance.rank_parts(lengths, 1)
    np.testing.assert_array_equal(part, np.arange(40))
    order = train_stage.mini_batch_order(
        40, mini_rows=10, dp=1, epoch=0, seed=42, parts=[part], shuffle=False
    )
    np.testing.assert_array_equal(order, np.arange(40))


def test_mini_batches_take_each_ranks_slice():
    # verl's engine worker: rank r holds part r; mini-batch k is the k-th slice of every part.
    lengths = _lengths(4, 16)
    parts = balance.rank_parts(lengths, 2)
    order = train_stage.mini_batch_order(
        16, mini_rows=8, dp=2, epoch=3, seed=42, parts=parts, shuffle=False
    )
    np.testing.assert_array_equal(order[:8], np.concatenate([parts[0][:4], parts[1][:4]]))
    np.testing.assert_array_equal(order[8:], np.concatenate([parts[0][4:], parts[1][4:]]))
    shuffled = train_stage.mini_batch_order(
        16, mini_rows=8, dp=2, epoch=0, seed=42, parts=parts, shuffle=True
    )
    for k in range(2):  # shuffled within each rank's part
        mini = shuffled[8 * k : 8 * k + 8]
        assert set(mini[:4]) <= set(parts[0]) and set(mini[4:]) <= set(parts[1])
    assert sorted(shuffled.tolist()) == list(range(16))


def test_uneven_rows_name_the_field():
    with pytest.raises(ValueError, match=r"trainer.balance_batch .* 10 rows over 4"):
        balance.partitions(np.arange(10), 4)
    with pytest.raises(ValueError, match=r"trainer.balance_batch=True balances .* 3 data"):
        train_stage.mini_batch_order(16, mini_rows=8, dp=3, epoch=0, seed=0, shuffle=False)
