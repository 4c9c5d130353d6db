"""The optional supervised warm-up (config section `warmup`): a few SFT steps on the reference
answers before GRPO, then a fresh optimizer."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed, errors
from grpo_jax.data import prompts
from grpo_jax.trainer import actor


def warm_up(
    run,
    state,
    tx,
    train_set,
    tokenizer,
    mesh,
    *,
    eos_id,
    pad_id,
    micro_rows,
    model_config,
    base_params=None,
) -> tuple[actor.TrainState, dict]:
    """Supervised warm-up on the reference answers (warmup.steps), then a fresh optimizer.

    With LoRA (`base_params` the frozen base) it trains the adapters.

    Returns:
      (state, metrics): update count 0 and a fresh optimizer state; the last warm-up NLL.
    """
    w = run.warmup
    missing = [ex.line for ex in train_set.examples if ex.answer is None]
    if missing:
        raise ValueError(
            f"warmup.steps={w.steps} needs a reference answer per prompt (extra_info.answer, or "
            f"the answer of a raw GSM8K row); {len(missing)} prompts have none (lines "
            f"{missing[:5]}...)"
        )
    if w.batch_size > len(train_set):  # else prompts.next_indices names data.train_batch_size
        raise errors.InputError(
            f"warmup.batch_size={w.batch_size} exceeds the {len(train_set)} training prompts (a "
            "warm-up batch is drawn from one epoch's order, without repeats)"
        )
    # The state's planned shardings, kept by every warm-up step (else jit picks its outputs'
    # and the second step compiles again) and by the state handed to the loop, whose update
    # programs compile for them, as on a resume.
    planned = jax.tree.map(lambda x: x.sharding, state)
    sft_fn = jax.jit(
        functools.partial(
            actor.sft_step,
            model_config=model_config,
            tx=tx,
            micro_batch_size=min(micro_rows, w.batch_size),
        ),
        donate_argnums=0,
        out_shardings=(planned, None),
    )
    base = () if base_params is None else (base_params,)
    position = prompts.Position()
    nll = float("nan")
    for i in range(w.steps):
        idx, position = prompts.next_indices(
            len(train_set), position, w.batch_size, seed=run.data.seed + 1, shuffle=True
        )
        batch = sft_batch(
            train_set,
            idx,
            tokenizer,
            mesh,
            eos_id=eos_id,
            pad_id=pad_id,
            max_response_length=run.data.max_response_length,
        )
        state, m = sft_fn(state, batch, jnp.float32(w.lr), *base)
        nll = float(m["sft/nll"])
        if i % 10 == 0 or i == w.steps - 1:
            logging.info("warm-up step %d/%d: nll %.4f", i + 1, w.steps, nll)
    fresh = actor.TrainState(jnp.zeros_like(state.step), state.params, tx.init(state.params))
    # a fresh optimizer state (made outside jit) on the planned shardings too
    return jax.device_put(fresh, planned), {"warmup/nll": nll, "warmup/steps": w.steps}


def sft_batch(train_set, indices, tokenizer, mesh, *, eos_id, pad_id, max_response_length):
    """Prompt + reference answer (+ EOS) for the supervised warm-up, answers right-padded."""
    pb = prompts.make_batch(train_set, indices, pad_token_id=pad_id)
    r = max_response_length
    answers = [ex.answer for ex in pb.examples]
    ans_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    resp_PT = np.full((len(indices), r), pad_id, np.int32)
    mask_PT = np.zeros((len(indices), r), np.int32)
    for p, ids in enumerate(ans_ids):
        ids = (list(ids) + [eos_id])[:r]
        resp_PT[p, : len(ids)] = ids
        mask_PT[p, : len(ids)] = 1
    arrays = dict(
        input_ids_BS=np.concatenate([pb.prompt_ids_PT, resp_PT], 1),
        attention_mask_BS=np.concatenate([pb.prompt_mask_PT, mask_PT], 1),
        response_ids_BT=resp_PT,
        response_mask_BT=mask_PT,
        advantages_BT=np.zeros(resp_PT.shape, np.float32),
    )
    return actor.TrainBatch(**{k: distributed.to_device(v, mesh) for k, v in arrays.items()})
