"""A sequence-classification head on the decoder: transformers' *ForSequenceClassification.

HF's Qwen2ForSequenceClassification / LlamaForSequenceClassification (transformers 5's
``GenericForSequenceClassification``) run the decoder, multiply every final-normed hidden state
by ``score.weight`` [num_labels, D] (a Linear without bias) and keep the logits of one token per
row: the rightmost token whose id is not ``pad_token_id`` (``argmax(arange(T) * (ids != pad))``,
so left and right padding both work, and a row of pads only picks token 0); with no
``pad_token_id`` the last position, and a batch of more than one row is an error.

Here the head is the matrix ``score_DL`` = ``score.weight.T`` [D, L] (L = num_labels) next to
the backbone's params; ``hidden_states`` gives h_BTD, and only the chosen token's state is
multiplied (``scores``), the same numbers as HF's logits-then-pick.

verl 0.9.1's discriminative reward model serves the checkpoint with vLLM's ``/classify``
(``use_activation=False``) and takes ``probs[-1]``: the raw logit of the *last* label at the
sequence's last token. ``reward`` does the same: label L - 1 (the only one when num_labels = 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.models import config as config_lib
from grpo_jax.models import transformer


def last_token_hf(input_ids_BT, pad_token_id: int | None):
    """HF's pooled token [B]: the rightmost id that is not ``pad_token_id``.

    Raises:
      ValueError: ``pad_token_id`` is None and the batch has more than one row (as HF).
    """
    B, T = input_ids_BT.shape
    if pad_token_id is None:
        if B != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        return jnp.full((B,), T - 1, jnp.int32)
    non_pad_BT = (input_ids_BT != pad_token_id).astype(jnp.int32)
    return jnp.argmax(jnp.arange(T, dtype=jnp.int32)[None, :] * non_pad_BT, axis=-1)


def last_token_masked(attention_mask_BT):
    """The last real token [B] of each row by its mask (vLLM's last-token pooling of an unpadded
    sequence): right padding gives ``sum(mask) - 1``; left padding ``T - 1``."""
    T = attention_mask_BT.shape[1]
    real_BT = attention_mask_BT.astype(jnp.int32)
    return jnp.argmax(jnp.arange(T, dtype=jnp.int32)[None, :] * real_BT, axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def scores(config: config_lib.ModelConfig, params, score_DL, input_ids_BT, attention_mask_BT,
           index_B):  # fmt: skip
    """Logits [B, L] float32 of the token ``index_B`` of each row.

    Args:
      config: the backbone's ModelConfig.
      params: the backbone's params (no lm_head: ``tie_word_embeddings`` is set on loading).
      score_DL: the head, ``score.weight`` transposed.
      input_ids_BT, attention_mask_BT: the rows (left or right padded).
      index_B: the token whose state is classified (``last_token_hf`` / ``last_token_masked``).
    """
    h_BTD = transformer.hidden_states(config, params, input_ids_BT, attention_mask_BT)
    h_BD = jnp.take_along_axis(h_BTD, index_B[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    return jnp.dot(h_BD.astype(jnp.float32), score_DL.astype(jnp.float32))


def reward(logits_BL):
    """verl's reward-model score [B]: the last label's raw logit (vLLM classify's probs[-1])."""
    return logits_BL[:, -1]
