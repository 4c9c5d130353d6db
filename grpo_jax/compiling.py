"""Several XLA programs compiled at once, one a CPU core at a time.

XLA compiles a program on one thread, and a run meets its programs in families that it can
name before running them: a packed pass at each row count of its token budget
(trainer/train_stage.compile_packed_shapes), the sampler's decode phase at each slot count of its
compaction ladder (sampler.py). Compiling a family together takes about its longest program per
core instead of the sum. The programs are lowered in the calling thread (tracing reads that
thread's mesh and logical-axis rules) and compiled on a pool; each compiled program lands in
jax's caches, where the calls of the same shapes and shardings find it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable

import jax


def compile_all(lowered: Iterable[jax.stages.Lowered]) -> list[jax.stages.Compiled]:
    """Compiles `lowered`, up to one program a CPU core at a time.

    Returns:
      The compiled programs, in order. A compile's error is raised here.
    """
    lowered = list(lowered)
    if len(lowered) <= 1:
        return [low.compile() for low in lowered]
    workers = min(len(lowered), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers, "grpo_jax-compile") as pool:
        return list(pool.map(lambda low: low.compile(), lowered))
