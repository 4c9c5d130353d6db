"""Run metrics: one JSON line per step in workdir/metrics.jsonl, mirrored to TensorBoard.

Keys are verl's (`critic/score/mean`, `actor/pg_loss`, `timing_s/gen`, `val/gsm8k/acc`, ...);
values are Python floats. Only the main process writes. On resume, lines of steps after the
restored checkpoint are dropped first, so a resumed run's file equals an uninterrupted run's.
"""

import json
import math
import os

METRICS_FILE = "metrics.jsonl"


def read(workdir: str) -> list[dict]:
    """All records of workdir/metrics.jsonl (a torn last line from a kill is ignored)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


class Writer:
    """Appends metric records; `enabled=False` (non-main processes) makes it a no-op by design."""

    def __init__(self, workdir: str, *, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        if enabled and tensorboard:
            import tensorboardX

            self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Keeps only records with step <= `step` (rewrites the file atomically)."""
        if not self.enabled:
            return
        kept = [r for r in read(os.path.dirname(self.path)) if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, step: int, values: dict) -> None:
        """Appends {"step": step, **values} and flushes it to disk."""
        if not self.enabled:
            return
        record = {"step": int(step)}
        for k, v in sorted(values.items()):
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, float(v), int(step))
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
