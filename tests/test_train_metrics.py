"""metrics.jsonl writing, truncation on resume, and the on-demand plot command."""

import json
import os
import subprocess
import sys

import pytest

from grpo_jax.trainer import metrics, plot


def test_writer_truncate_and_torn_line(tmp_path):
    w = metrics.Writer(str(tmp_path), tensorboard=False)
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
    disabled = metrics.Writer(str(tmp_path / "other"), tensorboard=False, enabled=False)
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
    w = metrics.Writer(str(tmp_path), tensorboard=True)
    with caplog.at_level("INFO", logger="tensorboardX"):
        w.write(2, {"val-core/openai/gsm8k/acc/mean@1": 0.5, "actor/pg_loss": -0.1})
    w.close()
    assert "illegal" not in caplog.text
    assert _event_tags(tmp_path / "tensorboard") == {
        "val-core/openai/gsm8k/acc/mean_at_1", "actor/pg_loss"}  # fmt: skip
    assert metrics.read(str(tmp_path)) == [
        {"step": 2, "actor/pg_loss": -0.1, "val-core/openai/gsm8k/acc/mean@1": 0.5}]  # fmt: skip
