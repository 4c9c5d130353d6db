"""Router replay (actor.router_replay, verl 0.9.1's R2 / R3): the grouped sampler records each
token's experts, and the trainer's passes reuse them.

The rollout/trainer drift that replay fixes is stood in for by noise added to the routers
between the rollout and the log-prob passes: without replay some tokens go to other experts and
the log-probs move; replaying the rollout's experts (R3) gives back the rollout's log-probs.
Then two-step runs of a tiny random Qwen3-MoE through `loop.train`, padded and packed, with and
without replay.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from test_data import qwen3_like_tokenizer

from grpo_jax import config, model, sampler, sharding
from grpo_jax.data import demo_task
from grpo_jax.models import moe, transformer
from grpo_jax.trainer import actor, loop, packing, train_stage


def _tiny_moe(**overrides):
    """Layers MoE, dense, MoE; top-1 routing with norm_topk_prob, so a replayed expert's weight
    is exactly 1 whatever the router's probabilities: the test isolates the choice of experts
    (with top-2 the drifted router would also reweigh the replayed pair, as in verl)."""
    return model.ModelConfig(**{
        "arch": "qwen3_moe", "qkv_bias": False, "qk_norm": True, "num_layers": 3,
        "num_experts": 8, "num_experts_per_tok": 1, "norm_topk_prob": True,
        "moe_intermediate_size": 16, "mlp_only_layers": (1,), "tie_word_embeddings": False,
        "initializer_range": 0.3, "vocab_size": 64, **overrides,
    })  # fmt: skip


def _drifted(params, scale: float, seed: int = 7):
    """`params` with Gaussian noise of std `scale` added to every router kernel."""
    router = params["layers"]["moe"]["router"]["kernel"]
    noise = scale * jax.random.normal(jax.random.key(seed), router.shape, router.dtype)
    layers = {**params["layers"], "moe": {**params["layers"]["moe"], "router": {
        "kernel": router + noise}}}  # fmt: skip
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def rolled():
    """A recorded rollout of the tiny MoE: (config, params, rollout, its TrainBatch)."""
    config_ = _tiny_moe()
    params = model.init_params(config_, jax.random.key(3))
    rng = np.random.default_rng(0)
    ids_PT = rng.integers(1, 64, (2, 6)).astype(np.int32)
    mask_PT = np.ones_like(ids_PT)
    mask_PT[1, :2] = 0
    rollout = sampler.sample(
        config_, params, ids_PT, mask_PT, jax.random.key(0), n=4, max_new_tokens=12,
        temperature=1.0, eos_token_ids=(5,), record_routing=True,
    )  # fmt: skip
    batch = train_stage.train_batch(rollout, prompt_width=6, bucket=8)
    return config_, params, rollout, batch


def _log_probs(config_, params, batch):
    return actor.compute_log_probs(
        config_, params, batch, micro_batch_size=4, temperature=1.0, chunk_size=64,
        calculate_entropy=False,
    )[0]  # fmt: skip


def _own_experts(config_, params, batch):
    """[B, Lm, S, A]: the experts the routers of `params` choose on the batch, no replay."""
    _, stats = transformer.hidden_states_and_routing(
        config_, params, batch.input_ids_BS, batch.attention_mask_BS
    )
    return np.asarray(stats.experts_LmBTA).transpose(1, 0, 2, 3)


def _fed(attention_mask_BS):
    """The tokens a rollout fed through the model: real and followed by a real one (a row's
    last token is drawn, never fed; the prompt's last is followed by the response's first)."""
    real_BS = np.asarray(attention_mask_BS).astype(bool)
    return real_BS & np.pad(real_BS[:, 1:], ((0, 0), (0, 1)))


def test_rollout_records_the_experts_the_forward_chooses(rolled):
    config_, params, rollout, batch = rolled
    routed = np.asarray(batch.routed_experts_BLSA)
    assert routed.dtype == np.uint8 and moe.no_route(config_.num_experts) == 255
    # Every token fed through the model has its experts, the same the trainer's forward picks
    # under the same weights; the others (padding, each row's last token) have none.
    fed_BS = _fed(batch.attention_mask_BS)
    assert fed_BS[:, -1].sum() == 0 and (~fed_BS & np.asarray(batch.attention_mask_BS)).any()
    routed_BSLA = routed.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(
        routed_BSLA[fed_BS], _own_experts(config_, params, batch).transpose(0, 2, 1, 3)[fed_BS]
    )
    assert (routed_BSLA[~fed_BS] == 255).all()
    # The prompt is prefilled once per group: its rows' prompt experts are the same.
    prompt = routed[:, :, :8].reshape(2, 4, *routed.shape[1:2], 8, -1)
    assert (prompt == prompt[:, :1]).all()


def test_drifted_router_changes_routing_and_replay_restores_the_rollout_log_probs(rolled):
    config_, params, rollout, batch = rolled
    mask_BT = np.asarray(rollout.response_mask).astype(bool)
    rollout_BT = np.asarray(rollout.log_probs)
    # Same weights: the trainer's log-probs are the rollout's, replay or not.
    np.testing.assert_allclose(
        np.asarray(_log_probs(config_, params, batch))[mask_BT], rollout_BT[mask_BT], atol=2e-5
    )
    drifted = _drifted(params, 0.05)
    # Without replay the drifted routers send some real tokens to other experts ...
    real_BS = np.asarray(batch.attention_mask_BS).astype(bool)
    real_BS[:, -1] = False
    own = _own_experts(config_, drifted, batch).transpose(0, 2, 1, 3)[real_BS]
    recorded = np.asarray(batch.routed_experts_BLSA).transpose(0, 2, 1, 3)[real_BS]
    moved = np.mean(np.any(own != recorded, axis=-1))
    assert 0 < moved < 0.5
    # ... and the log-probs move with them.
    plain_BT = np.asarray(_log_probs(config_, drifted, batch.replace(routed_experts_BLSA=None)))
    assert np.abs(plain_BT - rollout_BT)[mask_BT].max() > 1e-2
    # Replaying the rollout's experts (R3) gives back the rollout's log-probs.
    replay_BT = np.asarray(_log_probs(config_, drifted, batch))
    np.testing.assert_allclose(replay_BT[mask_BT], rollout_BT[mask_BT], atol=2e-5)


def test_replay_on_a_sharded_mesh_equals_one_device(rolled):
    # experts split over fsdp, rows over data and fsdp, the recorded experts with their rows
    config_, params, _, batch = rolled
    drifted = _drifted(params, 0.05)
    expected = np.asarray(_log_probs(config_, drifted, batch))
    mesh = sharding.make_mesh((2, 2, 2))
    with sharding.use_mesh(mesh):
        p = jax.device_put(drifted, sharding.param_shardings(config_, mesh))
        b = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch)
        got = jax.jit(_log_probs, static_argnums=0)(config_, p, b)
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)


def test_update_logs_the_replay_mismatch_of_the_drifted_routers(rolled):
    config_, params, rollout, batch = rolled
    tx = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.0)
    batch = batch.replace(advantages_BT=jnp.ones(batch.response_mask_BT.shape, jnp.float32))

    step = jax.jit(functools.partial(
        actor.train_step, rng=None, model_config=config_, loss_config=actor.LossConfig(), tx=tx,
        mini_batch_size=8, micro_batch_size=8,  # one micro-batch: several are averaged, as verl's
    ))  # fmt: skip

    def mismatch(p, b):
        _, metrics = step(actor.init_state(p, tx), b, jnp.int32(0), jnp.float32(1e-3))
        return metrics.get("actor/router_replay_mismatch")

    assert mismatch(params, batch.replace(routed_experts_BLSA=None)) is None  # nothing replayed
    assert float(mismatch(params, batch)) == 0.0  # the rollout's own routers
    # With the drifted routers on the rollout's hidden states (replay keeps them the rollout's):
    # the share of replayed real (layer, token) pairs whose own top-1 is another expert.
    drifted = _drifted(params, 0.05)
    h_routing = transformer.hidden_states_and_routing(
        config_, drifted, batch.input_ids_BS, batch.attention_mask_BS,
        jnp.asarray(batch.routed_experts_BLSA).transpose(1, 0, 2, 3),
    )[1]  # fmt: skip
    expected = float(jnp.sum(h_routing.mismatched_Lm) / jnp.sum(h_routing.replayed_Lm))
    assert 0 < expected < 0.5
    assert float(mismatch(drifted, batch)) == pytest.approx(expected, rel=1e-6)


def test_packed_pass_replays_the_same_experts(rolled):
    config_, params, rollout, batch = rolled
    drifted = _drifted(params, 0.05)
    prompt_ids, prompt_mask = (np.asarray(x) for x in (rollout.prompt_ids, rollout.prompt_mask))
    packed = packing.pack(
        prompt_ids, prompt_mask, np.asarray(rollout.response_ids),
        np.asarray(rollout.response_mask), max_tokens=256, row_len=128,
        routing_BLSA=np.asarray(batch.routed_experts_BLSA),
    )  # fmt: skip
    shape = batch.response_mask_BT.shape
    lp_BT = jnp.zeros(shape, jnp.float32)
    for m in range(packed.num_micro):
        micro = actor.PackedMicro(**{k: jnp.asarray(v) for k, v in packed.micro(m).items()})
        lp_BT, _ = actor.packed_log_probs_into(
            config_, drifted, micro, lp_BT, jnp.zeros(shape, jnp.float32), temperature=1.0,
            chunk_size=64, calculate_entropy=False,
        )  # fmt: skip
    mask_BT = np.asarray(rollout.response_mask).astype(bool)
    np.testing.assert_allclose(
        np.asarray(lp_BT)[mask_BT], np.asarray(rollout.log_probs)[mask_BT], atol=2e-5
    )


def test_dynamic_sampling_keeps_each_rows_experts(rolled):
    # DAPO's group filter (select_groups) and refills (concat) rebuild the rollout from host
    # arrays of the host prompts' width: each row keeps its experts, column for column.
    from grpo_jax.rewards import functions as reward_fns
    from grpo_jax.trainer import batch as batch_lib
    from grpo_jax.trainer import rollout_stage

    _, _, rollout, batch = rolled
    ids, mask = (np.asarray(x)[:, -6:] for x in (rollout.prompt_ids, rollout.prompt_mask))
    host = batch_lib.HostRollout(ids, mask, np.asarray(rollout.response_ids),
                                 np.asarray(rollout.response_mask))  # fmt: skip
    result = reward_fns.RewardResult([0.0] * 8, {}, {}, 0, 0)
    sampled = batch_lib.RolloutBatch(rollout, host, [""] * 8, [None] * 8, result, group_size=4)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    second = rollout_stage.select_groups(sampled, [1], mesh)
    both = rollout_stage.concat([second, rollout_stage.select_groups(sampled, [0], mesh)], mesh)
    expected = np.asarray(batch.routed_experts_BLSA).transpose(0, 2, 1, 3)
    real_BS = np.asarray(batch.attention_mask_BS).astype(bool)
    for kept, rows in ((second, np.arange(4, 8)), (both, np.r_[4:8, 0:4])):
        again = train_stage.train_batch(kept.rollout, prompt_width=6, bucket=8)
        routed = np.asarray(again.routed_experts_BLSA).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(routed[real_BS[rows]], expected[rows][real_BS[rows]])
        # the left padding (recorded by the sampler, cut on the host) routes natively
        assert (routed[:, :2] == 255).all()


def test_native_engine_records_through_either_sampler(rolled):
    # 8 rows: all at once through the grouped sampler (8 slots), or paged through 4 / 3
    from grpo_jax.rollout import engines

    config_, params, rollout, _ = rolled
    ids_PT, mask_PT = (np.asarray(x)[::4, -6:] for x in (rollout.prompt_ids, rollout.prompt_mask))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    sp = engines.SamplingParams(n=4, max_new_tokens=12, temperature=1.0, record_routing=True)
    for slots in (8, 4, 3):
        engine = engines.NativeEngine(config_, mesh, max_num_seqs=slots, eos_ids=(5,), pad_id=0)
        again = engine.sample(params, ids_PT, mask_PT, jax.random.key(0), sp)
        np.testing.assert_array_equal(again.response_ids, rollout.response_ids)
        np.testing.assert_array_equal(again.routed_experts, rollout.routed_experts)


_PAGED = {  # max_num_seqs, page_size, max_num_batched_tokens, segment_steps, spare pages
    # (None: the default pool, which never preempts; else one row's full length and as many
    # pages more: rows grow, and the newest are preempted and recomputed)
    "all rows at once": (1024, 16, 8192, 16, None),
    "one slot, chunks of 4": (1, 2, 4, 2, None),
    "4 slots, pages of 4, tight": (4, 4, 8, 3, 1),
    "6 slots, pages of 2, tight": (6, 2, 16, 2, 2),
}


@pytest.fixture(scope="module")
def mixed():
    """Prompts of 1 (nothing to prefill) to 30 tokens, n = 3, an EOS drawn mid-way: (config,
    params, ids, mask, sampling kwargs, the grouped sampler's recorded rollout)."""
    from test_paged import _prompts

    config_ = _tiny_moe()
    params = model.init_params(config_, jax.random.key(3))
    ids, mask = _prompts([5, 9, 1, 17, 3, 30], config_.vocab_size, seed=1)
    kw = dict(n=3, max_new_tokens=20, temperature=1.0, eos_token_ids=(5,), record_routing=True)
    ref = sampler.sample(config_, params, ids, mask, jax.random.key(7), **kw)
    return config_, params, ids, mask, kw, ref


@pytest.mark.parametrize("schedule", list(_PAGED), ids=list(_PAGED))
def test_the_paged_engine_records_the_grouped_samplers_experts(mixed, schedule):
    # The prefill's chunks record the prompt's tokens, shared by the group's rows, and each
    # decode step the token a row feeds; a preempted row records its recomputed tokens again.
    from test_paged import _one_row_pages

    from grpo_jax.rollout import paged, paged_programs

    config_, params, ids, mask, kw, ref = mixed
    seqs, page, batched, segment, spare = _PAGED[schedule]
    num_pages = None if spare is None else spare + _one_row_pages(
        ids, mask, page_size=page, max_new_tokens=kw["max_new_tokens"])  # fmt: skip
    stats = {}
    out = paged.sample_paged(
        config_, params, ids, mask, jax.random.key(7), max_num_seqs=seqs, page_size=page,
        max_num_batched_tokens=batched, segment_steps=segment, num_pages=num_pages,
        stats=stats, **kw,
    )  # fmt: skip
    if spare is not None:
        assert stats["preemptions"] > 0 and stats["replayed_tokens"] > 0
    for field in ("response_ids", "response_mask", "routed_experts"):
        np.testing.assert_array_equal(getattr(out, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=1e-5)
    # Recording is per call's shapes: other prompts of the bucket compile no new program.
    sizes = {name: fn._cache_size() for name, fn in paged_programs.programs().items()}
    other = paged.sample_paged(
        config_, params, np.roll(ids, 1, axis=0), np.roll(mask, 1, axis=0), jax.random.key(8),
        max_num_seqs=seqs, page_size=page, max_num_batched_tokens=batched,
        segment_steps=segment, num_pages=num_pages, **kw,
    )  # fmt: skip
    assert {name: fn._cache_size() for name, fn in paged_programs.programs().items()} == sizes
    assert other.routed_experts.shape == ref.routed_experts.shape


@pytest.mark.reference("verl")
def test_modes_and_default_are_verls(verl):
    theirs = verl.run(reference.fn("verl_config:router_replay_modes")()).value
    assert config.RouterReplayConfig().mode == theirs["default"] == "disabled"
    ours = []
    for mode in ("disabled", "R2", "R3", "R1", "record", "replay", "r3"):
        try:
            config.RouterReplayConfig(mode=mode)
        except config.ConfigError:
            continue
        ours.append(mode)
    assert ours == theirs["accepted"] == ["disabled", "R2", "R3"]


def test_config_names_the_field_and_what_to_do():
    with pytest.raises(config.ConfigError, match=r"actor.router_replay.mode='R4'"):
        config.ActorConfig(router_replay=config.RouterReplayConfig(mode="R4"))
    r3 = config.ActorConfig(router_replay=config.RouterReplayConfig(mode="R3"))
    with pytest.raises(config.ConfigError, match="rollout.enable_rollout_routing_replay=False"):
        config.RunConfig(actor=r3)
    recording = config.RolloutConfig(enable_rollout_routing_replay=True)
    with pytest.raises(config.ConfigError, match=r"rollout.name='vllm'.*returns no expert ids"):
        config.RunConfig(actor=r3, rollout=dataclasses.replace(
            recording, name="vllm", vllm=config.VLLMSettings(python="/p")))  # fmt: skip
    r2 = config.ActorConfig(router_replay=config.RouterReplayConfig(mode="R2"))
    with pytest.raises(config.ConfigError, match="verl refuses R2 with it"):
        config.RunConfig(actor=r2, rollout=recording)
    run = config.RunConfig(actor=r3, rollout=recording)
    with pytest.raises(config.ConfigError, match="this model is dense"):
        run.check_model_for_router_replay(0)
    run.check_model_for_router_replay(2)


def _run(tmp_path, name, *, mode: str, packed: bool, max_num_seqs: int = 256):
    """Two steps of a random tiny Qwen3-MoE (char tokenizer, arithmetic prompts) through
    loop.train (4 rollout rows a step: max_num_seqs below that pages them): returns its metric
    rows."""
    tok = qwen3_like_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=96, max_response_length=4),
        # two mini-batches: an old-log-prob pass (R2 records there) and a policy that moves
        actor=config.ActorConfig(
            ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=packed,
            ppo_max_token_len_per_gpu=256,
            router_replay=config.RouterReplayConfig(mode=mode),
        ),
        rollout=config.RolloutConfig(
            n=2, log_prob_micro_batch_size_per_gpu=4, log_prob_use_dynamic_bsz=False,
            enable_rollout_routing_replay=mode == "R3", max_num_seqs=max_num_seqs,
        ),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=2, progress_bar=False, tensorboard=False,
                                     default_local_dir=str(tmp_path / name)),
        checkpoint=config.CheckpointConfig(save_last=False),
    )  # fmt: skip
    # two MoE layers of 4 experts, 2 a token, over the character vocabulary
    moe_config = _tiny_moe(vocab_size=len(tok), num_layers=2, mlp_only_layers=(),
                           num_experts=4, num_experts_per_tok=2, initializer_range=0.02)
    params = model.init_params(moe_config, jax.random.key(0))
    with sharding.use_mesh(mesh):
        result = loop.train(
            run, model_config=moe_config, params=params, tokenizer=tok, mesh=mesh,
            train_data=demo_task.arithmetic_rows(4, 2, max_operand=9, seed=0)[0],
            reward_fn=lambda solution_str, ground_truth: len(solution_str) % 3,
        )  # fmt: skip
    return result.history


@pytest.mark.parametrize(
    "packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["padded", "packed"]
)
def test_tiny_moe_trains_two_steps_with_and_without_replay(tmp_path, packed):
    rows = {mode: _run(tmp_path, mode, mode=mode, packed=packed)
            for mode in ("disabled", "R2", "R3")}  # fmt: skip
    for mode, history in rows.items():
        assert len(history) == 2
        for row in history:
            assert np.isfinite(row["actor/pg_loss"]) and row["actor/moe_aux_loss"] > 0
            assert 1.0 >= row["actor/moe_load_max/0"] >= 0.25 >= row["actor/moe_load_min/0"]
            if mode == "disabled":
                assert "actor/router_replay_mismatch" not in row
            else:
                assert 0.0 <= row["actor/router_replay_mismatch"] <= 1.0
    # The first step's rollout is sampled by the same weights whatever the mode.
    first = [history[0]["response_length/mean"] for history in rows.values()]
    assert first == [first[0]] * 3


def test_multi_turn_rows_record_their_tool_turns_experts():
    # A multi-turn rollout decodes through the paged engine: a tool turn's tokens, fed into
    # the waiting row's kept pages, record their experts as drawn tokens do. Every fed token's
    # experts are those the trainer's forward picks over the whole conversation, whatever the
    # slots and the pool (small: waiting rows lose their pages and recompute them).
    from test_multi_turn import qwen_tool_tokenizer
    from test_multi_turn_paged import EchoTool, _agent

    from grpo_jax.data import prompts
    from grpo_jax.rollout import engines, multi_turn, paged

    tok = qwen_tool_tokenizer()
    config_ = _tiny_moe(vocab_size=len(tok))
    params = model.init_params(config_, jax.random.key(3))
    # A turn ends on <|im_end|> or a lowercase letter or digit, so turns are short.
    stops = list("abcdefghijklmnopqrstuvwxyz0123456789")
    eos = (tok.eos_token_id, *tok.convert_tokens_to_ids(stops))
    examples = [prompts.Example(({"role": "user", "content": q},), ground_truth="0")
                for q in ("1+6?", "30+4?")]  # fmt: skip
    ps = prompts.encode(tok, examples, max_prompt_length=128, filter_overlong_prompts=False,
                        truncation="error", chat_template_kwargs=None)  # fmt: skip
    batch = prompts.make_batch(ps, range(len(examples)), pad_token_id=0)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    sp = engines.SamplingParams(2, 120, 1.0, record_routing=True)
    routed, schedules, real = [], [], paged.sample_paged

    def spy(*args, **kwargs):
        schedules.append({})
        return real(*args, stats=schedules[-1], **kwargs)

    for slots, num_pages in ((4, None), (2, 24)):
        engine = engines.NativeEngine(config_, mesh, eos_ids=eos, pad_id=0, max_num_seqs=slots,
                                      num_pages=num_pages)  # fmt: skip
        agent = _agent(tok, eos, EchoTool(lambda n: 0.0),
                       multi_turn.Settings(max_assistant_turns=3))  # fmt: skip
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(paged, "sample_paged", spy)
                out = agent.sample(engine, params, batch, jax.random.key(11), sp)
        finally:
            agent.close()
        r = out.rollout
        assert out.row_stats["tool_calls"].sum() >= 2
        train = train_stage.train_batch(r, prompt_width=batch.prompt_ids_PT.shape[1], bucket=8)
        fed_BS = _fed(train.attention_mask_BS)
        tool_BT = (np.asarray(r.response_mask) > 0) & (np.asarray(r.loss_mask) == 0)
        assert (fed_BS[:, -tool_BT.shape[1] :] & tool_BT).sum() > 0  # tool tokens were fed
        got_BSLA = np.asarray(train.routed_experts_BLSA).transpose(0, 2, 1, 3)
        own_BSLA = _own_experts(config_, params, train).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(got_BSLA[fed_BS], own_BSLA[fed_BS])
        assert (got_BSLA[~fed_BS] == 255).all()
        routed.append(np.asarray(r.routed_experts))
    assert schedules[1]["dropped_holds"] > 0 and schedules[1]["replayed_tokens"] > 0
    np.testing.assert_array_equal(routed[0], routed[1])


def test_r3_through_the_paged_engine_trains_as_through_the_grouped_sampler(tmp_path):
    # rollout.max_num_seqs=3 < 4 rows: every step's rollout decodes through the paged engine,
    # which records the experts; the old-log-prob pass replays them under the rollout's own
    # weights, so its log-probs are the rollout's, and the run is the grouped sampler's.
    from grpo_jax.rollout import paged

    calls, real = [], paged.sample_paged

    def spy(*args, **kwargs):
        calls.append(kwargs["record_routing"])
        return real(*args, **kwargs)

    grouped = _run(tmp_path, "grouped", mode="R3", packed=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged, "sample_paged", spy)
        paging = _run(tmp_path, "paged", mode="R3", packed=False, max_num_seqs=3)
    assert calls == [True, True]
    for a, b in zip(paging, grouped, strict=True):
        # a wrongly placed expert would move the log-probs and count as a mismatch
        assert a["training/rollout_probs_diff_max"] < 1e-6
        assert a["actor/router_replay_mismatch"] == 0.0
        for key in ("response_length/mean", "actor/router_replay_mismatch"):
            assert a[key] == b[key], key
        np.testing.assert_allclose(a["actor/pg_loss"], b["actor/pg_loss"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_tiny_moe_demo_trains_with_rollout_router_replay(tmp_path):
    # train.py --config=configs/demo.py:tiny,moe (R3), 2 warm-up and 2 GRPO steps: about a minute
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "train.py", "--config=configs/demo.py:tiny,moe",
           f"--config.trainer.default_local_dir={tmp_path}", "--config.trainer.progress_bar=False",
           "--config.trainer.tensorboard=False", "--config.trainer.total_training_steps=2",
           "--config.warmup.steps=2", "--config.trainer.test_freq=-1",
           "--config.trainer.val_before_train=False"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one device
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    # the update replays the rollout's experts under the rollout's own weights (one mini-batch):
    # only a near tie rounded otherwise by the decode and the trainer's forward would differ
    assert all(r["actor/router_replay_mismatch"] <= 0.01 for r in steps)
