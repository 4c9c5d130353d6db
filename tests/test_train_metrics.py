"""metrics.jsonl writing, truncation on resume, and the on-demand plot command."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax.trainer import metrics, plot, trackers


def test_writer_truncate_and_torn_line(tmp_path):
    w = metrics.Writer(str(tmp_path))
    for step in range(4):
        w.write(step, {"critic/score/mean": step / 4, "actor/kl_loss": float("nan")})
    # A kill mid-write leaves a torn last line; readers stop there.
    with open(tmp_path / metrics.METRICS_FILE, "a") as f:
        f.write('{"step": 4, "critic/sc')
    records = metrics.read(str(tmp_path))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["critic/score/mean"] == 0.5 and records[2]["actor/kl_loss"] == "nan"
    # Resuming from the step-2 checkpoint drops the later rows (and the torn line).
    w.truncate_after(2)
    assert [r["step"] for r in metrics.read(str(tmp_path))] == [0, 1, 2]
    w.write(3, {"critic/score/mean": 0.9})
    assert metrics.read(str(tmp_path))[-1] == {"step": 3, "critic/score/mean": 0.9}
    disabled = metrics.Writer(str(tmp_path / "other"), enabled=False)
    disabled.write(0, {"x": 1.0})
    assert not os.path.exists(tmp_path / "other" / metrics.METRICS_FILE)


def test_plot_on_demand(tmp_path):
    rows = [
        {"step": 0, "val/gsm8k/acc": 0.1},
        {"step": 1, "critic/score/mean": 0.2, "response_length/mean": 30.0, "actor/kl_loss": 0.01},
        {
            "step": 2,
            "critic/score/mean": 0.4,
            "response_length/mean": 28.0,
            "actor/kl_loss": 0.02,
            "val/gsm8k/acc": 0.3,
        },
    ]
    (tmp_path / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "-m", "grpo_jax.trainer.plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    png = tmp_path / "plot.png"
    assert out.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no metrics"):
        plot.plot(str(empty))


def _event_tags(logdir) -> set[str]:
    """The scalar tags in a tensorboardX event file (TFRecord framing: u64 length, u32 crc,
    the Event proto, u32 crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    tags = set()
    for name in os.listdir(logdir):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            tags |= {v.tag for v in event.summary.value}
            pos += 12 + length + 4
    return tags


def test_tensorboard_gets_legal_tags_and_metrics_jsonl_verls_keys(tmp_path, caplog):
    # verl's validation keys carry "@", which TensorBoard rejects (it logged a warning per key
    # at every validation and renamed them itself).
    tracked = trackers.start(("tensorboard",), workdir=str(tmp_path), project="p",
                             experiment="e", params={}, resume=False)  # fmt: skip
    w = metrics.Writer(str(tmp_path), trackers=tracked)
    with caplog.at_level("INFO", logger="tensorboardX"):
        w.write(2, {"val-core/openai/gsm8k/acc/mean@1": 0.5, "actor/pg_loss": -0.1})
    w.close()
    assert "illegal" not in caplog.text
    assert _event_tags(tmp_path / "tensorboard") == {
        "val-core/openai/gsm8k/acc/mean_at_1", "actor/pg_loss"}  # fmt: skip
    assert metrics.read(str(tmp_path)) == [
        {"step": 2, "actor/pg_loss": -0.1, "val-core/openai/gsm8k/acc/mean@1": 0.5}]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# A step's data, timing and throughput metrics against verl 0.9.1's own functions
# (tests/verl_metrics.py:step_metrics runs them as verl's v1 trainer feeds them).

# grpo_jax's own keys among those below (docs/verl.md, "Metrics").
_OWN_DATA_KEYS = {"response_length/truncated_ratio", "prompt_length/truncated_ratio",
                  "reward/num_errors", "reward/num_lost"}  # fmt: skip


def _generated_step(seed, *, B=12, P=5, T=6, all_aborted=False, at_limits=True):
    """A random batch: prompt lengths 1..P, response lengths 0..T (0: aborted, T: at the
    limit; without `at_limits` none reaches P or T), tied 0/1/0.5 scores, token rewards with
    an in-reward KL term, advantages and returns that differ, and rejection sampling zeroing
    some tokens of the response mask."""
    r = np.random.default_rng(seed)
    short = 0 if at_limits else 2
    prompt_len = r.integers(1, P + 1 - short, B)
    resp_len = np.zeros(B, int) if all_aborted else r.integers(0, T + 1 - short, B)
    if not all_aborted:
        resp_len[:2] = T - short, 0
    prompt_mask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int32)
    mask = (np.arange(T)[None] < resp_len[:, None]).astype(np.int32)
    kept = mask * (r.random((B, T)) > 0.2)  # rejection sampling keeps these tokens
    scores = r.choice([0.0, 0.5, 1.0], B).astype(np.float32)
    last = np.eye(T, dtype=np.float32)[np.maximum(resp_len - 1, 0)] * mask
    rewards = (scores[:, None] * last - 0.01 * r.random((B, T)) * mask).astype(np.float32)
    adv = (r.normal(size=(B, 1)) * mask).astype(np.float32)
    returns = (r.normal(size=(B, T)) * mask).astype(np.float32)
    return prompt_len, resp_len, prompt_mask, mask, kept, scores, rewards, adv, returns


@pytest.mark.parametrize(
    "seed, all_aborted, at_limits",
    [(0, False, True), (1, False, True), (2, False, False), (3, True, True)],
)
def test_step_metrics_match_verl(verl, seed, all_aborted, at_limits):
    import reference

    from grpo_jax.rewards import functions as reward_fns
    from grpo_jax.trainer import perf

    P, T = 5, 6
    (prompt_len, resp_len, prompt_mask, mask, kept, scores, rewards, adv,
     returns) = _generated_step(seed, P=P, T=T, all_aborted=all_aborted,
                                at_limits=at_limits)  # fmt: skip
    timing = {"timing_s/gen": 1.5, "timing_s/ref": 0.25, "timing_s/adv": 0.125,
              "timing_s/update_actor": 2.0, "timing_s/old_log_prob": 0.5,
              "timing_s/step": 4.5}  # fmt: skip
    result = reward_fns.RewardResult(list(map(float, scores)), {"f": list(scores)}, {}, 0, 0)
    ours = metrics.data_metrics(result, mask, prompt_mask, max_response_length=T,
                                max_prompt_length=P)  # fmt: skip
    device = metrics.advantage_stats(adv, returns, rewards, kept, mask)
    ours |= {k: float(v) for k, v in device.items()} | timing
    ours |= perf.timing_per_token(timing, prompt_tokens=int(prompt_len.sum()),
                                  response_tokens=int(resp_len.sum()))  # fmt: skip
    ours |= perf.throughput(ours["perf/total_num_tokens"], timing["timing_s/step"], devices=2)

    def row(b):
        n = resp_len[b]
        return {"prompt_len": int(prompt_len[b]), "response_len": int(n),
                "response_mask": kept[b, :n].tolist(), "advantages": adv[b, :n].tolist(),
                "returns": returns[b, :n].tolist(), "rm_scores": (scores[b] * last[b, :n]).tolist(),
                "token_level_rewards": rewards[b, :n].tolist()}  # fmt: skip

    last = np.eye(T, dtype=np.float32)[np.maximum(resp_len - 1, 0)]
    theirs = verl.run(reference.fn("verl_metrics:step_metrics")(
        [row(b) for b in range(len(resp_len))],
        {k.removeprefix("timing_s/"): v for k, v in timing.items()}, 2,
    )).value  # fmt: skip
    assert set(ours) - set(theirs) == _OWN_DATA_KEYS
    assert set(theirs) <= set(ours)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    # verl's v1 clip ratio is the share as long as the batch's longest, whatever the limit
    assert ours["response_length/clip_ratio"] > 0 and ours["prompt_length/clip_ratio"] > 0
    if not at_limits:
        assert ours["response_length/truncated_ratio"] == ours["prompt_length/truncated_ratio"] == 0
    if all_aborted:
        assert np.isnan(ours["critic/score/mean"]) and np.isnan(ours["critic/advantages/max"])


# ---------------------------------------------------------------------------------------------
# The update's memory metrics: verl's actor/perf/* names (workers/engine_workers.py).


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_memory_metrics_use_verls_names_and_measure_only_what_exists(verl):
    import reference

    from grpo_jax.trainer import perf

    gib = 1024**3
    # CPU devices report no allocator stats: no device keys rather than a made-up number
    got = perf.memory()
    assert not any("max_memory" in k for k in got)
    # verl: psutil.virtual_memory().used, the machine's used memory (it moves between reads)
    used = verl.run(reference.attr(reference.fn("psutil:virtual_memory")(), "used")).value
    np.testing.assert_allclose(got["actor/perf/cpu_memory_used_gb"], used / gib, rtol=0.05,
                               atol=0.5)  # fmt: skip
    assert got["perf/cpu_memory_used_gb"] > 0.05  # grpo_jax's: this process's peak RSS
    # GPU-like stats: the largest peak over the local devices; torch's reserved memory is the
    # peak of XLA's allocator pool, not its limit
    devices = [_Device({"peak_bytes_in_use": 3 * gib, "peak_pool_bytes": 5 * gib,
                        "bytes_limit": 80 * gib}),
               _Device({"peak_bytes_in_use": 4 * gib, "peak_pool_bytes": 4 * gib}),
               _Device(None)]  # fmt: skip
    got = perf.memory(devices)
    for prefix in ("actor/perf", "perf"):
        assert got[f"{prefix}/max_memory_allocated_gb"] == 4.0
        assert got[f"{prefix}/max_memory_reserved_gb"] == 5.0
    # a backend without the pool's stat reports no reserved memory
    got = perf.memory([_Device({"peak_bytes_in_use": gib, "bytes_limit": 80 * gib})])
    assert got["actor/perf/max_memory_allocated_gb"] == 1.0
    assert "actor/perf/max_memory_reserved_gb" not in got


# ---------------------------------------------------------------------------------------------
# actor/lr and training/epoch of the loop's rows (tiny random model, one device)


def test_loop_logs_verls_learning_rate_and_epoch(verl, tmp_path):
    # verl steps its LR scheduler after a step's last mini-batch and logs the rate
    # get_last_lr() returns then (workers/engine_workers.py train_batch, transformer_impl.py
    # lr_scheduler_step): the rate of the *next* step. With a warm-up from 0, step 1 trains at
    # lr 0 and logs lr / warmup. training/epoch is (global_step - 1) // steps_per_epoch.
    import jax
    import reference

    from grpo_jax import config, loading, sharding
    from grpo_jax.data import demo_task
    from grpo_jax.trainer import loop

    optim = config.OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine",
                               min_lr_ratio=0.1)  # fmt: skip
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=32, max_response_length=4),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                                 optim=optim),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=4),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=3, save_freq=-1, test_freq=-1,
                                     val_before_train=False, progress_bar=False,
                                     tensorboard=False, default_local_dir=str(tmp_path)),
    )  # fmt: skip
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(
            config.ModelSpec(source="random", tokenizer="char", path=None), tok, mesh,
            sharding.LOGICAL_RULES, max_positions=64,
        )  # fmt: skip
        rows, _ = demo_task.arithmetic_rows(4, 1, max_operand=20, seed=0)  # 2 steps an epoch
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=rows, reward_fn=lambda solution_str, ground_truth: 0.0,
                            mesh=mesh)  # fmt: skip
    history = [r for r in result.history if "actor/lr" in r]
    want = verl.run(reference.fn("verl_metrics:lr_after_steps")(
        lr=1e-3, kind="cosine", warmup_steps=2, total_steps=3, min_lr_ratio=0.1, steps=3
    )).value  # fmt: skip
    np.testing.assert_allclose([r["actor/lr"] for r in history], want, rtol=1e-6)
    assert want[0] == 0.5e-3  # the rate after step 1, not the 0 step 1 trained at
    assert [r["training/epoch"] for r in history] == [0, 0, 1]
