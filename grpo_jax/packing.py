"""Token-budget micro-batches: sequences packed several to a row, so padding costs no FLOPs.

verl's `actor.use_dynamic_bsz` / `ppo_max_token_len_per_gpu` (and the log-prob passes'
`rollout.log_prob_use_dynamic_bsz` / `log_prob_max_token_len_per_gpu`) replace a fixed number
of sequences per micro-batch by a token budget. verl removes the padding and runs flash
attention over ragged sequences; under XLA's static shapes the equivalent is packing:

  * A GRPO group's n sequences share their prompt: a row holds one copy of the prompt followed
    by the group's responses (as many as fit; a group too long for one row is split into units,
    each with its own prompt copy). Without padding or repeated prompts the forward and
    backward do the work of sum(prompt) / n + sum(response) tokens instead of
    sum(prompt + response): on GSM8K with n = 4 about a third less, on short answers to long
    prompts several times less. The gradients are the same (the shared prompt's hidden states
    receive the summed cotangents of its responses), up to float summation order.
  * Units (prompt + responses) are packed first-fit-decreasing into rows of `row_len` tokens,
    so every sequence fits a row whole: the run's longest possible sequence
    (data.max_prompt_length + data.max_response_length) rounded up to `LEN_BUCKET`, fixed for
    the run.
  * A micro-batch is `rows` rows, `rows * row_len` <= the token budget of all data devices
    (`cap` rows); a step uses as many micro-batches as its tokens need, and `rows` is the
    largest of cap, cap/2, cap/4, cap/8 that adds at most 25 % empty rows (else the one that
    pads least), so a step with few tokens does not compute a whole budget of empty rows.
  * The model sees per-token positions that restart at 0 for every prompt and continue into
    its responses, segment ids (one per prompt and per response of a row, 0 for the padding
    at a row's end) and each token's prefix segment (its prompt's): a token attends causally
    to its own segment and to its prompt's, never to another response or sequence
    (model.hidden_states_packed).
  * Only the positions that predict a response token are unembedded. The slots are pooled per
    row group (the `row_multiple` = data devices groups of R / G consecutive rows, one group a
    device, so the gather stays on the device): `slots` per group, the most response tokens of
    any group rounded up to an eighth of the group's R / G x L positions (`SLOT_STEPS`). A slot
    indexes its group's positions flattened, (row in group) x L + position. Pooling matters:
    a GSM8K row of 768 holds a prompt and two or three answers, so per-row slots were a whole
    row and the vocabulary projection ran on every position; pooled, it runs on about the
    response tokens (11,520 -> 7,200 slots a step on SmolLM2 / GSM8K-like lengths, 8 x 4).
    Each slot names its (b, t) in the [B, T] response layout, so the losses, which work on
    [B, T], see exactly the unpadded values.

Compiled shapes: row_len is fixed by the run, rows takes one of 4 values and slots one of
`SLOT_STEPS`, and the micro-batch count does not matter (the update and the log-prob passes loop
over micro-batches in Python), so each of the two passes compiles at most 4 x `SLOT_STEPS`
variants in a whole run.

Shapes: B sequences, T response width, M micro-batches, R rows, L row length, G row groups,
N slots per group.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEN_BUCKET = 128
SLOT_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Packed:
    """M micro-batches of R packed rows (host numpy; the leading axis is the micro-batch).

    Attributes:
      tokens_MRL: int32 token ids (pad 0 after a row's last sequence).
      positions_MRL: int32, 0.. within each sequence.
      segments_MRL: int32, 1.. per prompt and per response within its row, 0 on padding.
      prefixes_MRL: int32, the segment a token's sequence continues: its prompt's segment (a
        prompt token's own), 0 on padding.
      slot_pos_MGN: int32, the position in row group g (row within the group x L + position)
        whose hidden state predicts the response token of slot n (0 on empty slots).
      slot_label_MGN: int32, that response token (0 on empty slots).
      slot_bt_MGN: int32, b * T + t of that token in the [B, T] layout; B * T on empty slots.
      num_tokens_M: real tokens per micro-batch (for metrics and the budget).
    """

    tokens_MRL: np.ndarray
    positions_MRL: np.ndarray
    segments_MRL: np.ndarray
    prefixes_MRL: np.ndarray
    slot_pos_MGN: np.ndarray
    slot_label_MGN: np.ndarray
    slot_bt_MGN: np.ndarray
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
            "prefixes_RL": self.prefixes_MRL[m],
            "slot_pos_GN": self.slot_pos_MGN[m],
            "slot_label_GN": self.slot_label_MGN[m],
            "slot_bt_GN": self.slot_bt_MGN[m],
        }


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_length(max_prompt_length: int, max_response_length: int) -> int:
    """The run's packed row length: its longest possible sequence, rounded up to LEN_BUCKET."""
    return _round_up(max_prompt_length + max_response_length, LEN_BUCKET)


MAX_ROW_WASTE = 0.25  # empty rows a micro-batch size may add, as a fraction of the step's rows


def _rows_per_micro(num_rows: int, cap: int, multiple: int) -> int:
    """Rows per micro-batch: the largest of cap, cap/2, cap/4, cap/8 (multiples of `multiple`)
    whose empty rows are at most MAX_ROW_WASTE of the step's rows, else the one padding least,
    so a step with few tokens does not compute a whole budget of empty rows while the common
    case keeps full-size micro-batches (fewer, larger matmuls; one compiled shape). At most four
    values a run: bounded compiled shapes."""
    options = sorted({max(multiple, cap // 2**k // multiple * multiple) for k in range(4)})

    def padded(r):
        return -(-num_rows // r) * r

    fits = [r for r in options if padded(r) <= num_rows * (1 + MAX_ROW_WASTE)]
    return max(fits) if fits else min(options, key=lambda r: (padded(r), -r))


def _units(p_len_B, r_len_B, prompt_key_B, row_len: int) -> list[list[int]]:
    """Sequences grouped into units that share one copy of their prompt: the responses of
    sequences with the same prompt (a GRPO group), in order, as many to a unit as fit a row."""
    families: dict[bytes, list[int]] = {}
    for b, key in enumerate(prompt_key_B):
        families.setdefault(key, []).append(b)
    units = []
    for members in families.values():
        unit, length = [], 0
        for b in members:
            if unit and length + int(r_len_B[b]) > row_len:
                units.append(unit)
                unit, length = [], 0
            if not unit:
                length = int(p_len_B[b])
            unit.append(b)
            length += int(r_len_B[b])
        units.append(unit)
    return units


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
    share_prompts: bool = True,
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
      slot_steps: the slots per row group take one of this many values (multiples of the
        group's positions / slot_steps).
      share_prompts: sequences with the same prompt tokens share one copy of the prompt in a
        row (their responses attend to it); False packs every sequence whole.

    Returns:
      The Packed micro-batches; each response token appears exactly once, in one row, after
      a copy of its prompt.
    """
    B, T = response_ids_BT.shape
    p_len_B = prompt_mask_BP.sum(1).astype(np.int64)
    r_len_B = response_mask_BT.sum(1).astype(np.int64)
    seq_len_B = p_len_B + r_len_B
    longest = int(seq_len_B.max())
    row_len = _round_up(longest, LEN_BUCKET) if row_len is None else row_len
    if longest > row_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit a packed row of {row_len}")
    cap = (max_tokens // row_len) // row_multiple * row_multiple
    if cap < 1:
        raise ValueError(
            f"the token budget of {max_tokens} tokens per micro-batch holds no row of "
            f"{row_len} tokens x {row_multiple} devices (the longest sequence is "
            f"{int(seq_len_B.max())} tokens): raise ppo_max_token_len_per_gpu / "
            f"log_prob_max_token_len_per_gpu to at least {row_len}"
        )
    prompts = [prompt_ids_BP[b][prompt_mask_BP[b] == 1] for b in range(B)]
    keys = [p.tobytes() if share_prompts else b for b, p in enumerate(prompts)]
    units = _units(p_len_B, r_len_B, keys, row_len)
    unit_len = [int(p_len_B[u[0]] + r_len_B[u].sum()) for u in units]

    # First-fit decreasing: longest units first, each into the first row with room.
    rows: list[list[int]] = []
    free: list[int] = []
    for i in np.argsort(-np.asarray(unit_len), kind="stable"):
        need = unit_len[i]
        for r, room in enumerate(free):
            if room >= need:
                rows[r].append(int(i))
                free[r] -= need
                break
        else:
            rows.append([int(i)])
            free.append(row_len - need)
    rows_per_micro = _rows_per_micro(len(rows), cap, row_multiple)
    num_micro = -(-len(rows) // rows_per_micro)
    # Slots are pooled per group of consecutive rows (one group per data device).
    groups = row_multiple
    group_rows = rows_per_micro // groups
    group_len = group_rows * row_len
    # Rows go to (micro-batch, group) bins by longest-processing-time: the row with the most
    # response tokens first, each into the bin with the fewest so far that has room, so the
    # response tokens (the slots) and the tokens spread evenly over the micro-batches.
    resp_per_row = [sum(int(r_len_B[units[u]].sum()) for u in row) for row in rows]
    resp_per_group = np.zeros(num_micro * groups, np.int64)
    rows_in_group = np.zeros(num_micro * groups, np.int64)
    place = [0] * len(rows)  # row i -> m * rows_per_micro + r
    for i in np.argsort(-np.asarray(resp_per_row), kind="stable"):
        open_bins = np.flatnonzero(rows_in_group < group_rows)
        j = int(open_bins[np.argmin(resp_per_group[open_bins])])
        place[i] = j * group_rows + int(rows_in_group[j])
        rows_in_group[j] += 1
        resp_per_group[j] += resp_per_row[i]
    slots = min(group_len, _round_up(max(int(resp_per_group.max()), 1), -(-group_len // slot_steps)))

    shape = (num_micro, rows_per_micro)
    tokens = np.zeros((*shape, row_len), np.int32)
    positions = np.zeros((*shape, row_len), np.int32)
    segments = np.zeros((*shape, row_len), np.int32)
    prefixes = np.zeros((*shape, row_len), np.int32)
    slot_shape = (num_micro, groups, slots)
    slot_pos = np.zeros(slot_shape, np.int32)
    slot_label = np.zeros(slot_shape, np.int32)
    slot_bt = np.full(slot_shape, B * T, np.int32)
    filled = np.zeros((num_micro, groups), np.int64)  # slots used per group
    num_tokens = np.zeros(num_micro, np.int64)
    for i, row in enumerate(rows):
        m, r = divmod(place[i], rows_per_micro)
        g, offset = r // group_rows, (r % group_rows) * row_len  # the row's group, its start
        at = seg = 0
        n = int(filled[m, g])
        for u in row:
            prompt = prompts[units[u][0]]
            p_len = len(prompt)
            seg += 1
            prompt_seg, span = seg, slice(at, at + p_len)
            tokens[m, r, span] = prompt
            positions[m, r, span] = np.arange(p_len)
            segments[m, r, span] = prefixes[m, r, span] = prompt_seg
            last_prompt = at + p_len - 1
            at += p_len
            for b in units[u]:
                k = int(r_len_B[b])
                resp = response_ids_BT[b, :k]
                seg += 1
                span = slice(at, at + k)
                tokens[m, r, span] = resp
                positions[m, r, span] = p_len + np.arange(k)
                segments[m, r, span] = seg
                prefixes[m, r, span] = prompt_seg
                # Response token t is predicted by the position before it: the prompt's last
                # token for t = 0, then the response's own token t - 1.
                slot_pos[m, g, n : n + k] = offset + np.r_[last_prompt, at + np.arange(k - 1)][:k]
                slot_label[m, g, n : n + k] = resp
                slot_bt[m, g, n : n + k] = b * T + np.arange(k)
                at += k
                n += k
        filled[m, g] = n
        num_tokens[m] += at
    return Packed(tokens, positions, segments, prefixes, slot_pos, slot_label, slot_bt, num_tokens)
