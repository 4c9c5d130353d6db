"""The paged engine's sizes (`plan_pool`): the pool's pages, the slots, the prefill chunks, and
the pool with which no row is ever preempted. Defaults are verl's (vLLM's names).

The engine itself: `rollout.paged` (its module doc has the design).
"""

from __future__ import annotations

import dataclasses

# verl 0.9.1's rollout.max_num_seqs / max_num_batched_tokens defaults (vLLM's names).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
PAGE_SIZE = 16  # vLLM's default block_size
SEGMENT_STEPS = 16  # decode steps between prefill chunks while a prefill is pending


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The sizes of one call's pool and batches (`plan_pool`)."""

    page_size: int
    num_pages: int  # including the trash page
    max_num_seqs: int  # slots S
    prompt_pages: int  # pages of the longest shared prompt part (Mp)
    response_pages: int  # pages of a full response (Mr): a row's most, grown as it decodes
    chunk: int  # prefill chunk width C
    chunk_rows: int  # prompts per prefill call G
    rows: int  # rollout rows (prompts x n) of the shard
    # The pool with which no row is ever preempted (S full responses and the prompts of
    # ceil(S / n) + 1 groups): the scheduler admits rows as if the pool had at least this many
    # pages, and a smaller pool preempts rows when their pages run out.
    reserve_pages: int = 0

    @property
    def admits_pages(self) -> int:
        """The pages (less the trash page) that admission promises to the running rows' full
        responses and the prefilled prompts."""
        return max(self.num_pages, self.reserve_pages) - 1


def plan_pool(
    *,
    num_prompts: int,
    n: int,
    prompt_width: int,
    max_new_tokens: int,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    page_size: int = PAGE_SIZE,
    num_pages: int | None = None,
) -> PoolPlan:
    """The pool and batch sizes of a call: S = min(max_num_seqs, P * n) slots; by default
    (`num_pages` None, rollout.num_gpu_blocks_override unset) the pool holds S full responses
    and the prompts of ceil(S / n) + 1 groups, and no row is ever preempted; a smaller pool
    grows rows page by page and preempts when it runs out (rollout.paged's module doc).

    Raises:
      ValueError naming the knobs, when the pool cannot hold one row's prompt and first page,
      or one row's full length (a row that draws no EOS could never finish).
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"rollout.{name}={value} must be >= 1")
    slots = min(max_num_seqs, num_prompts * n)
    prompt_pages = -(-(prompt_width - 1) // page_size)
    response_pages = -(-max_new_tokens // page_size)
    reserve = 1 + slots * response_pages + (-(-slots // n) + 1) * prompt_pages
    num_pages = reserve if num_pages is None else num_pages
    knobs = (
        "raise the pool (rollout.num_gpu_blocks_override, the num_pages of sample_paged) or "
        "the page size, or shorten data.max_prompt_length / data.max_response_length"
    )
    for what, need in (("its prompt and one page of response", 1 + prompt_pages + 1),
                       ("its full length", 1 + prompt_pages + response_pages)):  # fmt: skip
        if num_pages < need:
            raise ValueError(
                f"a KV pool of {num_pages} pages (num_pages) of {page_size} tokens cannot hold "
                f"one row ({what}): a prompt of {prompt_width} tokens and a response of "
                f"{max_new_tokens} need {prompt_pages} + {response_pages} pages plus the trash "
                f"page ({1 + prompt_pages + response_pages}; a row that draws no EOS could "
                f"never finish in fewer); {knobs}"
            )
    shared = max(prompt_width - 1, 1)
    chunk = min(-(-shared // page_size) * page_size,
                max(page_size, max_num_batched_tokens // page_size * page_size))  # fmt: skip
    chunk_rows = min(num_prompts, max(1, max_num_batched_tokens // chunk))
    return PoolPlan(page_size, num_pages, slots, prompt_pages, response_pages, chunk, chunk_rows,
                    num_prompts * n, reserve)
