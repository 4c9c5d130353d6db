"""The GRPO update: train state, batch, optimizer, log-prob passes and the jitted train step.

Owns the device side of one GRPO step after the rewards are known (docs/verl-semantics.md sections 1
and 6, verl 0.9.1 engine workers):

* `TrainState(step, params, opt_state)` and `TrainBatch` (prompt + response tokens, advantages,
  old and reference log-probs) are pytrees; `train_step` is a pure top-level function that
  the run's programs (trainer/programs.py) jit with the state donated.
* One `train_step` call is one optimizer step on one mini-batch (a slice of the batch chosen by
  `mini_batch_index`); the update stage (trainer/train_stage.py) runs ppo_epochs x mini-batches
  as a plain Python loop.
  Inside, the mini-batch is split into micro-batches whose gradients are summed in a
  `lax.scan`. Each micro-batch loss is normalised with the mini-batch's global counts
  (`batch_num_tokens` = valid tokens of the whole mini-batch before rejection sampling,
  `global_batch_size` = its sequences), so the summed gradient is exactly that of the
  mini-batch loss: token-mean is a true token mean over the mini-batch, as in verl 0.9.1's
  engine workers (not the legacy mean of micro-batch means). The mesh gives a global view,
  so dp_size is 1 here. geo_mean is the exception: verl takes its plain mean over each
  micro-batch's sequences.
* Random draws in the loss (clip_cov's detached tokens, verl's torch.randperm) use
  `update_key(trainer.seed, state.step)` folded with the micro-batch index, so they are
  reproducible and a resumed run draws the same tokens.
* Log-probs come from `model.hidden_states` and `logprobs.logprobs_and_entropy_from_hidden`
  (chunked over token rows, never a [B, T, V] array), from logits divided by the rollout
  temperature as verl does.
* Router replay (actor.router_replay, a MoE model): a batch with `routed_experts_BLSA` routes
  every token of the policy passes (old log-probs, update) to those experts instead of the
  routers' top-k (moe.route); the reference pass gets the batch without them (verl routes it
  natively). R3's come from the rollout, R2's from the old-log-prob pass
  (`compute_log_probs(record_routing=True)`). The update logs the share of replayed tokens its
  routers would have sent elsewhere (actor/router_replay_mismatch), with the load metrics.
* LoRA (grpo_jax/models/lora.py): `TrainState.params` are then the adapters alone, the only thing
  differentiated and the only optimizer state; the frozen base comes in as the `base` argument
  of `train_step` / `packed_micro_grads` / `sft_step` (traced, never donated) and the model runs
  `lora.attach(base, adapters)` (`policy_params`). With `base=None` (full fine-tuning) the
  functions trace exactly as before.
* Optimizer: AdamW as verl/torch (decoupled weight decay scaled by the lr) after a global-norm
  clip. The learning rate is an argument of the step (verl steps its scheduler once per training
  step, not per mini-batch). When the gradient norm or the loss is not finite the update is
  skipped (params and optimizer state unchanged) and `actor/update_skipped` is 1.

Shapes: B sequences, P prompts, S = prompt + response tokens (the model input), T response
tokens, D hidden size, M micro-batches per mini-batch.
"""

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from grpo_jax import logprobs
from grpo_jax import loss as loss_lib
from grpo_jax import model as model_lib
from grpo_jax.models import lora as lora_lib
from grpo_jax.models import moe as moe_lib
from grpo_jax.trainer import packing

LR_SCHEDULES = ("constant", "cosine")


@flax.struct.dataclass
class TrainState:
    """Everything the optimizer updates; checkpointed together with the host-side state.

    Attributes:
      step: int32 scalar, optimizer updates attempted (skipped ones included).
      params: the trained parameters: the policy (model.py's nested dict), or with LoRA the
        adapters alone (the base is frozen and lives outside the state).
      opt_state: optax state of `make_optimizer` (of `params` only).
    """

    step: jax.Array
    params: Any
    opt_state: Any


@flax.struct.dataclass
class TrainBatch:
    """One GRPO batch, B = P * G rows, the G samples of a prompt adjacent.

    Attributes:
      input_ids_BS: int32, left-padded prompt followed by the response (S = Tp + T).
      attention_mask_BS: int32, prompt mask followed by the response mask.
      response_ids_BT: int32, the sampled tokens.
      response_mask_BT: int32, 1 up to and including the first EOS.
      advantages_BT: float32, masked advantages.
      old_log_probs_BT: float32 log-probs of the rollout policy recomputed by the trainer, or
        None when on-policy (then the current log-probs under stop_gradient are used).
      ref_log_probs_BT: float32 reference-model log-probs, or None without a KL loss.
      rollout_is_weights_BT: float32 rollout-correction importance weights multiplying the
        policy loss, or None.
      loss_mask_BT: int32, verl's `loss_mask`: the response mask as sampled, before rollout
        rejection sampling (algorithm.rollout_correction.rollout_rs) zeroed tokens of
        response_mask_BT. Its count over the mini-batch is token-mean's denominator
        (batch_num_tokens); the losses sum over response_mask_BT. None: response_mask_BT.
      routed_experts_BLSA: the experts each input token is routed to in each MoE layer (L =
        the model's MoE layers, A = num_experts_per_tok; moe.routing_dtype, moe.no_route where
        none was recorded), router replay: the rollout's (R3) or the old-log-prob pass's
        (R2). None: the passes route by their own routers.
    """

    input_ids_BS: jax.Array
    attention_mask_BS: jax.Array
    response_ids_BT: jax.Array
    response_mask_BT: jax.Array
    advantages_BT: jax.Array
    old_log_probs_BT: jax.Array | None = None
    ref_log_probs_BT: jax.Array | None = None
    rollout_is_weights_BT: jax.Array | None = None
    loss_mask_BT: jax.Array | None = None
    routed_experts_BLSA: jax.Array | None = None


def batch_num_tokens(batch: TrainBatch) -> jax.Array:
    """verl 0.9.1's token-mean denominator of `batch` (a mini-batch): the valid tokens of its
    `loss_mask`, counted before rejection sampling (float32 scalar).

    verl's v1 trainer stores loss_mask = response_mask with each sample when it is generated;
    rejection sampling later rewrites response_mask only, and the engine divides by the
    all-reduced loss_mask.sum(). So rejected tokens leave the loss's sum but not its
    denominator, and a fully rejected mini-batch has loss 0 and still takes an optimizer step.
    """
    mask_BT = batch.response_mask_BT if batch.loss_mask_BT is None else batch.loss_mask_BT
    return jnp.sum(mask_BT.astype(jnp.float32))


def check_loss_settings(
    *, policy_loss_mode: str, loss_agg_mode: str, clip_ratio_c: float, kl_loss_type: str
) -> None:
    """The update's loss settings (LossConfig and config.ActorConfig), with loss.py's own rules.

    Raises:
      ValueError: 'field=value why', the field named as in the config's `actor` section.
    """
    loss_lib.check_policy_loss_mode("policy_loss.loss_mode", policy_loss_mode)
    loss_lib.check_choice("loss_agg_mode", loss_agg_mode, loss_lib.AGG_MODES)
    loss_lib.check_choice("kl_loss_type", kl_loss_type, loss_lib.KL_TYPES)
    if kl_loss_type.startswith("full"):
        raise ValueError(
            f"kl_loss_type={kl_loss_type!r}: 'full' needs full reference logits, which the "
            "chunked trainer never builds; use kl, abs, mse or low_var_kl (optionally with '+')"
        )
    loss_lib.check_clip_ratio_c(clip_ratio_c)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static actor-loss settings (config section `actor`, plus `rollout.temperature`).

    Paper symbols: clip_ratio_low/high = epsilon_low/high (DAPO clip-higher when they differ),
    kl_loss_coef = beta (GRPO eq. 3 uses k3 = "low_var_kl"), clip_ratio_c = dual-clip c.
    Built by `config.ActorConfig.loss_config`; checked by `check_loss_settings`.
    """

    policy_loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_scale_factor: float | None = None
    temperature: float = 1.0
    chunk_size: int = 1024  # token rows per log-prob chunk (memory vs. speed)
    # The policy loss's own settings (actor.policy_loss.* and actor.tau_*), as sorted
    # (name, value) pairs so the config stays hashable.
    policy_loss_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        check_loss_settings(
            policy_loss_mode=self.policy_loss_mode,
            loss_agg_mode=self.loss_agg_mode,
            clip_ratio_c=self.clip_ratio_c,
            kl_loss_type=self.kl_loss_type,
        )
        logprobs.check_temperature(self.temperature)


def policy_params(base, params):
    """The params the policy runs with: `params` itself (full fine-tuning, `base` None), or the
    frozen `base` plus the adapters `params` (LoRA, unmerged)."""
    return params if base is None else lora_lib.attach(base, params)


def response_log_probs(
    model_config: model_lib.ModelConfig,
    params,
    input_ids_BS,
    attention_mask_BS,
    response_ids_BT,
    *,
    temperature: float,
    chunk_size: int,
    calculate_entropy: bool,
    router_stats: bool = False,
    routing_BLSA=None,
):
    """Per-token log-probs (and entropy) of the response under `params`.

    Position Tp - 1 + t of the input predicts response token t, so the hidden states of columns
    [Tp - 1, S - 1) are unembedded chunk by chunk (logprobs.logprobs_and_entropy_from_hidden).
    `routing_BLSA`: experts to route the input tokens to (router replay, TrainBatch's).

    Returns:
      (log_probs_BT float32, entropy_BT float32 or None), and with `router_stats` the MoE
      layers' ``moe.RouterStats`` third.
    """
    num_response = response_ids_BT.shape[1]
    prompt_len = input_ids_BS.shape[1] - num_response
    if router_stats or routing_BLSA is not None:
        routing_LmBSA = None if routing_BLSA is None else routing_BLSA.transpose(1, 0, 2, 3)
        h_BSD, stats = model_lib.hidden_states_and_routing(
            model_config, params, input_ids_BS, attention_mask_BS, routing_LmBSA
        )
    else:
        h_BSD = model_lib.hidden_states(model_config, params, input_ids_BS, attention_mask_BS)
    h_BTD = h_BSD[:, prompt_len - 1 : prompt_len - 1 + num_response]
    out = logprobs.logprobs_and_entropy_from_hidden(
        h_BTD,
        functools.partial(model_lib.unembed, model_config, params),
        response_ids_BT,
        chunk_size=chunk_size,
        temperature=temperature,
        calculate_entropy=calculate_entropy,
    )
    return (*out, stats) if router_stats else out


def moe_metrics(stats: moe_lib.RouterStats, *, replayed: bool = False) -> dict:
    """A MoE model's router metrics of one forward: ``actor/moe_aux_loss`` (HF's
    load-balancing loss, logged, not added to the loss: see ``train_step``) and, per MoE layer
    l, ``actor/moe_load_max/l`` and ``actor/moe_load_min/l``, the busiest and idlest expert's
    share of the assignments (1 / num_experts each when balanced). With `replayed` (router
    replay), ``actor/router_replay_mismatch``: the share of the replayed (layer, token) pairs
    whose router's own top-k is another set of experts (moe.mismatch_rate)."""
    high_Lm, low_Lm = moe_lib.load_shares(stats)
    out = {"actor/moe_aux_loss": moe_lib.load_balancing_loss(stats)}
    if replayed:
        out["actor/router_replay_mismatch"] = moe_lib.mismatch_rate(stats)
    for layer in range(high_Lm.shape[0]):
        out[f"actor/moe_load_max/{layer}"] = high_Lm[layer]
        out[f"actor/moe_load_min/{layer}"] = low_Lm[layer]
    return out


def _micro_batches(tree, num_micro: int):
    """[B, ...] leaves -> [M, B/M, ...] for a scan over micro-batches (None leaves stay None)."""
    return jax.tree.map(lambda x: x.reshape(num_micro, -1, *x.shape[1:]), tree)


def compute_log_probs(
    model_config: model_lib.ModelConfig,
    params,
    batch: TrainBatch,
    *,
    micro_batch_size: int,
    temperature: float,
    chunk_size: int,
    calculate_entropy: bool,
    record_routing: bool = False,
):
    """Log-probs (and entropy) of every response of `batch`, micro-batch by micro-batch.

    Used for the old log-probs (when off-policy) and the reference log-probs; the run's programs
    jit it. The tokens route to `batch.routed_experts_BLSA` when it is set (router replay).

    Args:
      record_routing: also return the experts every input token was routed to (router replay
        R2 records them in the old-log-prob pass).

    Returns:
      (log_probs_BT, entropy_BT or None), float32; with `record_routing` a third,
      routed_experts_BLSA in moe.routing_dtype.
    """
    num_rows = batch.input_ids_BS.shape[0]
    num_micro = _num_chunks(num_rows, micro_batch_size, "rollout.log_prob_micro_batch_size")
    inputs = _micro_batches(
        (batch.input_ids_BS, batch.attention_mask_BS, batch.response_ids_BT,
         batch.routed_experts_BLSA),
        num_micro,
    )  # fmt: skip
    dtype = moe_lib.routing_dtype(model_config.num_experts)

    def body(_, xs):
        *tokens, routing_BLSA = xs
        lp_BT, ent_BT, *stats = response_log_probs(
            model_config,
            params,
            *tokens,
            temperature=temperature,
            chunk_size=chunk_size,
            calculate_entropy=calculate_entropy,
            router_stats=record_routing,
            routing_BLSA=routing_BLSA,
        )
        experts_BLSA = (
            stats[0].experts_LmBTA.transpose(1, 0, 2, 3).astype(dtype) if record_routing else None
        )
        return None, (lp_BT, ent_BT, experts_BLSA)

    _, (lp_MbT, ent_MbT, experts_MbLSA) = jax.lax.scan(body, None, inputs)
    lp_BT = lp_MbT.reshape(num_rows, -1)
    out = lp_BT, None if ent_MbT is None else ent_MbT.reshape(num_rows, -1)
    if record_routing:
        return *out, experts_MbLSA.reshape(num_rows, *experts_MbLSA.shape[2:])
    return out


def _num_chunks(num_rows: int, chunk: int, field: str) -> int:
    chunk = min(chunk, num_rows)
    if num_rows % chunk:
        raise ValueError(f"{field}={chunk} must divide the {num_rows} rows of the (mini-)batch")
    return num_rows // chunk


def make_optimizer(*, grad_clip: float, betas: tuple[float, float], weight_decay: float):
    """torch-style AdamW without the learning rate (applied in `apply_gradients`).

    Global-norm clip, Adam moments (eps 1e-8 as torch), then decoupled weight decay; the
    update is finally scaled by -lr, so the decay is lr * weight_decay * p, as torch.AdamW.
    """
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.scale_by_adam(b1=betas[0], b2=betas[1], eps=1e-8),
        optax.add_decayed_weights(weight_decay),
    )


def lr_schedule(
    *, lr: float, warmup_steps: int, total_steps: int, kind: str, min_lr_ratio: float = 0.0
):
    """Learning rate per training step: linear warm-up from 0, then constant or cosine decay.

    Args:
      lr: peak learning rate (actor.optim.lr).
      warmup_steps: linear warm-up length (actor.optim.lr_warmup_steps).
      total_steps: training steps of the run (cosine reaches min_lr_ratio * lr there).
      kind: "constant" or "cosine" (actor.optim.lr_scheduler_type).
      min_lr_ratio: cosine floor as a fraction of lr.
    """
    if kind not in LR_SCHEDULES:
        raise ValueError(
            f"actor.optim.lr_scheduler_type must be one of {LR_SCHEDULES}, got {kind!r}"
        )
    if kind == "constant":
        after = optax.constant_schedule(lr)
    else:
        after = optax.cosine_decay_schedule(
            lr, max(total_steps - warmup_steps, 1), alpha=min_lr_ratio
        )
    if warmup_steps <= 0:
        return after
    warm = optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.join_schedules([warm, after], [warmup_steps])


def init_state(params, tx) -> TrainState:
    """A fresh TrainState (step 0, optimizer state of `tx` on `params`)."""
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


def apply_gradients(state: TrainState, grads, loss_value, lr, tx):
    """One optimizer step, skipped when the gradient norm or the loss is not finite.

    Returns:
      (new_state, metrics) with actor/grad_norm (before clipping), actor/lr and
      actor/update_skipped (1.0 when skipped).
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss_value)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(
        state.params, jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates)
    )
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    new_state = TrainState(
        state.step + 1, keep(new_params, state.params), keep(new_opt_state, state.opt_state)
    )
    metrics = {
        "actor/grad_norm": grad_norm,
        "actor/lr": jnp.asarray(lr, jnp.float32),
        "actor/update_skipped": 1.0 - finite.astype(jnp.float32),
    }
    return new_state, metrics


# How verl 0.9.1 reduces the loss's metrics over a mini-batch's micro-batches
# (verl/workers/utils/losses.py ppo_loss, verl/utils/metric/utils.py Metric.aggregate_dp): the
# losses, normalised by the mini-batch's global counts, are partial sums (AggregationType.SUM);
# everything else the policy loss reports (actor/pg_clipfrac, actor/ppo_kl,
# actor/pg_clipfrac_lower, the bypass mode's rollout_corr/*), a masked mean over the
# micro-batch's own tokens, is averaged over the micro-batches with equal weights
# (AggregationType.MEAN), however many tokens each holds.
SUMMED_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/loss")


def combine_micro_metrics(metrics_M: dict) -> dict:
    """One mini-batch's metrics from its micro-batches' ([M] jax or NumPy arrays): the sum of
    the losses (SUMMED_METRICS), the plain mean of the others, as verl.

    verl averages per-GPU micro-batches; grpo_jax's micro-batch spans the data devices
    (ppo_micro_batch_size_per_gpu x devices rows, or one packed micro-batch), so with one
    data device (or one micro-batch) the values are verl's, and otherwise the mean runs over
    other groupings of the same rows (docs/verl.md).
    """
    # the arrays' own methods: jax arrays under jit, NumPy arrays on the host
    return {k: v.sum() if k in SUMMED_METRICS else v.mean() for k, v in metrics_M.items()}


def _objective(
    lc: LossConfig, lp_BT, ent_BT, batch: TrainBatch, mask_BT, *, num_tokens, rows,
    micro_rows=None, rng=None,
):  # fmt: skip
    """verl's actor loss of one micro-batch, normalised by the mini-batch's global counts.

    `mask_BT` is the micro-batch's share of the response mask; with the global counts
    (`num_tokens` valid tokens, `rows` sequences of the mini-batch) the micro-batch losses sum
    exactly to the mini-batch loss (verl 0.9.1's engine workers). The exception is geo_mean,
    whose loss verl averages over the micro-batch's own sequences: `micro_rows` of them when
    `batch` is a larger layout (packed micro-batches), else all of its rows. `rng`: the
    micro-batch's key, for a policy loss that draws at random (clip_cov).
    """
    old_BT = batch.old_log_probs_BT
    if old_BT is None:  # on-policy: ratio 1 in value, gradient of log pi (verl skips old)
        old_BT = jax.lax.stop_gradient(lp_BT)
    value, metrics = loss_lib.actor_loss(
        old_BT,
        lp_BT,
        batch.advantages_BT,
        mask_BT,
        ref_log_prob=batch.ref_log_probs_BT,
        entropy=ent_BT,
        policy_loss_mode=lc.policy_loss_mode,
        loss_agg_mode=lc.loss_agg_mode,
        clip_ratio=lc.clip_ratio,
        clip_ratio_low=lc.clip_ratio_low,
        clip_ratio_high=lc.clip_ratio_high,
        clip_ratio_c=lc.clip_ratio_c,
        entropy_coeff=lc.entropy_coeff,
        use_kl_loss=lc.use_kl_loss,
        kl_loss_coef=lc.kl_loss_coef,
        kl_loss_type=lc.kl_loss_type,
        batch_num_tokens=num_tokens,
        global_batch_size=rows,
        loss_scale_factor=lc.loss_scale_factor,
        local_batch_size=micro_rows,
        rollout_is_weights=batch.rollout_is_weights_BT,
        policy_loss_kwargs={**dict(lc.policy_loss_kwargs), "rng": rng},
    )
    return value, {**metrics, "actor/loss": value}


def _wants_entropy(lc: LossConfig) -> bool:
    return lc.calculate_entropy or lc.entropy_coeff != 0


# The rng stream of the update's random draws (clip_cov's detached tokens): fold_in of
# trainer.seed's key, far from the rollouts' stream (fold_in of the loop step).
UPDATE_STREAM = 0x7FFF0CC0


def update_key(seed: int, step) -> jax.Array:
    """The key of optimizer update `step` (TrainState.step, every update attempted).

    Micro-batch m of the update draws with fold_in(update_key, m), padded (`train_step`) or
    packed (`packed_micro_grads`). The step is checkpointed, so a resumed run draws the same.
    """
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), UPDATE_STREAM), step)


def _check_rng(lc: LossConfig, rng) -> None:
    if rng is None and lc.policy_loss_mode == "clip_cov":
        raise ValueError(
            "policy_loss.loss_mode='clip_cov' detaches a uniform random subset of its candidate "
            "tokens (verl's torch.randperm): the update needs rng (actor.update_key)"
        )


def train_step(
    state: TrainState,
    batch: TrainBatch,
    mini_batch_index,
    lr,
    base=None,
    rng=None,
    *,
    model_config: model_lib.ModelConfig,
    loss_config: LossConfig,
    tx,
    mini_batch_size: int,
    micro_batch_size: int,
):
    """One PPO/GRPO optimizer step on mini-batch `mini_batch_index` of `batch` (padded rows).

    Args:
      state: donated (the run's programs jit it with donate_argnums=0).
      batch: the whole step's batch (B rows); not donated (reused by later mini-batches).
      mini_batch_index: int32 scalar; rows [i * mini_batch_size, (i + 1) * mini_batch_size).
      lr: float32 scalar learning rate of this training step.
      base: LoRA's frozen base params (state.params are then the adapters), or None.
      rng: this update's key (`update_key`); micro-batch m draws with fold_in(rng, m). Required
        by clip_cov; unused by the deterministic losses (may be None there).
      model_config, loss_config, tx: static.
      mini_batch_size: sequences per mini-batch (actor.ppo_mini_batch_size x rollout.n).
      micro_batch_size: sequences per micro-batch (global; must divide mini_batch_size).

    Returns:
      (new_state, metrics): float32 scalars with verl's actor/* names.
    """
    mini = jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(
            x, mini_batch_index * mini_batch_size, mini_batch_size
        ),
        batch,
    )
    num_micro = _num_chunks(mini_batch_size, micro_batch_size, "actor.ppo_micro_batch_size")
    # verl 0.9.1 engine normalisation: the global counts of the whole mini-batch.
    num_tokens = batch_num_tokens(mini)
    lc = loss_config
    _check_rng(lc, rng)

    # A MoE model's router metrics ride along; the load-balancing loss is not added to the
    # loss, as in verl's FSDP actor (HF adds it only with output_router_logits, false in the
    # Qwen3-MoE checkpoints' config.json).
    is_moe = model_config.num_moe_layers > 0

    replayed = batch.routed_experts_BLSA is not None

    def loss_fn(params, micro: TrainBatch, key):
        lp_BT, ent_BT, *stats = response_log_probs(
            model_config,
            policy_params(base, params),
            micro.input_ids_BS,
            micro.attention_mask_BS,
            micro.response_ids_BT,
            temperature=lc.temperature,
            chunk_size=lc.chunk_size,
            calculate_entropy=_wants_entropy(lc),
            router_stats=is_moe,
            routing_BLSA=micro.routed_experts_BLSA,
        )
        value, metrics = _objective(
            lc,
            lp_BT,
            ent_BT,
            micro,
            micro.response_mask_BT,
            num_tokens=num_tokens,
            rows=mini_batch_size,
            rng=key,
        )
        return value, {**metrics, **(moe_metrics(stats[0], replayed=replayed) if is_moe else {})}

    def body(grads, xs):
        micro, m = xs
        key = None if rng is None else jax.random.fold_in(rng, m)
        (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, micro, key)
        return jax.tree.map(jnp.add, grads, g), metrics

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    xs = (_micro_batches(mini, num_micro), jnp.arange(num_micro, dtype=jnp.int32))
    grads, metrics_M = jax.lax.scan(body, zeros, xs)
    metrics = combine_micro_metrics(metrics_M)
    state, opt_metrics = apply_gradients(state, grads, metrics["actor/loss"], lr, tx)
    return state, {**metrics, **opt_metrics}


# ---------------------------------------------------------------------------------------------
# Packed micro-batches (actor.use_dynamic_bsz, rollout.log_prob_use_dynamic_bsz; packing.py)


@flax.struct.dataclass
class PackedMicro:
    """One micro-batch of packing.Packed on device: R rows of L tokens, and N response slots for
    each of G groups of R / G consecutive rows (a slot indexes its group's positions flattened).
    `routing_RLmLA`: with router replay, the experts of each packed token in each of the Lm MoE
    layers (packing.pack's), else None."""

    tokens_RL: jax.Array
    positions_RL: jax.Array
    segments_RL: jax.Array
    prefixes_RL: jax.Array
    slot_pos_GN: jax.Array
    slot_label_GN: jax.Array
    slot_bt_GN: jax.Array
    routing_RLmLA: jax.Array | None = None


def packed_log_probs(
    model_config: model_lib.ModelConfig,
    params,
    micro: PackedMicro,
    *,
    temperature: float,
    chunk_size: int,
    calculate_entropy: bool,
    num_bt: int,
    router_stats: bool = False,
):
    """Log-probs (and entropy) of every response slot of a packed micro-batch: [G, N] each.

    Only the slots' positions are unembedded, in packing.SLOT_CHUNKS chunks (or more, of at
    most `chunk_size` rows), and chunks holding no response token (slot_bt_GN = B x T, the
    empty slots after each group's used ones) are skipped: about the response tokens' cost,
    never the prompt positions' or the padding's. Empty slots' values are 0. `num_bt`: B x T
    of the [B, T] layout the slots index (the empty slots' slot_bt). The tokens route to
    `micro.routing_RLmLA` when set (router replay); with `router_stats` the MoE layers'
    ``moe.RouterStats`` over the packed tokens come third."""
    stats = None
    if router_stats or micro.routing_RLmLA is not None:
        routing = None if micro.routing_RLmLA is None else micro.routing_RLmLA.transpose(1, 0, 2, 3)
        h_RLD, stats = model_lib.hidden_states_packed_and_routing(
            model_config, params, micro.tokens_RL, micro.positions_RL, micro.segments_RL,
            micro.prefixes_RL, routing,
        )  # fmt: skip
    else:
        h_RLD = model_lib.hidden_states_packed(
            model_config,
            params,
            micro.tokens_RL,
            micro.positions_RL,
            micro.segments_RL,
            micro.prefixes_RL,
        )
    R, L, D = h_RLD.shape
    G = micro.slot_pos_GN.shape[0]  # row groups: each gathers from its own rows (device-local)
    h_GxD = h_RLD.reshape(G, (R // G) * L, D)
    h_GND = jnp.take_along_axis(h_GxD, micro.slot_pos_GN[..., None], axis=1)
    slots = h_GND.shape[0] * h_GND.shape[1]
    out = logprobs.logprobs_and_entropy_from_hidden(
        h_GND,
        functools.partial(model_lib.unembed, model_config, params),
        micro.slot_label_GN,
        chunk_size=min(chunk_size, max(1, slots // packing.SLOT_CHUNKS)),
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        valid=micro.slot_bt_GN < num_bt,
    )
    return (*out, stats) if router_stats else out


def scatter_slots(values_GN, slot_bt_GN, shape_BT):
    """[G, N] slot values -> [B, T] (zeros where no slot of this micro-batch lands)."""
    num = shape_BT[0] * shape_BT[1]
    flat = (
        jnp.zeros((num,), values_GN.dtype)
        .at[slot_bt_GN.reshape(-1)]
        .set(values_GN.reshape(-1), mode="drop")
    )
    return flat.reshape(shape_BT)


def packed_log_probs_into(
    model_config,
    params,
    micro: PackedMicro,
    lp_BT,
    ent_BT,
    *,
    temperature,
    chunk_size,
    calculate_entropy,
):
    """Adds one micro-batch's log-probs (and entropy) into the [B, T] results (donated)."""
    lp_GN, ent_GN = packed_log_probs(
        model_config,
        params,
        micro,
        temperature=temperature,
        chunk_size=chunk_size,
        calculate_entropy=calculate_entropy,
        num_bt=lp_BT.size,
    )
    lp_BT = lp_BT + scatter_slots(lp_GN, micro.slot_bt_GN, lp_BT.shape)
    if calculate_entropy:
        ent_BT = ent_BT + scatter_slots(ent_GN, micro.slot_bt_GN, ent_BT.shape)
    return lp_BT, ent_BT


def packed_micro_grads(
    params,
    grads,
    micro: PackedMicro,
    batch: TrainBatch,
    base=None,
    rng=None,
    *,
    model_config: model_lib.ModelConfig,
    loss_config: LossConfig,
):
    """Adds one packed micro-batch's gradient of the mini-batch loss to `grads` (donated).

    `batch` is the mini-batch in the [B, T] response layout (advantages, old and reference
    log-probs, mask); the micro-batch's log-probs are scattered into it, and the loss sees only
    its own sequences (mask) with the mini-batch's global counts, so the micro-batch
    contributions add up to exactly the unpadded mini-batch loss and gradient. geo_mean, which
    verl averages over each micro-batch's sequences (the engine sums the micro-batch
    gradients), divides by this micro-batch's sequence count, as `train_step` does. With LoRA,
    `params` are the adapters and `base` the frozen base (see `train_step`). `rng`: this
    micro-batch's key, fold_in(update_key, m) for micro-batch m (required by clip_cov).

    Returns:
      (grads, metrics): this micro-batch's metrics (the mini-batch's come from
      `combine_micro_metrics` over its micro-batches).
    """
    lc = loss_config
    _check_rng(lc, rng)
    rows = batch.response_mask_BT.shape[0]
    mask_all_BT = batch.response_mask_BT.astype(jnp.float32)
    num_tokens = batch_num_tokens(batch)
    shape = mask_all_BT.shape
    in_micro_BT = scatter_slots(
        jnp.ones(micro.slot_bt_GN.shape, jnp.float32), micro.slot_bt_GN, shape
    )
    mask_BT = mask_all_BT * in_micro_BT
    # This micro-batch's sequences: those with a response token in it (an empty response has
    # no slot, so it counts in no micro-batch; its geo_mean loss is 0 all the same).
    micro_rows = jnp.sum(jnp.max(in_micro_BT, axis=1))
    is_moe = model_config.num_moe_layers > 0  # router metrics, as train_step's

    def loss_fn(params):
        lp_GN, ent_GN, *stats = packed_log_probs(
            model_config,
            policy_params(base, params),
            micro,
            temperature=lc.temperature,
            chunk_size=lc.chunk_size,
            calculate_entropy=_wants_entropy(lc),
            num_bt=mask_all_BT.size,
            router_stats=is_moe,
        )
        lp_BT = scatter_slots(lp_GN, micro.slot_bt_GN, shape)
        ent_BT = None if ent_GN is None else scatter_slots(ent_GN, micro.slot_bt_GN, shape)
        value, metrics = _objective(
            lc, lp_BT, ent_BT, batch, mask_BT, num_tokens=num_tokens, rows=rows,
            micro_rows=micro_rows, rng=rng,
        )  # fmt: skip
        if is_moe:
            metrics |= moe_metrics(stats[0], replayed=micro.routing_RLmLA is not None)
        return value, metrics

    (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, grads, g), metrics


def sft_step(
    state: TrainState,
    batch: TrainBatch,
    lr,
    base=None,
    *,
    model_config: model_lib.ModelConfig,
    tx,
    micro_batch_size: int,
    chunk_size: int = 1024,
):
    """One supervised step: token-mean negative log-likelihood of the responses (warm-up).

    `batch.response_ids_BT` holds the reference answers; advantages and old log-probs are unused.
    With LoRA, `base` is the frozen base and state.params the adapters (see `train_step`).

    Returns:
      (new_state, metrics) with sft/nll, actor/grad_norm, actor/lr, actor/update_skipped.
    """
    num_rows = batch.input_ids_BS.shape[0]
    num_micro = _num_chunks(num_rows, micro_batch_size, "actor.ppo_micro_batch_size")
    num_tokens = jnp.sum(batch.response_mask_BT.astype(jnp.float32))

    def loss_fn(params, micro: TrainBatch):
        lp_BT, _ = response_log_probs(
            model_config,
            policy_params(base, params),
            micro.input_ids_BS,
            micro.attention_mask_BS,
            micro.response_ids_BT,
            temperature=1.0,
            chunk_size=chunk_size,
            calculate_entropy=False,
        )
        return loss_lib.agg_loss(
            -lp_BT, micro.response_mask_BT, "token-mean", batch_num_tokens=num_tokens
        )

    def body(grads, micro):
        nll, g = jax.value_and_grad(loss_fn)(state.params, micro)
        return jax.tree.map(jnp.add, grads, g), nll

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, nll_M = jax.lax.scan(body, zeros, _micro_batches(batch, num_micro))
    nll = jnp.sum(nll_M)  # each micro-batch is normalised by the batch's token count
    state, opt_metrics = apply_gradients(state, grads, nll, lr, tx)
    return state, {"sft/nll": nll, **opt_metrics}
