"""Training curves as a PNG from workdir/metrics.jsonl: `python -m grpo_jax.plot WORKDIR`.

Three panels: reward and accuracy (critic/score/mean, val/*/acc), response length
(response_length/mean) and KL (actor/kl_loss, else actor/ppo_kl). train.py calls `plot` at the
end of a run; the command makes the same figure on demand, also while a run is going.
"""

import os
import sys

from grpo_jax.trainer import metrics

PANELS = (
    ("reward / accuracy", ("critic/score/mean",), "val/"),
    ("response length (tokens)", ("response_length/mean",), None),
    ("KL", ("actor/kl_loss", "actor/ppo_kl"), None),
)


def plot(workdir: str, out: str | None = None) -> str:
    """Writes the figure (default workdir/plot.png) and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = metrics.read(workdir)
    if not records:
        raise ValueError(f"no metrics in {os.path.join(workdir, metrics.METRICS_FILE)}")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (title, keys, prefix) in zip(axes, PANELS):
        names = [k for k in keys if any(k in r for r in records)][:1]
        if prefix:
            names += sorted(
                {k for r in records for k in r if k.startswith(prefix) and k.endswith("acc")}
            )
        for name in names:
            pts = [(r["step"], r[name]) for r in records if isinstance(r.get(name), float)]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if name.startswith("val/") else None, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        if names:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = out or os.path.join(workdir, "plot.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m grpo_jax.plot WORKDIR")
    print(plot(sys.argv[1]))
