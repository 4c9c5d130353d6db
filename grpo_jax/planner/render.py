"""The planner's report (plan.py, `train.py --plan`): the resident bytes, each phase's memory
and peak, the sampler's KV pool, the batch sizes that fit and the advice."""

import math

from grpo_jax import config as config_lib
from grpo_jax.models import lora
from grpo_jax.planner.advice import Fix, advise, fits_peak
from grpo_jax.planner.devices import GIB
from grpo_jax.planner.phases import CPU_ONLY_HOIST, PhaseMemory, Planner, from_run, largest


def _gb(x: float) -> str:
    return f"{x / GIB:8.2f}"


def plan(
    planner: Planner,
    *,
    hbm_bytes: int,
    search: bool = True,
    max_micro: int = 64,
    advice: bool = True,
) -> str:
    """Compiles every phase, searches the batch sizes that fit, returns the report text.

    ``hbm_bytes`` is the usable memory of one device; with rollout.name="vllm" JAX budgets
    its 1 - rollout.vllm.gpu_memory_utilization share of it (`Planner.jax_share`). When the
    step does not fit and ``advice`` is set, the report ends with the changes that make it fit
    (`advise`).
    """
    p, w = planner, planner.w
    budget = int(hbm_bytes * p.jax_share())
    share = (
        f" (JAX's {p.jax_share():.2f} of {hbm_bytes / GIB:.1f}; the vLLM sidecar holds the rest)"
        if w.vllm
        else ""
    )
    batching = (
        f"token budget {w.tokens_per_device}/device (rows of {w.row_len})"
        if w.packed
        else f"micro {w.micro_per_device}/device"
    )
    lines = [
        (
            f"model: {p.cfg.arch} L={p.cfg.num_layers} D={p.cfg.hidden_size} N={p.cfg.num_heads} "
            f"K={p.cfg.num_kv_heads} H={p.cfg.head_dim} F={p.cfg.intermediate_size} "
            f"V={p.cfg.vocab_size} ({p.num_params / 1e9:.2f}B) params={p.cfg.param_dtype} "
            f"compute={p.cfg.dtype} remat={p.cfg.remat} attention={p.cfg.attention_impl}"
            f"{_attention_note(p)}{_moe_note(p)}"
        ),
        (
            f"mesh: {dict(p.mesh.shape)} on {p.mesh.devices.size} x "
            f"{p.mesh.devices.flat[0].platform}"
            f" | budget {budget / GIB:.1f} GiB/device{share}"
        ),
        *(
            [
                f"compiled by the {p.backend.upper()} compiler itself, ahead of time for "
                f"{p.mesh.devices.flat[0].device_kind} (tpu_topology): XLA's own buffers, "
                "no stand-ins"
            ]
            if p.native
            else []
        ),
        *(
            [
                f"compiled for {p.backend} in {p.cfg.dtype}: XLA:CPU without "
                f"{CPU_ONLY_HOIST} (it hoists a float32 copy of the remat's bf16 layer stack "
                "that native-bf16 backends never make; Planner.compiler_options)"
            ]
            if p.compiler_options()
            else []
        ),
        (
            f"step: P={w.prompts} prompts x n={w.n}, Tp={w.prompt_len}, T={w.response_len}, "
            f"mini-batch {w.mini_rows} seqs, {batching}, "
            f"ref={'yes' if w.needs_ref else 'no'}, old log-probs={'yes' if w.needs_old else 'no'}"
        ),
        "",
        f"{'per-device GiB':<{_W}}" + "".join(f"| {h:>8} " for h in _COLUMNS) + "|     PEAK",
        "-" * _W + "|----------" * 5 + "|---------",
        f"{'base params (frozen)' if p.lora else 'params':<{_W}}| {_gb(p.param_bytes)} |",
        *([f"{'LoRA adapters (f32)':<{_W}}| {_gb(p.adapter_bytes)} |"] if p.lora else []),
        f"{'optimizer state':<{_W}}| {_gb(p.opt_bytes)} |",
        f"{'reference params':<{_W}}| {_gb(p.ref_bytes)} |",
        *([f"{'step batch':<{_W}}| {_gb(p.batch_bytes)} |"] if w.packed else []),
    ]
    phases = p.phases()
    for ph in phases:
        m = ph.memory
        lines.append(
            f"{ph.label:<{_W}}|          | {_gb(m.argument)} | {_gb(m.output)} | {_gb(m.alias)} |"
            f" {_gb(m.temp)} | {_gb(ph.peak)}"
            + (" (at least: the TPU compiler refused it, over the chip's HBM)"
               if m.refused_by_compiler else "")  # fmt: skip
        )
    peak = max(ph.peak for ph in phases)
    lines += [
        "",
        *(_vllm_lines(p, hbm_bytes) if w.vllm else _sample_lines(p)),
        (
            f"logits chunk f32 (train, one)    {_gb(p.train_logits_bytes())} GiB "
            f"(loss chunk_size={p.loss_config.chunk_size} rows)"
        ),
        *_lora_lines(p),
        f"step peak {peak / GIB:.2f} GiB/device -> "
        + ("FITS" if peak <= budget else "DOES NOT FIT")
        + f" in {budget / GIB:.1f} GiB",
    ]
    if search:
        for ph in phases:
            knob = p.knob(ph.name, max_micro=max_micro)
            if knob is None:
                continue
            best, seen = largest(knob.candidates, lambda v, k=knob: fits_peak(k.peak(v), budget))
            tried = ", ".join(f"{v}:{x / GIB:.1f}" for v, x in sorted(seen.items()))
            lines.append(
                f"largest {knob.field} that fits: {best} (now {knob.value}; tried value:peak GiB"
                f" {tried})"
            )
    if advice and peak > budget:
        lines += ["", *_advice_lines(advise(p, budget, max_micro=max_micro), budget)]
        if w.vllm:
            lines += _vllm_alternative(p, hbm_bytes, peak)
    return "\n".join(lines)


_W = 26  # the report's label column
_COLUMNS = ("resident", "argument", "output", "donated", "temp")


def _advice_lines(fix: Fix, budget: int) -> list[str]:
    lines = [f"to fit in {budget / GIB:.1f} GiB/device:"]
    for a in fix.advice:
        change = ", ".join(f"{k}={v}" for k, v in a.overrides)
        lines.append(f"  {a.phase}: set {change} -> {a.peak / GIB:.1f} GiB ({a.why})")
    lines += [f"  {u}" for u in fix.unresolved]
    if fix.advice:
        verdict = "FITS" if fix.fits else "still DOES NOT FIT"
        lines += [
            f"  with all of them (re-planned): step peak {fix.peak / GIB:.2f} GiB -> {verdict}",
            f"  flags: {fix.flags()}",
        ]
    return lines


def _sample_lines(p: Planner) -> list[str]:
    prompts, w = p.w.prompts, p.w
    if p.is_paged(prompts):
        plan, shards = p.pool_plan(prompts), p.sample_shards(prompts)
        rows = prompts * w.n // shards
        waves = -(-rows // plan.max_num_seqs)
        return [
            f"KV page pool (sample, analytic)  {_gb(p.kv_cache_bytes(prompts))} GiB/device: "
            f"{plan.num_pages} pages of {plan.page_size} tokens a data shard x {shards} shards"
            + (f" (rollout.num_gpu_blocks_override; under the {plan.reserve_pages} that never "
               "preempt: rows grow page by page, the newest preempted when the pool runs out)"
               if plan.num_pages < plan.reserve_pages else ""),
            f"paged engine: {plan.max_num_seqs} rows in flight a shard (rollout.max_num_seqs) of "
            f"{rows}; at most {waves} x {w.response_len} = {waves * w.response_len} decode steps "
            f"(fewer as rows finish early); prefill {plan.chunk_rows} x {plan.chunk} tokens a "
            "call; "
            f"decode attention {_PAGED_ATTENTION[p.paged_attention()]}",
            f"logits [slots,V] f32 (sample)    "
            f"{_gb(plan.max_num_seqs * p.cfg.vocab_size * 4)} GiB/device",
        ]
    return [
        f"KV cache (sample, analytic)      {_gb(p.kv_cache_bytes(prompts))} GiB/device",
        f"logits [rows,V] f32 (sample)     {_gb(p.sample_logits_bytes(prompts))} GiB/device",
    ]


def _vllm_bytes(p: Planner) -> tuple[float, int]:
    """(weights, KV cache per token) of the sidecar on each of its GPUs, bytes (analytic)."""
    r, c = p.run.rollout, p.cfg
    tp = r.tensor_model_parallel_size
    itemsize = {"float32": 4, "auto": c.param_dtype.itemsize}.get(r.vllm.dtype, 2)
    kv_heads = max(1, c.num_kv_heads // tp)  # vLLM replicates KV heads when TP > K
    return p.num_params * itemsize / tp, 2 * c.num_layers * kv_heads * c.head_dim * itemsize


def _vllm_alternative(p: Planner, hbm_bytes: int, peak: int) -> list[str]:
    """Instead of smaller batches: a smaller vLLM share, if the sidecar still holds its weights
    and the KV cache of one sequence (analytic; JAX's programs and peaks stay the same)."""
    weights, kv_per_token = _vllm_bytes(p)
    share = math.floor((1 - peak / hbm_bytes) * 100) / 100
    tokens = int((share * hbm_bytes - weights) // kv_per_token)
    if tokens < p.w.prompt_len + p.w.response_len:
        return [f"  (a smaller vLLM share cannot help: JAX alone needs {peak / GIB:.1f} GiB)"]
    jax_gib = (1 - share) * hbm_bytes / GIB
    return [
        (
            f"  or keep the batches: rollout.vllm.gpu_memory_utilization={share} and "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={1 - share:.2f}"
        ),
        f"    (JAX's share {jax_gib:.1f} GiB; vLLM's KV cache {tokens} tokens)",
    ]


def _vllm_lines(p: Planner, hbm_bytes: int) -> list[str]:
    """The sidecar's side of the GPUs it runs on (analytic): weights and KV-cache room."""
    r, w = p.run.rollout, p.w
    tp, share = r.tensor_model_parallel_size, r.vllm.gpu_memory_utilization
    weights, kv_per_token = _vllm_bytes(p)
    room = share * hbm_bytes - weights
    tokens = max(0, int(room // kv_per_token))
    seq = w.prompt_len + w.response_len
    lines = [
        (
            f"vLLM sidecar (analytic): gpu_memory_utilization={share} of each of its "
            f"tensor_model_parallel_size={tp} GPUs = {share * hbm_bytes / GIB:.1f} GiB: weights "
            f"{weights / GIB:.2f} GiB,"
        ),
        (
            f"  KV-cache room {room / GIB:.1f} GiB = {tokens} tokens = {tokens // seq} sequences "
            f"of {seq} tokens at once (of {w.prompts * w.n} a step)"
        ),
    ]
    if tokens < seq:
        need = (weights + seq * kv_per_token) / hbm_bytes
        lines.append(
            f"vLLM DOES NOT FIT one sequence: raise rollout.vllm.gpu_memory_utilization to at "
            f"least {need:.2f} or rollout.tensor_model_parallel_size"
        )
    return lines


def _lora_lines(p: Planner) -> list[str]:
    """With LoRA: the adapters, and what full fine-tuning would hold resident instead."""
    if not p.lora:
        return []
    c = p.cfg
    return [
        (
            f"LoRA r={c.lora_rank} alpha={c.lora_alpha:g} on {','.join(c.lora_targets)}: "
            f"{lora.num_params(c) / 1e6:.2f}M trainable params"
        ),
        (
            f"LoRA vs full fine-tuning, resident GiB/device: optimizer {_gb(p.opt_bytes).strip()}"
            f" vs {_gb(p.full_opt_bytes).strip()}, reference {_gb(p.ref_bytes).strip()} vs "
            f"{_gb(p.full_ref_bytes).strip()}, adapters +{_gb(p.adapter_bytes).strip()}: saves "
            f"{p.lora_saved_bytes() / GIB:.2f} GiB/device"
        ),
    ]


def _fits(m: PhaseMemory, peak_fn, budget) -> tuple[bool, int]:
    return fits_peak(peak_fn(m), budget)


def _attention_note(p: Planner) -> str:
    if p.stand_in_for == "splash":
        return (
            " (for tpu: splash attention, a Pallas TPU kernel that compiles for TPUs only; "
            "planned with the blockwise kernel as its memory stand-in: both keep per-row "
            "statistics and one block pair of scores, linear in the row)"
        )
    if p.stand_in_for == "cudnn":
        return (
            " (for gpu: cuDNN's fused attention, which cannot compile on CPU; planned with the "
            "blockwise kernel as its memory stand-in, plus cuDNN's [B,1,T,T] mask bias of T^2 x "
            "2 bytes a row, not counted)"
        )
    if p.backend in ("gpu", "tpu") and p.cfg.attention_impl == "blockwise":
        return f" (for {p.backend}: the linear-memory blockwise kernel, compiled here on CPU)"
    return ""


def _moe_note(p: Planner) -> str:
    c = p.cfg
    if not c.num_experts:
        return ""
    experts = (
        f" | MoE: {c.num_moe_layers} layers of E={c.num_experts} experts, top-"
        f"{c.num_experts_per_tok}, F={c.moe_intermediate_size}"
    )
    if p.moe_stand_in:
        return experts + (
            f" (for {p.backend}: a grouped matmul; XLA:CPU's ragged_dot is a dense masked dot "
            "over every expert, so planned with a balanced-capacity stand-in of the grouped "
            "matmul's buffers, [E, C, D] @ [E, D, F] with C = assignments / E)"
        )
    return experts


_PAGED_ATTENTION = {
    "pallas": "Pallas TPU paged-attention kernel (per chip, in a shard_map)",
    "xla": "XLA (gathers each row's pages)",
}


def report(
    run: config_lib.RunConfig,
    *,
    model_name: str = "",
    hbm_gib: float,
    usable_fraction: float = 0.9,
    search: bool = True,
    max_micro: int = 64,
    backend: str | None = None,
    devices=None,
) -> str:
    """The memory report of `run` (plan.py, ``train.py --plan``): see the package docstring
    (grpo_jax/planner/__init__.py)."""
    planner = from_run(run, model_name=model_name, backend=backend, devices=devices)
    return plan(
        planner, hbm_bytes=int(hbm_gib * GIB * usable_fraction), search=search, max_micro=max_micro
    )
