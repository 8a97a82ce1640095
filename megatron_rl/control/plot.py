"""`megatron-rl plot RUN_DIR`: curves of a run's metrics.jsonl as a PNG."""
from __future__ import annotations

from pathlib import Path

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl

PANELS = (
    ("reward", ("reward/mean", "reward/format_ok", "reward/correct")),
    ("pass rate", ("pass_rate",)),
    ("completion length", ("length/mean",)),
    ("loss / clip", ("train/loss", "train/clip_frac_low", "train/clip_frac_high")),
    ("staleness", ("staleness/mean", "staleness/max")),
    ("idle fraction", ("generator_idle_frac", "trainer_idle_frac")),
    # trainer vs generator logprobs (docs/train.md "Trainer/generator mismatch")
    ("logprob mismatch", ("mismatch/lag0/abs_mean", "mismatch/lag0/kl_k3", "mismatch/lag1/abs_mean")),
    # held-out evaluation (run.eval_every): a key ending in "*" draws every key it starts (eval/pass@k)
    ("eval (held-out)", ("eval/pass@*",)),
)


def _keys(pattern: str, rows: list[dict]) -> list[str]:
    if not pattern.endswith("*"):
        return [pattern]
    return sorted({k for r in rows for k in r if k.startswith(pattern[:-1])}, key=lambda k: (len(k), k))


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / METRICS_FILE)
    if not rows:
        raise FileNotFoundError(f"no metrics in {run_dir / METRICS_FILE}")
    x = [r.get("update", i) for i, r in enumerate(rows)]
    n_rows = -(-len(PANELS) // 3)
    fig, axes = plt.subplots(n_rows, 3, figsize=(13, 3.5 * n_rows))
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in [k for pattern in keys for k in _keys(pattern, rows)]:
            ys = [r.get(key) for r in rows]
            pts = [(a, b) for a, b in zip(x, ys) if b is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=key)
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
