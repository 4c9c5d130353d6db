"""`advise`: which config fields to change, and to what, when the step does not fit (each
change found by compiling the changed phase)."""

import dataclasses
from typing import Any

from grpo_jax.planner.devices import GIB
from grpo_jax.planner.phases import Phase, Planner, largest

# ---------------------------------------------------------------------------------------------
# Advice: which knob to turn, and by how much, when the step does not fit


@dataclasses.dataclass(frozen=True)
class Advice:
    """One change that makes a phase fit, found by compiling the changed phase.

    Attributes:
      phase: the label of the phase that did not fit.
      overrides: ((dotted config field, value), ...) to apply, in order.
      peak: that phase's peak with them, bytes per device.
      why: what the change costs (speed, memory, or the recipe itself).
    """

    phase: str
    overrides: tuple[tuple[str, Any], ...]
    peak: int
    why: str


@dataclasses.dataclass(frozen=True)
class Fix:
    """The outcome of `advise`: the changes, and whether the step fits with all of them.

    Attributes:
      advice: the changes, in the order found.
      fits: whether the re-planned step (every override applied, every phase compiled again)
        fits the budget.
      peak: that re-planned step's peak, bytes per device.
      unresolved: for each phase nothing fixed, why and what is left to try.
    """

    advice: tuple[Advice, ...]
    fits: bool
    peak: int
    unresolved: tuple[str, ...]

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        return _merged(self.advice)

    def flags(self) -> str:
        """The overrides as train.py / plan.py flags."""
        return " ".join(f"--config.{k}={_flag_value(v)}" for k, v in self.overrides)


def _merged(advice) -> tuple[tuple[str, Any], ...]:
    """The overrides of every Advice, a later value of a field replacing an earlier one."""
    merged = {}
    for a in advice:
        merged.update(a.overrides)
    return tuple(merged.items())


def _flag_value(v) -> str:
    if isinstance(v, tuple):
        return '"(' + ",".join(str(x) for x in v) + ')"'
    return str(v)


_KNOB_WHY = {
    "actor.ppo_micro_batch_size_per_gpu": "more, smaller micro-batches: same gradient, slower",
    "rollout.log_prob_micro_batch_size_per_gpu": "more, smaller micro-batches: same log-probs",
    "actor.ppo_max_token_len_per_gpu": "smaller token-budget micro-batches: same gradient, "
    "more of them",
    "rollout.log_prob_max_token_len_per_gpu": "smaller token-budget micro-batches: same "
    "log-probs, more of them",
    "data.train_batch_size": "fewer prompts per step, which changes the recipe: sampling holds "
    "the KV cache of every rollout of the step at once",
    "rollout.max_num_seqs": "fewer rows decoding at once (a smaller KV page pool): the same "
    "rollout, more decode steps",
}


def _escalations(p: Planner, phase: str) -> list[tuple[tuple[str, Any], ...]]:
    """Changes beyond a batch size, cheapest first, each including the ones before it."""
    out, extra = [], ()
    if phase == "train" and not p.cfg.remat:  # the optimizer step keeps no activations
        extra += (("model.enable_gradient_checkpointing", True),)
        out.append(extra)
    data, fsdp, tensor = (p.mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    if data > 1:  # FSDP over the data devices: params and Adam state split, not replicated
        extra += (("mesh.shape", (1, data * fsdp, tensor)),)
        out.append(extra)
    out += [extra + sp for sp in _sequence_parallel_options(p, phase)]
    return out


def _sequence_parallel_options(p: Planner, phase: str) -> list[tuple[tuple[str, Any], ...]]:
    """Ulysses sequence parallelism for a packed pass whose rows are too long for a device:
    actor.ulysses_sequence_parallel_size of 2, 4 or 8 (where it divides the data devices, the
    query heads over tensor x sp and the row), each device's token budgets divided by it, so a
    micro-batch keeps its rows, their tokens split over sp devices."""
    w, run = p.w, p.run
    if phase not in ("train", "logprob") or w.sequence_parallel > 1:
        return []
    if not (w.packed if phase == "train" else w.logprob_packed):
        return []
    tensor, options = p.mesh.shape["tensor"], []
    for sp in (2, 4, 8):
        if p.dp % sp or p.cfg.num_heads % (sp * tensor) or w.row_len % sp:
            continue
        change = (("actor.ulysses_sequence_parallel_size", sp),
                  ("actor.ppo_max_token_len_per_gpu", -(-w.tokens_per_device // sp)))  # fmt: skip
        if run.rollout.log_prob_max_token_len_per_gpu is not None:
            change += (("rollout.log_prob_max_token_len_per_gpu",
                        -(-w.logprob_tokens_per_device // sp)),)  # fmt: skip
        options.append(change)
    return options


def _escalation_why(extra) -> str:
    fields = dict(extra)
    why = []
    if "model.enable_gradient_checkpointing" in fields:
        why.append("gradient checkpointing: each layer is recomputed in the backward (~1/3 more "
                   "update FLOPs)")  # fmt: skip
    if "mesh.shape" in fields:
        why.append("FSDP over all data devices: parameters and Adam state split, not replicated")
    if "actor.ulysses_sequence_parallel_size" in fields:
        sp = fields["actor.ulysses_sequence_parallel_size"]
        why.append(f"sequence parallelism: each row's tokens split over {sp} devices, the same "
                   "micro-batches (per-device token budgets divided by it)")  # fmt: skip
    return "; ".join(why)


def _fix_phase(p: Planner, phase: Phase, budget: int, max_micro: int) -> Advice | str:
    """The first change that makes ``phase`` fit: its batch knob, else escalations (each with
    the knob searched again). A string says why nothing was found."""
    smallest = None
    for extra in [(), *_escalations(p, phase.name)]:
        q = p.variant(extra) if extra else p
        now = next(ph for ph in q.phases() if ph.name == phase.name)
        if extra and now.peak <= budget:
            return Advice(phase.label, extra, now.peak, _escalation_why(extra))
        knob = q.knob(phase.name, max_micro=max_micro)
        if knob is None:
            continue
        below = [v for v in knob.candidates if v < knob.value]
        best, seen = largest(below, lambda v, k=knob: fits_peak(k.peak(v), budget))
        if best is not None:
            why = "; ".join(filter(None, [_escalation_why(extra), _KNOB_WHY[knob.field]]))
            return Advice(phase.label, extra + q.with_knob(knob, best), seen[best], why)
        if below:
            smallest = (knob.field, below[0], seen[below[0]])
    tried = (
        f"; even {smallest[0]}={smallest[1]} needs {smallest[2] / GIB:.1f} GiB" if smallest else ""
    )
    left = [
        f"more devices (FSDP over more than {p.dp})",
        "model.lora_rank > 0 (adapters only, no reference copy)",
    ]
    if phase.name == "sample":
        left.insert(0, "rollout.name=vllm on GPUs (the sidecar samples outside JAX)")
    return (
        f"{phase.label}: {phase.peak / GIB:.1f} GiB of {budget / GIB:.1f}, no change found{tried} "
        f"(resident params + optimizer + reference: {p.resident_bytes / GIB:.1f} GiB); left to "
        "try: " + ", ".join(left)
    )


def fits_peak(peak: int, budget: int) -> tuple[bool, int]:
    return peak <= budget, peak


def advise(planner: Planner, budget: int, *, max_micro: int = 64, max_rounds: int = 3) -> Fix:
    """Finds config changes that make the step fit ``budget`` bytes per device.

    Each phase over the budget gets, in this order: the largest smaller value of its batch
    knob that fits (micro-batch size or token budget: the gradient does not change; for
    sampling, data.train_batch_size: the recipe does), else gradient checkpointing (update
    phases), else FSDP over the data devices, each with the knob searched again. Then every
    change is applied and the whole step planned again, which is what `Fix.fits` reports;
    changes that interact (a smaller batch after a new mesh) get further rounds.
    """
    p, advice, unresolved = planner, [], []
    for _ in range(max_rounds):
        failing = [ph for ph in p.phases() if ph.peak > budget]
        if not failing:
            break
        for ph in failing:
            fix = _fix_phase(p, ph, budget, max_micro)
            if isinstance(fix, str):
                unresolved.append(fix)
            else:
                advice.append(fix)
        if unresolved:
            break
        p = planner.variant(_merged(advice))
    peak = max(ph.peak for ph in p.phases())
    return Fix(tuple(advice), peak <= budget and not unresolved, peak, tuple(unresolved))
