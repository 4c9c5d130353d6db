"""Token-budget micro-batches: sequences packed several to a row, so padding costs no FLOPs.

verl's `actor.use_dynamic_bsz` / `ppo_max_token_len_per_gpu` (and the log-prob passes'
`rollout.log_prob_use_dynamic_bsz` / `log_prob_max_token_len_per_gpu`) replace a fixed number
of sequences per micro-batch by a token budget. verl removes the padding and runs flash
attention over ragged sequences; under XLA's static shapes the equivalent is packing:

  * Each sequence is its real prompt tokens followed by its real response tokens (no padding).
  * Sequences are packed first-fit-decreasing into rows of `row_len` tokens, so every sequence
    fits a row whole: the run's longest possible sequence (data.max_prompt_length +
    data.max_response_length) rounded up to `LEN_BUCKET`, fixed for the run.
  * A micro-batch is `rows` rows, `rows * row_len` <= the token budget of all data devices; a
    step uses as many micro-batches as its tokens need.
  * The model sees per-token positions that restart at 0 for every sequence and segment ids
    (1, 2, ... per sequence of a row, 0 for the padding at a row's end): attention is causal
    within a segment and never crosses one (model.hidden_states_packed).
  * Only the positions that predict a response token are unembedded: `slots` per row, the most
    response tokens of any row rounded up to a quarter of `row_len` (`SLOT_STEPS`). Each slot
    names its (b, t) in the [B, T] response layout, so the losses, which work on [B, T], see
    exactly the unpadded values.

Compiled shapes: rows and row_len are fixed by the run, slots takes one of `SLOT_STEPS`
values, and the micro-batch count does not matter (the update and the log-prob passes loop over
micro-batches in Python), so each of the two passes compiles at most `SLOT_STEPS` variants in a
whole run.

Shapes: B sequences, T response width, M micro-batches, R rows, L row length, N slots per row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEN_BUCKET = 128
SLOT_STEPS = 4


@dataclasses.dataclass(frozen=True)
class Packed:
    """M micro-batches of R packed rows (host numpy; the leading axis is the micro-batch).

    Attributes:
      tokens_MRL: int32 token ids (pad 0 after a row's last sequence).
      positions_MRL: int32, 0.. within each sequence.
      segments_MRL: int32, 1.. per sequence within its row, 0 on padding.
      slot_pos_MRN: int32, the row position whose hidden state predicts the response token of
        slot n (0 on empty slots).
      slot_label_MRN: int32, that response token (0 on empty slots).
      slot_bt_MRN: int32, b * T + t of that token in the [B, T] layout; B * T on empty slots.
      num_tokens_M: real tokens per micro-batch (for metrics and the budget).
    """

    tokens_MRL: np.ndarray
    positions_MRL: np.ndarray
    segments_MRL: np.ndarray
    slot_pos_MRN: np.ndarray
    slot_label_MRN: np.ndarray
    slot_bt_MRN: np.ndarray
    num_tokens_M: np.ndarray

    @property
    def num_micro(self) -> int:
        return self.tokens_MRL.shape[0]

    def micro(self, m: int) -> dict[str, np.ndarray]:
        """The arrays of micro-batch m, as the jitted functions take them."""
        return {
            "tokens_RL": self.tokens_MRL[m],
            "positions_RL": self.positions_MRL[m],
            "segments_RL": self.segments_MRL[m],
            "slot_pos_RN": self.slot_pos_MRN[m],
            "slot_label_RN": self.slot_label_MRN[m],
            "slot_bt_RN": self.slot_bt_MRN[m],
        }


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_length(max_prompt_length: int, max_response_length: int) -> int:
    """The run's packed row length: its longest possible sequence, rounded up to LEN_BUCKET."""
    return _round_up(max_prompt_length + max_response_length, LEN_BUCKET)


def pack(
    prompt_ids_BP: np.ndarray,
    prompt_mask_BP: np.ndarray,
    response_ids_BT: np.ndarray,
    response_mask_BT: np.ndarray,
    *,
    max_tokens: int,
    row_multiple: int = 1,
    row_len: int | None = None,
    slot_steps: int = SLOT_STEPS,
) -> Packed:
    """Packs B left-padded prompts + right-padded responses into token-budget micro-batches.

    Args:
      prompt_ids_BP, prompt_mask_BP: [B, P] left-padded prompts (mask 1 on real tokens).
      response_ids_BT, response_mask_BT: [B, T] responses (mask 1 up to and including EOS).
      max_tokens: the token budget of one micro-batch over all data devices
        (ppo_max_token_len_per_gpu x data devices); at least one row of the longest sequence.
      row_multiple: rows per micro-batch must be a multiple of this (the data devices, so each
        device gets the same number of rows).
      row_len: tokens per row (the run's `row_length`); None = the longest sequence rounded up
        to LEN_BUCKET.
      slot_steps: the slots per row take one of this many values (multiples of row_len /
        slot_steps).

    Returns:
      The Packed micro-batches; each sequence's tokens appear exactly once, in one row.
    """
    B, T = response_ids_BT.shape
    p_len_B = prompt_mask_BP.sum(1).astype(np.int64)
    r_len_B = response_mask_BT.sum(1).astype(np.int64)
    seq_len_B = p_len_B + r_len_B
    longest = int(seq_len_B.max())
    row_len = _round_up(longest, LEN_BUCKET) if row_len is None else row_len
    if longest > row_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit a packed row of {row_len}")
    rows_per_micro = (max_tokens // row_len) // row_multiple * row_multiple
    if rows_per_micro < 1:
        raise ValueError(
            f"the token budget of {max_tokens} tokens per micro-batch holds no row of "
            f"{row_len} tokens x {row_multiple} devices (the longest sequence is "
            f"{int(seq_len_B.max())} tokens): raise ppo_max_token_len_per_gpu / "
            f"log_prob_max_token_len_per_gpu to at least {row_len}"
        )

    # First-fit decreasing: longest sequences first, each into the first row with room.
    rows: list[list[int]] = []
    free: list[int] = []
    for b in np.argsort(-seq_len_B, kind="stable"):
        need = int(seq_len_B[b])
        for r, room in enumerate(free):
            if room >= need:
                rows[r].append(int(b))
                free[r] -= need
                break
        else:
            rows.append([int(b)])
            free.append(row_len - need)
    num_micro = -(-len(rows) // rows_per_micro)
    resp_per_row = [int(sum(r_len_B[b] for b in row)) for row in rows]
    slots = min(row_len, _round_up(max(max(resp_per_row), 1), -(-row_len // slot_steps)))

    shape = (num_micro, rows_per_micro)
    tokens = np.zeros((*shape, row_len), np.int32)
    positions = np.zeros((*shape, row_len), np.int32)
    segments = np.zeros((*shape, row_len), np.int32)
    slot_pos = np.zeros((*shape, slots), np.int32)
    slot_label = np.zeros((*shape, slots), np.int32)
    slot_bt = np.full((*shape, slots), B * T, np.int32)
    num_tokens = np.zeros(num_micro, np.int64)
    for i, row in enumerate(rows):
        m, r = divmod(i, rows_per_micro)
        at = n = 0
        for seg, b in enumerate(row, start=1):
            prompt = prompt_ids_BP[b][prompt_mask_BP[b] == 1]
            resp = response_ids_BT[b, : r_len_B[b]]
            seq = np.concatenate([prompt, resp])
            span = slice(at, at + len(seq))
            tokens[m, r, span] = seq
            positions[m, r, span] = np.arange(len(seq))
            segments[m, r, span] = seg
            # Response token t sits at row position at + len(prompt) + t, predicted by the
            # position before it.
            k = len(resp)
            slot_pos[m, r, n : n + k] = at + len(prompt) - 1 + np.arange(k)
            slot_label[m, r, n : n + k] = resp
            slot_bt[m, r, n : n + k] = b * T + np.arange(k)
            at += len(seq)
            n += k
        num_tokens[m] += at
    return Packed(tokens, positions, segments, slot_pos, slot_label, slot_bt, num_tokens)
