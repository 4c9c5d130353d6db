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
  * A micro-batch holds at most `cap` rows, `cap * row_len` <= the token budget of all data
    devices. A step's rows fill micro-batches of `cap` rows, and the rest go to one last
    micro-batch of the smallest of cap, cap/2, cap/4, cap/8 (rounded up) rows that holds them,
    so a step computes at most that rounding in empty rows (SmolLM2 / GSM8K 8 x 4, 11 rows
    under a 5-row budget: 5 + 5 + 1 rows, where 3 x 5 computed 4 empty rows, 35 % of the
    update's positions).
  * The model sees per-token positions that restart at 0 for every prompt and continue into
    its responses, segment ids (one per prompt and per response of a row, 0 for the padding
    at a row's end) and each token's prefix segment (its prompt's): a token attends causally
    to its own segment and to its prompt's, never to another response or sequence
    (model.hidden_states_packed).
  * Only the positions that predict a response token are unembedded. The slots are pooled per
    row group (the `row_multiple` = data devices groups of R / G consecutive rows, one group a
    device, so the gather stays on the device): a group has one slot per position of its rows
    (N = R / G x L), its response tokens first and empty slots after them. A slot indexes its
    group's positions flattened, (row in group) x L + position. The unembedding runs over the
    slots in `SLOT_CHUNKS` chunks and skips the chunks that hold no response token
    (actor.packed_log_probs), so it costs about the response tokens rounded up to an eighth of
    the positions, while the slot count, a compiled shape, depends on the rows alone. Pooling
    matters: a GSM8K row of 768 holds a prompt and two or three answers, so per-row slots were a
    whole row and the vocabulary projection ran on every position; pooled, it runs on about the
    response tokens (11,520 -> 7,200 positions a step on SmolLM2 / GSM8K-like lengths, 8 x 4).
    Each slot names its (b, t) in the [B, T] response layout, so the losses, which work on
    [B, T], see exactly the unpadded values.

Compiled shapes: row_len is fixed by the run, a micro-batch's rows take one of the 4 values of
`row_options` (and its slots follow from them), and the micro-batch count does not matter (the
update and the log-prob passes loop over micro-batches in Python), so each pass compiles at most
4 variants in a whole run; the trainer compiles all of them in its first step
(train_stage.precompile), so no later step compiles for a new packed shape.

Shapes: B sequences, T response width, M micro-batches, R rows, L row length, G row groups,
N slots per group.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEN_BUCKET = 128
# The packed slots are unembedded in this many chunks; chunks without a response token are skipped.
SLOT_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class Micro:
    """One packed micro-batch of R rows (host numpy).

    Attributes:
      tokens_RL: int32 token ids (pad 0 after a row's last sequence).
      positions_RL: int32, 0.. within each sequence.
      segments_RL: int32, 1.. per prompt and per response within its row, 0 on padding.
      prefixes_RL: int32, the segment a token's sequence continues: its prompt's segment (a
        prompt token's own), 0 on padding.
      slot_pos_GN: int32, the position in row group g (row within the group x L + position)
        whose hidden state predicts the response token of slot n (0 on empty slots); N = the
        group's positions, R / G x L, the used slots first.
      slot_label_GN: int32, that response token (0 on empty slots).
      slot_bt_GN: int32, b * T + t of that token in the [B, T] layout; B * T on empty slots.
      num_tokens: real tokens in the micro-batch (for metrics and the budget).
      routing_RLmLA: with `pack(routing_BLSA=...)` (router replay), the experts of each packed
        token in each of the Lm MoE layers (A = experts per token), the padding's the no-route
        value (the dtype's largest, moe.no_route); else None.
    """

    tokens_RL: np.ndarray
    positions_RL: np.ndarray
    segments_RL: np.ndarray
    prefixes_RL: np.ndarray
    slot_pos_GN: np.ndarray
    slot_label_GN: np.ndarray
    slot_bt_GN: np.ndarray
    num_tokens: int
    routing_RLmLA: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Packed:
    """A step's (or mini-batch's) M packed micro-batches; their row and slot counts differ."""

    micros: tuple[Micro, ...]

    @property
    def num_micro(self) -> int:
        return len(self.micros)

    @property
    def num_tokens_M(self) -> np.ndarray:
        return np.array([m.num_tokens for m in self.micros], np.int64)

    def micro(self, m: int) -> dict[str, np.ndarray]:
        """The arrays of micro-batch m, as the jitted functions take them (routing_RLmLA only
        when recorded)."""
        fields = dataclasses.asdict(self.micros[m])
        del fields["num_tokens"]
        if fields["routing_RLmLA"] is None:
            del fields["routing_RLmLA"]
        return fields


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_length(max_prompt_length: int, max_response_length: int, max_tokens: int = 0) -> int:
    """The run's packed row length: at least its longest possible sequence, rounded up to
    LEN_BUCKET, and of those up to twice as long, the one whose rows use the most of the
    update's token budget `max_tokens` per device (the shortest on ties; 0: the shortest).

    Why the budget: a micro-batch is whole rows, so rows that do not divide the budget leave
    part of it unused, and longer rows hold a GRPO group's prompt and more of its responses
    together. SmolLM2 / GSM8K (512 + 256 tokens, budget 4096): rows of 1024 instead of 768,
    9 rows and 9,216 positions for the 8 x 4 rollout instead of 11 and 8,448 (15 and 11,520
    before the last micro-batch was rounded alone). Attention costs at most twice as much per
    token (row_len <= 2 x the shortest).
    """
    shortest = _round_up(max_prompt_length + max_response_length, LEN_BUCKET)
    if max_tokens < shortest:
        return shortest
    candidates = range(shortest, 2 * shortest + 1, LEN_BUCKET)
    return max(candidates, key=lambda n: (max_tokens // n * n, -n))


def row_options(cap: int, multiple: int) -> list[int]:
    """The rows a micro-batch can have under a cap of `cap` rows: ceil(cap / 2^k), k = 0..3,
    rounded up to multiples of `multiple` (at most four values: the compiled shapes)."""
    return sorted({min(cap, _round_up(-(-cap // 2**k), multiple)) for k in range(4)})


def micro_cap(max_tokens: int, row_len: int, multiple: int) -> int:
    """The most rows of `row_len` tokens a micro-batch holds under the budget `max_tokens`
    (all data devices), a multiple of `multiple` (0: not even one row per device)."""
    return (max_tokens // row_len) // multiple * multiple


def micro_rows(num_rows: int, cap: int, multiple: int) -> list[int]:
    """Rows of each micro-batch: full micro-batches of `cap` rows, then one holding the rest,
    of the smallest of `row_options` that holds it.

    Four values a run at most (bounded compiled shapes); the empty rows computed are those of
    the last micro-batch's rounding only.
    """
    options = row_options(cap, multiple)
    full, rest = divmod(num_rows, cap)
    if rest == 0:
        return [cap] * full
    return [cap] * full + [min(r for r in options if r >= rest)]


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
    share_prompts: bool = True,
    routing_BLSA: np.ndarray | None = None,
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
      share_prompts: sequences with the same prompt tokens share one copy of the prompt in a
        row (their responses attend to it); False packs every sequence whole.
      routing_BLSA: optional [B, Lm, W + T, A] experts of every token of a left-padded prompt
        of W >= its length followed by the response (router replay: TrainBatch's
        routed_experts_BLSA), laid out as the packed tokens (Micro.routing_RLmLA). A shared
        prompt takes its first sequence's: the same tokens, routed the same.

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
    cap = micro_cap(max_tokens, row_len, row_multiple)
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
    sizes = micro_rows(len(rows), cap, row_multiple)
    # Slots are pooled per group of consecutive rows (one group per data device).
    groups = row_multiple
    group_rows = [size // groups for size in sizes]
    # Rows go to (micro-batch, group) bins by longest-processing-time: the row with the most
    # response tokens first, each into the open bin with the fewest per row of its size so far,
    # so the response tokens (the slots) and the tokens spread evenly over the micro-batches.
    bin_rows = np.repeat(group_rows, groups)  # bin j = micro-batch j // groups, group j % groups
    resp_per_row = [sum(int(r_len_B[units[u]].sum()) for u in row) for row in rows]
    resp_per_bin = np.zeros(len(bin_rows), np.int64)
    rows_in_bin = np.zeros(len(bin_rows), np.int64)
    members: list[list[int]] = [[] for _ in bin_rows]  # bin -> rows, in order
    for i in np.argsort(-np.asarray(resp_per_row), kind="stable"):
        open_bins = np.flatnonzero(rows_in_bin < bin_rows)
        j = int(open_bins[np.argmin(resp_per_bin[open_bins] / bin_rows[open_bins])])
        members[j].append(int(i))
        rows_in_bin[j] += 1
        resp_per_bin[j] += resp_per_row[i]

    micros = []
    for m, size in enumerate(sizes):
        slots = group_rows[m] * row_len
        tokens = np.zeros((size, row_len), np.int32)
        positions = np.zeros((size, row_len), np.int32)
        segments = np.zeros((size, row_len), np.int32)
        prefixes = np.zeros((size, row_len), np.int32)
        slot_pos = np.zeros((groups, slots), np.int32)
        slot_label = np.zeros((groups, slots), np.int32)
        slot_bt = np.full((groups, slots), B * T, np.int32)
        routing = None
        if routing_BLSA is not None:
            Lm, A, dtype = routing_BLSA.shape[1], routing_BLSA.shape[3], routing_BLSA.dtype
            routing = np.full((size, Lm, row_len, A), np.iinfo(dtype).max, dtype)
            width = routing_BLSA.shape[2] - T  # the routing's prompt columns
        num_tokens = 0
        for g in range(groups):
            n = 0  # slots used in group g
            for k, i in enumerate(members[m * groups + g]):
                r = g * group_rows[m] + k
                offset = k * row_len  # the row's start in its group's positions
                at = seg = 0
                for u in rows[i]:
                    prompt = prompts[units[u][0]]
                    p_len = len(prompt)
                    seg += 1
                    prompt_seg, span = seg, slice(at, at + p_len)
                    tokens[r, span] = prompt
                    positions[r, span] = np.arange(p_len)
                    segments[r, span] = prefixes[r, span] = prompt_seg
                    if routing is not None:
                        routing[r, :, span] = routing_BLSA[units[u][0], :, width - p_len : width]
                    last_prompt = at + p_len - 1
                    at += p_len
                    for b in units[u]:
                        k_len = int(r_len_B[b])
                        resp = response_ids_BT[b, :k_len]
                        seg += 1
                        span = slice(at, at + k_len)
                        tokens[r, span] = resp
                        positions[r, span] = p_len + np.arange(k_len)
                        segments[r, span] = seg
                        prefixes[r, span] = prompt_seg
                        if routing is not None:
                            routing[r, :, span] = routing_BLSA[b, :, width : width + k_len]
                        # Response token t is predicted by the position before it: the prompt's
                        # last token for t = 0, then the response's own token t - 1.
                        pred = np.r_[last_prompt, at + np.arange(k_len - 1)][:k_len]
                        slot_pos[g, n : n + k_len] = offset + pred
                        slot_label[g, n : n + k_len] = resp
                        slot_bt[g, n : n + k_len] = b * T + np.arange(k_len)
                        at += k_len
                        n += k_len
                num_tokens += at
        micros.append(Micro(tokens, positions, segments, prefixes, slot_pos, slot_label, slot_bt,
                            num_tokens, routing))  # fmt: skip
    return Packed(tuple(micros))
