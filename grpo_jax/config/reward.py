"""Sections `reward` (verl's reward manager, DAPO's overlong buffer, sandbox fusion),
`custom_reward_function` and `reward_model` (a classifier or a generative judge)."""

from __future__ import annotations

import dataclasses
import math

from grpo_jax import registry, sampler
from grpo_jax.config.checks import Checks, positive
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import genrm


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """Section `reward.overlong_buffer`: DAPO's soft penalty on overlong responses.

    verl's DAPO reward manager (reward_kwargs.overlong_buffer_cfg): a response longer than
    data.max_response_length - len gets penalty_factor x (its excess / len), capped at
    penalty_factor, subtracted from its score.
    """

    enable: bool = False
    len: int = 512  # tokens before max_response_length where the penalty starts
    penalty_factor: float = 1.0  # the penalty at max_response_length
    log: bool = False  # log reward_extra/overlong_reward and reward_extra/overlong

    def __post_init__(self):
        c = Checks("reward.overlong_buffer")
        c.need(self.len >= 1, "len", self.len, "must be >= 1")
        c.need(self.penalty_factor >= 0, "penalty_factor", self.penalty_factor, "must be >= 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class SandboxFusionConfig:
    """Section `reward.sandbox_fusion` (verl's, same names): run code rewards on SandboxFusion.

    With `url` set, `scorers.default_compute_score` sends the code sources ("codecontests",
    "apps", "codeforces", "taco") to that service (rewards/sandbox_fusion.py) instead of
    grpo_jax's local sandbox (rewards/code.py), as verl does. reward.fn must then include
    default_compute_score (and custom_reward_function.path be unset), or the run refuses to
    start: verl would silently not use the URL. verl's semaphore bounds the requests of all its
    reward workers together; here each of the reward.num_workers processes may have
    max_concurrent / num_workers (rounded up) in flight. An unreachable service stops the run
    with an error naming the URL (verl scores its tests -1).
    """

    url: str | None = None  # the full run_code endpoint, e.g. "http://host:8080/run_code"
    max_concurrent: int = 64  # requests in flight, all reward workers together
    memory_limit_mb: int = 1024  # sent with each request: the run's memory limit

    def __post_init__(self):
        c = Checks("reward.sandbox_fusion")
        positive(c, self, "max_concurrent")
        positive(c, self, "memory_limit_mb")
        if self.url is not None:
            c.need(
                self.url.startswith(("http://", "https://")), "url", self.url,
                "must be an http(s) URL of the run_code endpoint",
            )  # fmt: skip
        c.done()


# The name in reward.fn that stands for the reward model's score (reward_model section).
REWARD_MODEL_SPEC = "reward_model"


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Section `reward`: the reward functions, how they are combined and run
    (grpo_jax/rewards/functions.py).

    A function is named "module:function" and may have any of three signatures, told apart by
    its parameter names: verl's `compute_score(data_source, solution_str, ground_truth,
    extra_info=None) -> float | dict`, TRL's batched `fn(prompts, completions, **columns) ->
    list[float]`, or `fn(solution_str, ground_truth) -> float`.

    `overlap_with_rollout` streams the scoring: with the native engine's continuous batching
    (rollout.max_num_seqs below a shard's rows) each row that finishes is decoded and its calls
    submitted to the reward workers (or, with num_workers=0, to one helper thread) while the
    other rows decode, and the stage then waits only for the calls still running; the rewards
    are the same as scoring the batch after generation. Reward models and judges, multi-turn
    rollouts (a row's reward needs the tool results its agent gathers), several JAX processes
    and the vLLM sidecar score the batch after generation whatever it says; so do TRL-style
    functions (one call for the whole batch).
    """

    fn: str = "grpo_jax.rewards.scorers:default_compute_score"  # comma-separated specs
    weights: str = ""  # comma-separated weights, "" = all 1.0
    on_error: str = "raise"  # "raise" (stop, naming function + sample) | "zero" (score 0, counted)
    num_workers: int = 2  # scorer processes; 0 = score in the trainer (no timeout)
    # per call of a function (one sample, or one batch for TRL-style); a code reward takes up to
    # ~20 s locally (verl's 5 s first pass and 10 s tests, rewards/code.py)
    timeout_s: float = 30.0
    # score each rollout row as soon as it finishes, while the others still decode (verl's agent
    # loop does; verl has no switch for it); False scores the whole batch after generation
    overlap_with_rollout: bool = True
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    sandbox_fusion: SandboxFusionConfig = SandboxFusionConfig()

    def __post_init__(self):
        c = Checks("reward")
        c.choice("on_error", self.on_error, reward_fns.ON_ERROR_MODES)
        c.need(bool(self.specs), "fn", self.fn, "is empty: give at least one 'module:function'")
        c.need(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0")
        c.need(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        try:
            weights = self.weight_values
        except ValueError:
            c.need(False, "weights", self.weights, "must be comma-separated floats")
        else:
            c.need(
                len(weights) == len(self.specs),
                "weights",
                self.weights,
                f"has {len(weights)} weights for {len(self.specs)} functions in reward.fn",
            )
        c.done()

    @property
    def specs(self) -> tuple[str, ...]:
        return registry.split_list(self.fn)

    @property
    def weight_values(self) -> tuple[float, ...]:
        given = registry.split_list(self.weights)
        return tuple(float(w) for w in given) if given else (1.0,) * len(self.specs)


@dataclasses.dataclass(frozen=True)
class CustomRewardFunction:
    """Section `custom_reward_function` (verl): a scorer in a Python file replaces reward.fn.

    verl semantics: `path` is a .py file, `name` the function in it (default compute_score),
    called as compute_score(data_source, solution_str, ground_truth, extra_info).
    """

    path: str | None = None  # a .py file; None = use reward.fn
    name: str = "compute_score"  # the function in that file


@dataclasses.dataclass(frozen=True)
class RewardModelPath:
    """Section `reward_model.model` (verl's legacy names)."""

    # a local HF checkpoint dir (or hub id): a *ForSequenceClassification model, or with
    # reward_model.genrm.enable a *ForCausalLM judge; its tokenizer and chat template build the
    # reward model's input (verl 0.9.1: reward.reward_model.model_path)
    path: str | None = None


@dataclasses.dataclass(frozen=True)
class RewardModelRollout:
    """Section `reward_model.rollout` (verl's legacy names, its YAML defaults): how a
    generative judge samples its verdict (reward_model.genrm.enable; the native sampler on the
    trainer's mesh). verl's judge sampling is whatever its custom reward function sends with
    each chat request (its reference one: temperature 0.7, top_p 0.8, max_tokens 4096)."""

    temperature: float = 1.0  # of the judge's sampling (do_sample=True)
    top_p: float = 1.0  # nucleus mass, 1 = off
    top_k: int = -1  # -1 = off
    do_sample: bool = True  # False = greedy (temperature, top_p, top_k unused)
    prompt_length: int = 2048  # the longest judge prompt in tokens (a longer one is an error)
    response_length: int = 2048  # the judge's new tokens per verdict

    def __post_init__(self):
        c = Checks("reward_model.rollout")
        c.call(sampler.check_sampling_settings, temperature=self.temperature, top_p=self.top_p,
               top_k=self.top_k)  # fmt: skip
        positive(c, self, "prompt_length", "response_length")
        c.done()

    @property
    def effective_temperature(self) -> float:
        """The sampler's temperature: 0 (greedy) unless do_sample."""
        return self.temperature if self.do_sample else 0.0


@dataclasses.dataclass(frozen=True)
class GenRMConfig:
    """Section `reward_model.genrm` (grpo_jax; verl does this in a custom reward function): a
    generative judge's prompt and verdict parsing (grpo_jax/rewards/genrm.py). The defaults
    are verl 0.9.1's reference GenRM function (tests/experimental/reward_loop/reward_fn.py)."""

    enable: bool = False  # reward_model.model.path is a causal LM judge, not a classifier
    # str.format template of the judge's user message, with {solution} and optionally
    # {problem} and {ground_truth}; rendered with the judge's chat template
    prompt_template: str = genrm.DEFAULT_TEMPLATE
    # where {problem} comes from: "extra_info.<key>" (verl's: extra_info["question"]) or
    # "prompt" (the prompt's last user turn)
    problem_key: str = "extra_info.question"
    # "" = verl's reference parse (the integer after the last blank line), or "module:function"
    # taking the judge's text and returning a float, or None when it cannot be parsed
    parser: str = ""
    unparsable_score: float = 0.0  # the score of a verdict that does not parse (verl: 0)

    def __post_init__(self):
        c = Checks("reward_model.genrm")
        if self.enable:
            c.call(_template_check, self.prompt_template)
            c.need(self.problem_key == "prompt" or (self.problem_key.startswith("extra_info.")
                   and len(self.problem_key) > len("extra_info.")), "problem_key",
                   self.problem_key, "must be 'prompt' or 'extra_info.<key>'")  # fmt: skip
            c.need(not self.parser or ":" in self.parser, "parser", self.parser,
                   "must be '' (verl's parse) or 'module:function'")  # fmt: skip
        c.need(math.isfinite(self.unparsable_score), "unparsable_score", self.unparsable_score,
               "must be finite")  # fmt: skip
        c.done()


def _template_check(template: str) -> None:
    try:
        genrm.template_fields(template)
    except ValueError as e:
        raise ValueError(f"prompt_template {e}") from e


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Section `reward_model`: a discriminative reward model (grpo_jax/rewards/reward_model.py)
    or, with genrm.enable, a generative judge (grpo_jax/rewards/genrm.py).

    verl 0.9.1 semantics (experimental/reward_loop/reward_loop.py): each rollout is re-written as
    the prompt's chat plus the decoded response (EOS removed) in the reward model's own chat
    template, scored by the classifier at its last token (the last label's raw logit), and
    without a custom reward function that score *is* the sequence reward. Here "reward_model"
    may also be listed in reward.fn, with a weight in reward.weights, to add it to rule rewards.
    A judge's score takes the same place. Validation rows are scored the same way (verl's
    _validate runs the reward model too).
    """

    enable: bool = False
    model: RewardModelPath = RewardModelPath()
    # rows per device of one scoring pass or judge generate call (verl <= 0.5's
    # reward_model.micro_batch_size_per_gpu; 0.9.1 batches inside vLLM)
    micro_batch_size_per_gpu: int = 8
    # tokens of a classifier input, longer ones cut on the right (verl <= 0.5's max_length,
    # truncation "right"); None = no limit (rows padded to the batch's longest). A judge's
    # prompt is bounded by rollout.prompt_length instead.
    max_length: int | None = None
    rollout: RewardModelRollout = RewardModelRollout()
    genrm: GenRMConfig = GenRMConfig()

    def __post_init__(self):
        c = Checks("reward_model")
        if self.enable:
            what = "*ForCausalLM judge" if self.genrm.enable else "*ForSequenceClassification"
            c.need(bool(self.model.path), "model.path", self.model.path,
                   f"must name a {what} checkpoint (enable=True)")  # fmt: skip
        c.need(self.enable or not self.genrm.enable, "genrm.enable", self.genrm.enable,
               "needs reward_model.enable=True")  # fmt: skip
        positive(c, self, "micro_batch_size_per_gpu")
        c.need(self.max_length is None or self.max_length >= 1, "max_length", self.max_length,
               "must be >= 1 or None")  # fmt: skip
        c.need(self.max_length is None or not self.genrm.enable, "max_length", self.max_length,
               "is for a classifier; a judge's prompt is bounded by "
               "reward_model.rollout.prompt_length")  # fmt: skip
        c.done()
