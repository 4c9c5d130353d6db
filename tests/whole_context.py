"""The no-cache reference of the sampler tests: a full forward pass over whole sequences.

A sampled token is checked against the logits a forward pass over the prompt and the response
before it gives. Run eagerly per row, every row's length is a new shape and JAX compiles each
of the model's ops again for it (14 of the 28 s of one paged test went there); here a test's
rows go through one jitted forward, right-padded to a multiple of 64 columns, so a test compiles
one program for all its rows. The padding comes after each sequence, so causal attention never
reads it, and each row's logits are those of its own tokens.
"""

import functools

import jax
import numpy as np

from grpo_jax import model, sampler

_COLUMNS = 64


@functools.partial(jax.jit, static_argnums=0)
def _forward(config, params, ids_BT, mask_BT):
    return model.forward(config, params, ids_BT, mask_BT)


def sequence_logits(config, params, seqs) -> list[np.ndarray]:
    """Each sequence's logits [len(seq), V] float32 (position t: the next token after t)."""
    width = -(-max(len(s) for s in seqs) // _COLUMNS) * _COLUMNS
    ids_BT = np.zeros((len(seqs), width), np.int32)
    mask_BT = np.zeros_like(ids_BT)
    for b, seq in enumerate(seqs):
        ids_BT[b, : len(seq)], mask_BT[b, : len(seq)] = seq, 1
    logits_BTV = np.asarray(_forward(config, params, ids_BT, mask_BT))
    return [logits_BTV[b, : len(seq)] for b, seq in enumerate(seqs)]


select_tokens = jax.jit(
    sampler.select_tokens, static_argnames=("temperature", "top_k", "top_p", "logprobs_mode")
)
