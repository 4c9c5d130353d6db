"""verl's performance metrics of a step: timing_per_token_ms/*, perf/total_num_tokens,
perf/time_per_step, perf/throughput, global_seqlen/*, actor/perf/*_memory_* and perf/mfu/actor
(model FLOP utilisation of the update, verl's analytic FLOP count).

verl 0.9.1 definitions (verl/trainer/ppo/metric_utils.py, verl/utils/seqlen_balancing.py,
verl/workers/engine_workers.py):

* `timing_per_token_ms/<stage>`: the stage's seconds x 1000 per token; "gen" counts response
  tokens, "ref", "adv" and "update_actor" count prompt + response tokens.
* `global_seqlen/{min,max,minmax_diff,mean}`: the sum of sequence lengths (prompt + response)
  held by each data-parallel rank, as the batch's contiguous shares (before verl's reorder).
  With trainer.balance_batch also `balanced_min/max`, the least and most of the balanced
  parts (trainer/balance.py).
* `actor/perf/max_memory_allocated_gb` / `actor/perf/max_memory_reserved_gb` /
  `actor/perf/cpu_memory_used_gb` (verl/workers/engine_workers.py `_postprocess_output`, logged
  after every mini-batch of the update under the worker's "actor/" prefix; the trainer keeps the
  largest of the max_memory_* values and the mean of cpu_memory_used_gb): torch's peak
  allocated device memory, the peak its caching allocator held, and psutil's used memory of
  the machine. Here, sampled once after the update: the largest `peak_bytes_in_use` and
  `peak_pool_bytes` (the peak of XLA's BFC allocator pool, the counterpart of torch's reserved
  memory) over the local devices, and MemTotal - MemAvailable of /proc/meminfo (psutil's
  `used` on Linux). A key is absent when nothing measures it: the device keys on CPU, whose
  devices report no memory stats (and on a backend without that stat), the machine's memory
  without /proc/meminfo.
* `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb` (grpo_jax's earlier names,
  kept): the same values as the actor/perf/ keys. `perf/cpu_memory_used_gb` (grpo_jax's, not
  verl's meaning): this process's peak resident memory.
* `timing_s/compile` (grpo_jax's, not verl's): the seconds the step spent tracing, lowering and
  compiling (`compile_stats`), included in `timing_s/step`; a new prompt-length bucket or
  packed micro-batch shape compiles once in a run.
* `timing_s/<stage>`: the wall seconds of a stage (`timed`), its device work included.
* `perf/mfu/actor`: the update's FLOPs / (its seconds x devices x peak FLOP/s per device). The
  FLOPs are verl's analytic estimate (`estimate_flops`: verl/utils/flops_counter.py
  `_estimate_qwen2_flops`, which verl uses for Qwen2, Qwen3 and Llama) of every sequence of
  every mini-batch and epoch: valid tokens only, no recomputation, no padding. The peak is
  trainer.device_peak_tflops, else a table of accelerator bf16 dense peaks by device kind;
  without either the metric is not logged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import threading
import time
from collections.abc import Mapping

import jax
import numpy as np

from grpo_jax import errors

# Dense bf16 peak TFLOP/s per device, by jax Device.device_kind (vendor data sheets).
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5": 459.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
}

_TOKENS_OF = {"gen": "response", "ref": "all", "adv": "all", "update_actor": "all"}


def timed(timing: dict, key: str, fn, *args, add: bool = False, **kwargs):
    """fn(*args, **kwargs) to completion (the device work it started included: its result is
    `jax.block_until_ready`), its seconds under timing["timing_s/<key>"] (added with `add`)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    seconds = time.perf_counter() - t0
    name = f"timing_s/{key}"
    timing[name] = timing.get(name, 0.0) + seconds if add else seconds
    return out


def timing_per_token(timing: Mapping[str, float], *, prompt_tokens: int,
                     response_tokens: int) -> dict[str, float]:
    """timing_per_token_ms/<stage> for the timed stages verl normalises (see module doc)."""
    counts = {"response": response_tokens, "all": prompt_tokens + response_tokens}
    out = {}
    for stage, which in _TOKENS_OF.items():
        seconds = timing.get(f"timing_s/{stage}")
        if seconds is not None:
            n = counts[which]
            out[f"timing_per_token_ms/{stage}"] = seconds * 1000 / n if n > 0 else 0.0
    return out


def throughput(total_num_tokens: int, step_seconds: float, *, devices: int) -> dict[str, float]:
    """verl's compute_throughout_metrics: the step's prompt + response tokens, its seconds
    (timing_s/step) and the tokens per second per device."""
    return {
        "perf/total_num_tokens": total_num_tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_num_tokens / (step_seconds * devices),
    }


def global_seqlen(seq_lengths_B, dp: int) -> dict[str, float]:
    """global_seqlen/*: per data-parallel rank, the summed lengths of its contiguous rows."""
    per_rank = np.asarray(seq_lengths_B, np.int64).reshape(dp, -1).sum(1)
    return {
        "global_seqlen/min": int(per_rank.min()),
        "global_seqlen/max": int(per_rank.max()),
        "global_seqlen/minmax_diff": int(per_rank.max() - per_rank.min()),
        "global_seqlen/mean": float(per_rank.mean()),
    }


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _glibc()


def trim_host_memory() -> None:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim). XLA:CPU's buffers
    are malloc'ed; those a stage frees stay in glibc's arenas, counted in the resident memory,
    until something trims them, so the next stage's peak adds to the last one's leftovers."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _machine_used_bytes() -> int | None:
    """The machine's used memory as psutil (verl) counts it on Linux: MemTotal - MemAvailable
    of /proc/meminfo; None without /proc/meminfo (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, v in fields.items() if k in ("MemTotal", "MemAvailable")}
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


def memory(devices=None) -> dict[str, float]:
    """The update's memory metrics (see the module docstring), in GiB.

    Args:
      devices: whose allocator stats count (default jax.local_devices()).
    """
    gib = 1024**3
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out = {"perf/cpu_memory_used_gb": peak_rss / gib}
    used = _machine_used_bytes()
    if used is not None:
        out["actor/perf/cpu_memory_used_gb"] = used / gib
    stats = [d.memory_stats() for d in (jax.local_devices() if devices is None else devices)]
    stats = [s for s in stats if s]  # CPU devices report none
    for name, key in (("allocated", "peak_bytes_in_use"), ("reserved", "peak_pool_bytes")):
        values = [s[key] for s in stats if key in s]
        if values:
            out[f"actor/perf/max_memory_{name}_gb"] = max(values) / gib
            out[f"perf/max_memory_{name}_gb"] = max(values) / gib  # grpo_jax's earlier name
    return out


# jax.monitoring events whose durations are compilation (trace, lowering, XLA compile); the last
# fires once per new XLA program, read from the persistent cache or compiled.
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})  # fmt: skip
_PROGRAM_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """What this process has compiled since grpo_jax.trainer.perf was imported (any thread)."""

    seconds: float = 0.0  # tracing, lowering and XLA compiles (cache reads included)
    programs: int = 0  # new XLA programs: compiled, or read from the persistent cache
    cache_hits: int = 0  # of those, read from the persistent compilation cache
    names: tuple[str, ...] = ()  # the jitted functions of those programs, in order

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            self.seconds - other.seconds,
            self.programs - other.programs,
            self.cache_hits - other.cache_hits,
            self.names[len(other.names) :],
        )

    def metrics(self) -> dict[str, float]:
        """A step's `perf/compiled_programs` and `perf/compile_cache_hits` (its seconds are
        `timing_s/compile`)."""
        return {
            "perf/compiled_programs": self.programs,
            "perf/compile_cache_hits": self.cache_hits,
        }


# Running totals since import; compile_stats() snapshots them.
_compile = {"seconds": 0.0, "programs": 0, "cache_hits": 0}
_compile_names: list[str] = []
_compile_lock = threading.Lock()


def _on_duration(event: str, seconds: float, fun_name: str = "?", **_) -> None:
    if event in _COMPILE_EVENTS:
        with _compile_lock:
            _compile["seconds"] += seconds
            if event == _PROGRAM_EVENT:
                _compile["programs"] += 1
                _compile_names.append(fun_name)


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
        with _compile_lock:
            _compile["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_stats() -> CompileStats:
    """This process's compilation so far: a step's difference gives its `timing_s/compile`
    (the part of its time a longer run, or a later run with the persistent cache, does not pay
    again) and how many programs it added."""
    with _compile_lock:
        return CompileStats(**_compile, names=tuple(_compile_names))


def use_compilation_cache(directory: str) -> str | None:
    """Turns on JAX's persistent compilation cache in `directory` (trainer.compilation_cache_dir;
    "" = off), unless JAX_COMPILATION_CACHE_DIR is set, which JAX has already applied. Every
    program is stored, however fast it compiled (JAX's default keeps those of a second or more;
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, wins): a run compiles dozens of
    small programs, together seconds; a later process with the same program, compile options,
    XLA flags and jax/jaxlib versions reads it instead of compiling. Returns the directory in
    use, or None."""
    from_env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not from_env and not directory:
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if from_env:
        return from_env
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise errors.InputError(
            f"trainer.compilation_cache_dir={directory!r} cannot be created ({e}); point it "
            "at a writable directory or set it to '' to turn the cache off"
        ) from e
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def peak_flops_per_device(override_tflops: float = 0.0) -> float | None:
    """trainer.device_peak_tflops (> 0) x 1e12, else the table's entry for this device kind."""
    if override_tflops > 0:
        return override_tflops * 1e12
    tflops = PEAK_TFLOPS.get(jax.devices()[0].device_kind)
    return None if tflops is None else tflops * 1e12


def estimate_flops(config, seqlens) -> float:
    """verl 0.9.1's FLOPs of one forward + backward over sequences of `seqlens` valid tokens.

    verl/utils/flops_counter.py `_estimate_qwen2_flops` (Qwen2, Qwen3, Llama): 6 x the dense
    parameters (the layers' projections, plus embedding and head counted as 2 x V x D) x the
    tokens, plus 6 x sum(len^2) x N x H x L for the attention products (verl counts the full
    square, not the causal half).

    Args:
      config: a model.ModelConfig (hidden_size, vocab_size, num_layers, num_heads, num_kv_heads,
        head_dim, intermediate_size; MoE layers count their active experts, as verl's
        flops counter does for qwen3_moe).
      seqlens: each sequence's valid tokens (prompt + response).
    """
    c = config
    q = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    attn = c.hidden_size * (2 * q + 2 * kv)
    # A MoE layer's active parameters: the router and the k experts a token goes through.
    moe = c.hidden_size * (c.num_experts + 3 * c.num_experts_per_tok * c.moe_intermediate_size)
    ffn = sum(moe if is_moe else 3 * c.hidden_size * c.intermediate_size for is_moe in c.moe_layers)
    dense = attn * c.num_layers + ffn + 2 * c.vocab_size * c.hidden_size
    lengths = np.asarray(seqlens, np.float64)
    attention = 6 * float(np.sum(lengths**2)) * c.head_dim * c.num_heads * c.num_layers
    return 6 * dense * float(np.sum(lengths)) + attention


def mfu(flops: float, seconds: float, *, devices: int, peak_flops: float | None) -> dict:
    """perf/mfu/actor (and the achieved perf/actor_tflops_per_device), or {} without a peak."""
    if seconds <= 0 or flops <= 0:
        return {}
    achieved = flops / seconds / devices
    out = {"perf/actor_tflops_per_device": achieved / 1e12}
    if peak_flops:
        out["perf/mfu/actor"] = achieved / peak_flops
    return out
