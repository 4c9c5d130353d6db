"""The typed configuration of a GRPO run: one frozen dataclass per section, with verl's names.

This package owns every knob of a run, its default and its checks. The sections and leaf names are
verl 0.9.1's (`actor_rollout_ref.actor.X` -> `actor.X`, `actor_rollout_ref.rollout.X` ->
`rollout.X`, `data.X`, `algorithm.X`, `trainer.X`, `custom_reward_function.X`), so a verl run
script ports line by line (README "verl override mapping"); the defaults are verl's
(docs/verl-semantics.md section 7) unless a comment says otherwise. `configs/common.py` turns
`RunConfig()` into the ml_collections tree that `train.py --config.X=...` overrides, so this package
is the single list of fields; library users build the dataclasses directly.

Checks:
  * Per field, in each section's `__post_init__`. Where a library function owns a rule (the
    sampler's temperature / top-p / top-k, the actor loss's modes and clip bounds), the section
    calls that function, so each rule lives in one place; the message names the dotted field.
  * Across sections, in `RunConfig.__post_init__` (group size vs estimator, mini-batch vs batch,
    paths the source needs, reward weights vs functions, ...).
  * Against the device mesh, in `RunConfig.check_mesh(dp)` once the mesh is known.
A section raises `ConfigError` listing all of its problems; `from_dict` collects the problems of
every section before raising, so one run of a bad config reports them together.

Layout (one module per section, as verl's config tree): `checks` (ConfigError and the problem
collector), `data`, `model`, `actor` (with `ref`), `rollout`, `algorithm`, `reward` (with
`custom_reward_function` and `reward_model`), `trainer` (with `warmup`, `checkpoint`, `mesh`),
`run` (RunConfig) and `dicts` (from_dict / to_dict). Every name is re-exported here:
`config.RunConfig`, `config.from_dict`, ...
"""

from grpo_jax.config.actor import (
    ROUTER_REPLAY_MODES,
    ActorConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RouterReplayConfig,
)
from grpo_jax.config.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    RolloutCorrectionConfig,
)
from grpo_jax.config.checks import ConfigError
from grpo_jax.config.data import DATA_SOURCES, ArithmeticConfig, DataConfig
from grpo_jax.config.dicts import accepts_none, defaults_with_types, from_dict, to_dict
from grpo_jax.config.model import ModelSpec, TinyModelConfig
from grpo_jax.config.reward import (
    REWARD_MODEL_SPEC,
    CustomRewardFunction,
    GenRMConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelPath,
    RewardModelRollout,
    SandboxFusionConfig,
)
from grpo_jax.config.rollout import MultiTurnConfig, RolloutConfig, ValKwargs, VLLMSettings
from grpo_jax.config.run import RunConfig
from grpo_jax.config.trainer import CheckpointConfig, MeshConfig, TrainerConfig, WarmupConfig

__all__ = [
    "ROUTER_REPLAY_MODES", "ActorConfig", "OptimConfig", "PolicyLossConfig", "RefConfig",
    "RouterReplayConfig", "AlgorithmConfig", "FilterGroupsConfig", "KLCtrlConfig",
    "RolloutCorrectionConfig", "ConfigError", "DATA_SOURCES", "ArithmeticConfig", "DataConfig",
    "accepts_none", "defaults_with_types", "from_dict", "to_dict", "ModelSpec", "TinyModelConfig",
    "REWARD_MODEL_SPEC", "CustomRewardFunction", "GenRMConfig", "OverlongBufferConfig",
    "RewardConfig", "RewardModelConfig", "RewardModelPath", "RewardModelRollout",
    "SandboxFusionConfig", "MultiTurnConfig", "RolloutConfig", "ValKwargs", "VLLMSettings",
    "RunConfig", "CheckpointConfig", "MeshConfig", "TrainerConfig", "WarmupConfig",
]
