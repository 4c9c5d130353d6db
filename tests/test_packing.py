"""Packed token-budget micro-batches (grpo_jax/trainer/packing.py) compute exactly the unpadded numbers.

The reference is the padded computation on one micro-batch (trainer.train_step with the whole
mini-batch as its micro-batch; padding never contributes there either): the packed loss,
gradients and metrics, summed over however many micro-batches the token budget makes, must
equal it for every loss_agg_mode, on mixed prompt and response lengths; the masked-mean metrics
(pg_clipfrac, ppo_kl, ...), which verl averages over micro-batches, the mean of the padded
update's on each micro-batch's sequences. geo_mean, which verl averages per micro-batch, must
equal the padded update of each micro-batch's sequences, summed.
"""

import functools

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import optax
import pytest

from grpo_jax import loss, model
from grpo_jax.trainer import actor, packing

CFG = model.ModelConfig.tiny()
B, P, T = 8, 7, 6
# Packed vs padded gradients of the x20-weight tiny model (tests/numerics.py): measured up to
# ~1,900 ulps of each tensor's scale over AVX-512, AVX2 and SSE4.2 code, one or two threads and
# YNNPACK dots (the saturated softmaxes amplify rounding); a normaliser one token off moves them
# by 4.7e5 ulps and a dropped token by 5e6 (scripts/inject_bugs.py).
GRAD_ULPS = 8192
LOGP_ULPS = 256
METRIC_ULPS = 512


def _rollout(seed=0, group=1):
    """Left-padded prompts (lengths 1..7) and right-padded responses (lengths 1..6); with
    group > 1, each prompt is repeated for `group` consecutive rows, as a GRPO rollout's are."""
    r = np.random.default_rng(seed)
    p_len = np.repeat(r.integers(1, P + 1, B // group), group)
    r_len = r.integers(1, T + 1, B)
    prompt_ids = np.repeat(r.integers(1, CFG.vocab_size, (B // group, P)), group, 0)
    prompt_ids = prompt_ids.astype(np.int32)
    prompt_mask = (np.arange(P)[None] >= P - p_len[:, None]).astype(np.int32)
    prompt_ids[prompt_mask == 0] = 0
    resp_ids = r.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    resp_mask = (np.arange(T)[None] < r_len[:, None]).astype(np.int32)
    resp_ids[resp_mask == 0] = 0
    return prompt_ids, prompt_mask, resp_ids, resp_mask


@pytest.fixture(scope="module")
def params():
    # O(1) weights so log-probs and gradients are far from flat.
    p = model.init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 20.0 if x.ndim > 1 else x, p)


def _visible(micro, r, i):
    """The row positions token i of row r attends to (what model.hidden_states_packed sees)."""
    seg, pre = micro.segments_RL[r], micro.prefixes_RL[r]
    j = np.arange(i + 1)
    return j[(seg[j] > 0) & ((seg[j] == seg[i]) | (seg[j] == pre[i]))]


@pytest.mark.parametrize("group", [1, 4])
def test_pack_places_every_token_once_within_budget(group):
    prompt_ids, prompt_mask, resp_ids, resp_mask = _rollout(1, group)
    packed = packing.pack(
        prompt_ids,
        prompt_mask,
        resp_ids,
        resp_mask,
        max_tokens=32,
        row_multiple=2,
        row_len=16,
    )
    assert packed.num_micro > 1
    seen = np.zeros((B, T), int)
    rows_used = 0
    for micro in packed.micros:
        R, L = micro.tokens_RL.shape
        assert L == 16 and R % 2 == 0 and R * L <= 32
        G, N = micro.slot_bt_GN.shape
        assert G == 2 and R % G == 0  # one slot pool per row group (data device)
        # Pooled slots: one per position of the group's rows (a shape of the rows alone),
        # the used ones first.
        assert N == (R // G) * L
        used_GN = micro.slot_bt_GN < B * T
        np.testing.assert_array_equal(used_GN, np.sort(used_GN, axis=1)[:, ::-1])
        rows_used += int((micro.segments_RL > 0).any(1).sum())
        for g in range(G):
            for n in range(N):
                bt = micro.slot_bt_GN[g, n]
                if bt == B * T:
                    continue
                b, t = divmod(int(bt), T)
                seen[b, t] += 1
                # The slot's position, in a row of its own group, sees exactly sequence b up to
                # response token t - 1, at its own positions, and its label is response token t.
                row, i = divmod(int(micro.slot_pos_GN[g, n]), L)
                r = g * (R // G) + row
                context = _visible(micro, r, i)
                want = np.concatenate([prompt_ids[b][prompt_mask[b] == 1], resp_ids[b, :t]])
                np.testing.assert_array_equal(micro.tokens_RL[r, context], want)
                np.testing.assert_array_equal(micro.positions_RL[r, context], np.arange(len(want)))
                assert micro.slot_label_GN[g, n] == resp_ids[b, t]
    np.testing.assert_array_equal(seen, resp_mask)  # every response token exactly once
    # Empty rows only in the last micro-batch's rounding (micro_rows).
    sizes = [micro.tokens_RL.shape[0] for micro in packed.micros]
    assert sizes == packing.micro_rows(rows_used, 2, 2)
    # Each group's prompt is stored once per row it spans: fewer tokens than the sequences.
    unique = prompt_mask[::group].sum() + resp_mask.sum()
    total = prompt_mask.sum() + resp_mask.sum()
    assert unique <= packed.num_tokens_M.sum() <= total
    assert (packed.num_tokens_M.sum() < total) == (group > 1)
    with pytest.raises(ValueError, match="raise ppo_max_token_len_per_gpu"):
        packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=8, row_len=16)


def test_micro_rows_fill_the_budget_and_round_only_the_last():
    # 11 rows under a 5-row budget: 5 + 5 + 1, not 3 x 5 (4 empty rows computed).
    assert packing.micro_rows(11, 5, 1) == [5, 5, 1]
    assert packing.micro_rows(13, 5, 1) == [5, 5, 3]  # 3 = ceil(5 / 2)
    assert packing.micro_rows(20, 16, 1) == [16, 4]
    assert packing.micro_rows(32, 16, 1) == [16, 16]
    assert packing.micro_rows(3, 16, 1) == [4]  # 16, 8, 4, 2: the smallest that holds 3
    assert packing.micro_rows(5, 16, 2) == [8]
    assert packing.micro_rows(3, 6, 2) == [4]  # ceil(6 / 2) = 3, rounded up to the multiple
    for rows in range(1, 64):
        for cap, multiple in ((1, 1), (3, 1), (5, 1), (16, 1), (16, 4), (6, 2)):
            sizes = packing.micro_rows(rows, cap, multiple)
            assert all(s % multiple == 0 and 1 <= s <= cap for s in sizes)
            assert sum(sizes) >= rows and sum(sizes[:-1]) < rows  # no empty micro-batch
            assert sum(sizes) - rows <= max(sizes[-1] / 2, multiple)  # only the rounding
            shapes = {s for r in range(1, 200) for s in packing.micro_rows(r, cap, multiple)}
            assert shapes == set(packing.row_options(cap, multiple))  # what precompile builds
            assert len(shapes) <= 4  # bounded compiled shapes


def _padded_batch(prompt_ids, prompt_mask, resp_ids, resp_mask, seed=0):
    r = np.random.default_rng(seed + 10)
    adv = (r.normal(size=(B, 1)) * resp_mask).astype(np.float32)
    ref = (-2.0 + r.normal(size=(B, T)) * resp_mask).astype(np.float32)
    return actor.TrainBatch(
        input_ids_BS=jnp.asarray(np.concatenate([prompt_ids, resp_ids], 1)),
        attention_mask_BS=jnp.asarray(np.concatenate([prompt_mask, resp_mask], 1)),
        response_ids_BT=jnp.asarray(resp_ids),
        response_mask_BT=jnp.asarray(resp_mask),
        advantages_BT=jnp.asarray(adv),
        ref_log_probs_BT=jnp.asarray(ref),
    )


@pytest.mark.parametrize("group", [1, 4])
def test_packed_log_probs_equal_the_padded_forward(params, group):
    prompt_ids, prompt_mask, resp_ids, resp_mask = _rollout(2, group)
    batch = _padded_batch(prompt_ids, prompt_mask, resp_ids, resp_mask)
    want, want_ent = actor.compute_log_probs(
        CFG,
        params,
        batch,
        micro_batch_size=B,
        temperature=0.7,
        chunk_size=16,
        calculate_entropy=True,
    )
    packed = packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=32, row_len=16)
    assert packed.num_micro > 1  # the budget really splits the batch
    lp = ent = jnp.zeros((B, T))
    for m in range(packed.num_micro):
        micro = actor.PackedMicro(**{k: jnp.asarray(v) for k, v in packed.micro(m).items()})
        lp, ent = actor.packed_log_probs_into(
            CFG, params, micro, lp, ent, temperature=0.7, chunk_size=16, calculate_entropy=True
        )
    valid = resp_mask.astype(bool)
    assert np.abs(np.asarray(want)[valid]).max() > 1.0  # not flat: the check has teeth
    # Another row layout and chunking: rounding at the scale of the largest |log p| or entropy.
    numerics.assert_close(np.asarray(lp)[valid], np.asarray(want)[valid], ulps=LOGP_ULPS)
    numerics.assert_close(np.asarray(ent)[valid], np.asarray(want_ent)[valid], ulps=LOGP_ULPS)
    assert np.all(np.asarray(lp)[~valid] == 0)


def _grads_and_metrics_padded(params, batch, lc):
    """The unpadded reference: one micro-batch, gradient through one SGD step."""
    state = actor.init_state(params, _SGD)
    new, metrics = jax.jit(
        functools.partial(
            actor.train_step,
            model_config=CFG,
            loss_config=lc,
            tx=_SGD,
            mini_batch_size=B,
            micro_batch_size=B,
        )
    )(state, batch, jnp.int32(0), jnp.float32(1.0))
    grads = jax.tree.map(lambda a, b: a - b, params, new.params)
    return grads, metrics


_SGD = optax.identity()  # apply_gradients steps by -lr * g: lr 1 reads g off


# Every mode with groups of 4 (a unit is a prompt and 4 responses: several sequences a unit and
# a row), and groups of 1 in one mode: a unit of one sequence is the special case.
@pytest.mark.parametrize(
    "agg,group", [(agg, 4) for agg in loss.AGG_MODES] + [("token-mean", 1)]
)
def test_packed_update_equals_the_unpadded_one_in_every_agg_mode(params, agg, group):
    prompt_ids, prompt_mask, resp_ids, resp_mask = _rollout(3, group)
    batch = _padded_batch(prompt_ids, prompt_mask, resp_ids, resp_mask)
    # Off-policy old log-probs (ratios away from 1, so the clip is live), KL loss and entropy.
    old, _ = actor.compute_log_probs(
        CFG,
        params,
        batch,
        micro_batch_size=B,
        temperature=1.0,
        chunk_size=16,
        calculate_entropy=False,
    )
    old = old + 0.3 * jnp.asarray(np.random.default_rng(4).normal(size=(B, T)), jnp.float32)
    batch = batch.replace(old_log_probs_BT=old * batch.response_mask_BT)
    lc = actor.LossConfig(
        loss_agg_mode=agg,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        calculate_entropy=True,
        chunk_size=16,
    )
    want_g, want_m = _grads_and_metrics_padded(params, batch, lc)

    packed = packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=32, row_len=16)
    step = jax.jit(functools.partial(actor.packed_micro_grads, model_config=CFG, loss_config=lc))
    grads = jax.tree.map(jnp.zeros_like, params)
    micro_metrics, micro_want = [], []
    for m in range(packed.num_micro):
        micro = actor.PackedMicro(**{k: jnp.asarray(v) for k, v in packed.micro(m).items()})
        grads, metrics = step(params, grads, micro, batch)
        micro_metrics.append(metrics)
        slot_bt = packed.micro(m)["slot_bt_GN"]
        micro_want.append(_padded_sub_batch_update(params, batch, np.unique(slot_bt[
            slot_bt < B * T] // T), lc)[1])  # fmt: skip
    got_m = actor.combine_micro_metrics(
        {k: jnp.stack([m[k] for m in micro_metrics]) for k in micro_metrics[0]}
    )
    assert packed.num_micro > 1
    # Packing changes every reduction order of the forward and backward pass (row layout,
    # micro-batch sums); the x20 weights make the softmaxes sharp, so rounding is amplified.
    numerics.assert_trees_close(grads, want_g, ulps=GRAD_ULPS, err_msg="grad")
    assert float(want_m["actor/pg_clipfrac"]) > 0  # the clip branch is exercised
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/loss"):
        # Sums over tokens of O(1) or larger terms: rounding at the scale max(|value|, 1).
        want = float(want_m[key])
        numerics.assert_close(got_m[key], want, ulps=METRIC_ULPS, scale=max(abs(want), 1.0),
                              err_msg=key)  # fmt: skip
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        # verl: each micro-batch's masked mean over its own tokens, averaged over the
        # micro-batches with equal weights (actor.combine_micro_metrics)
        want = float(np.mean([float(w[key]) for w in micro_want]))
        numerics.assert_close(got_m[key], want, ulps=METRIC_ULPS, scale=max(abs(want), 1.0),
                              err_msg=key)  # fmt: skip


def _padded_sub_batch_update(params, batch, rows, lc):
    """The padded update (train_step) on the sequences `rows` alone, as one micro-batch."""
    sub = jax.tree.map(lambda x: x[rows], batch)
    n = len(rows)
    state = actor.init_state(params, _SGD)
    new, metrics = jax.jit(
        functools.partial(
            actor.train_step,
            model_config=CFG,
            loss_config=lc,
            tx=_SGD,
            mini_batch_size=n,
            micro_batch_size=n,
        )
    )(state, sub, jnp.int32(0), jnp.float32(1.0))
    return jax.tree.map(lambda a, b: a - b, params, new.params), metrics


@pytest.mark.parametrize("group", [1, 4])
def test_packed_geo_mean_is_verls_mean_per_micro_batch(params, group):
    # verl's geo_mean (GMPO) loss is torch.mean over the micro-batch's sequences, whatever the
    # global-batch arguments, and the engine sums the micro-batch losses' gradients unscaled:
    # the update is the sum over micro-batches m of the padded update of m's sequences alone
    # (with equal micro-batches, M times the mini-batch mean). The token budget makes
    # micro-batches of 3, 3 and 2 sequences here, so each weighs its sequences differently (a
    # mean over the whole mini-batch is off by about M = 3).
    prompt_ids, prompt_mask, resp_ids, resp_mask = _rollout(4, group)
    batch = _padded_batch(prompt_ids, prompt_mask, resp_ids, resp_mask)
    old, _ = actor.compute_log_probs(
        CFG, params, batch, micro_batch_size=B, temperature=1.0, chunk_size=16,
        calculate_entropy=False,
    )  # fmt: skip
    old = old + 0.3 * jnp.asarray(np.random.default_rng(4).normal(size=(B, T)), jnp.float32)
    batch = batch.replace(old_log_probs_BT=old * batch.response_mask_BT)
    lc = actor.LossConfig(policy_loss_mode="geo_mean", chunk_size=16)

    packed = packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=32, row_len=16)
    step = jax.jit(functools.partial(actor.packed_micro_grads, model_config=CFG, loss_config=lc))
    grads = want_g = jax.tree.map(jnp.zeros_like, params)
    got_pg = want_pg = 0.0
    sizes = []
    for m in range(packed.num_micro):
        micro = actor.PackedMicro(**{k: jnp.asarray(v) for k, v in packed.micro(m).items()})
        grads, metrics = step(params, grads, micro, batch)
        got_pg += float(metrics["actor/pg_loss"])
        slot_bt = packed.micro(m)["slot_bt_GN"]
        rows = np.unique(slot_bt[slot_bt < B * T] // T)
        g, ref = _padded_sub_batch_update(params, batch, rows, lc)
        want_g = jax.tree.map(jnp.add, want_g, g)
        want_pg += float(ref["actor/pg_loss"])
        sizes.append(len(rows))
    assert len(sizes) > 1 and len(set(sizes)) > 1 and sum(sizes) == B  # uneven micro-batches
    numerics.assert_trees_close(grads, want_g, ulps=GRAD_ULPS, err_msg="grad")
    numerics.assert_close(got_pg, want_pg, ulps=METRIC_ULPS, scale=max(abs(want_pg), 1.0))
