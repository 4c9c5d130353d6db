"""The vLLM server's answers as a `sampler.Rollout`: a generation call's `Request` (the prompts
and the bodies sent) and `build_rollout`, which checks every completion list (count, indices,
token ids, log-probs, finish reasons) and lays the rows out as the native sampler does. The
protocol: `rollout.vllm_sidecar`'s module doc."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from grpo_jax import sampler
from grpo_jax.rollout.vllm_config import VLLMResponseError


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked generation request: the prompts and one /v1/completions body per prompt."""

    prompt_ids_PT: np.ndarray
    prompt_mask_PT: np.ndarray
    bodies: list[dict]
    n: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    logprobs_mode: str = "processed_logprobs"

    def rollout(self, choices_P, *, weights_version: int, vocab_size: int,
                log_where: str) -> sampler.Rollout:
        return build_rollout(
            self.prompt_ids_PT, self.prompt_mask_PT, choices_P, n=self.n,
            max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id, vocab_size=vocab_size,
            weights_version=weights_version, log_where=log_where,
            logprobs_mode=self.logprobs_mode,
        )  # fmt: skip


def build_rollout(
    prompt_ids_PT: np.ndarray,
    prompt_mask_PT: np.ndarray,
    choices_P: Sequence[Any],
    *,
    n: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    vocab_size: int,
    weights_version: int,
    log_where: str,
    logprobs_mode: str = "processed_logprobs",
) -> sampler.Rollout:
    """Turns the servers' `choices` (one list per prompt) into a native-layout `Rollout`.

    Each choice must carry `index` (0..n-1, each once), `token_ids` (1..max_new_tokens ids in
    [0, vocab_size)) and `logprobs.token_logprobs` (one finite float per token, <= 0 unless the
    server's `logprobs_mode` returns logits). The response is cut after its first EOS;
    positions after it hold pad_token_id with mask 0 and log-prob 0.

    Raises:
      VLLMResponseError: any choice breaks the rules above (message names prompt and sample).
    """
    num_prompts = prompt_ids_PT.shape[0]
    if len(choices_P) != num_prompts:
        raise VLLMResponseError(
            f"expected {num_prompts} completion lists, got {len(choices_P)}; server log: "
            f"{log_where}"
        )
    batch = num_prompts * n
    response_ids_BR = np.full((batch, max_new_tokens), pad_token_id, np.int32)
    response_mask_BR = np.zeros((batch, max_new_tokens), np.int32)
    log_probs_BR = np.zeros((batch, max_new_tokens), np.float32)
    eos = set(eos_token_ids)
    logits = logprobs_mode.endswith("_logits")  # logits, of either sign
    for i, choices in enumerate(choices_P):
        where = f"prompt {i}"
        if not isinstance(choices, list) or len(choices) != n:
            raise _malformed(where, f"expected {n} choices, got {str(choices)[:200]}", log_where)
        try:
            indices = sorted(int(c["index"]) for c in choices)
        except (KeyError, TypeError, ValueError) as e:
            raise _malformed(
                where, f"choice without an integer 'index' ({e!r})", log_where
            ) from None
        if indices != list(range(n)):
            raise _malformed(where, f"choice indices {indices} are not 0..{n - 1}", log_where)
        for c in choices:
            j = int(c["index"])
            where_j = f"{where}, sample {j}"
            tokens = c.get("token_ids")
            logprobs = c.get("logprobs")
            token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
            if not isinstance(tokens, list) or not isinstance(token_logprobs, list):
                raise _malformed(
                    where_j, "missing 'token_ids' or 'logprobs.token_logprobs'", log_where
                )
            if not 1 <= len(tokens) <= max_new_tokens or len(token_logprobs) != len(tokens):
                raise _malformed(
                    where_j,
                    f"{len(tokens)} token ids and {len(token_logprobs)} log-probs for "
                    f"max_new_tokens={max_new_tokens}",
                    log_where,
                )
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
                raise _malformed(
                    where_j, f"token ids outside [0, {vocab_size}): {tokens[:20]}", log_where
                )
            if not all(
                isinstance(lp, (int, float)) and math.isfinite(lp) and (logits or lp <= 0.0)
                for lp in token_logprobs
            ):
                rule = "finite" if logits else "finite and <= 0"
                raise _malformed(
                    where_j, f"log-probs must be {rule}: {token_logprobs[:20]}", log_where
                )
            length = len(tokens)
            for t_idx, t in enumerate(tokens):
                if t in eos:
                    length = t_idx + 1
                    break
            b = i * n + j
            response_ids_BR[b, :length] = tokens[:length]
            response_mask_BR[b, :length] = 1
            log_probs_BR[b, :length] = token_logprobs[:length]

    bucket = sampler.bucket_length(prompt_ids_PT.shape[1])
    pad_cols = bucket - prompt_ids_PT.shape[1]
    prompt_ids_PT = np.pad(prompt_ids_PT, ((0, 0), (pad_cols, 0)), constant_values=pad_token_id)
    prompt_mask_PT = np.pad(prompt_mask_PT, ((0, 0), (pad_cols, 0)))
    return sampler.Rollout(
        prompt_ids=jnp.asarray(np.repeat(prompt_ids_PT, n, axis=0)),
        prompt_mask=jnp.asarray(np.repeat(prompt_mask_PT, n, axis=0)),
        response_ids=jnp.asarray(response_ids_BR),
        response_mask=jnp.asarray(response_mask_BR),
        log_probs=jnp.asarray(log_probs_BR),
        group_ids=jnp.asarray(np.repeat(np.arange(num_prompts, dtype=np.int32), n)),
        weights_version=jnp.int32(weights_version),
    )


def _malformed(where: str, msg: str, log_where: str) -> VLLMResponseError:
    return VLLMResponseError(f"malformed vLLM output for {where}: {msg}; server log: {log_where}")
