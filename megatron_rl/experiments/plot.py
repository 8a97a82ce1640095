"""`megatron-rl plot RUN_DIR [RUN_DIR ...]`: curves of runs' metrics.jsonl as one PNG.

Each metric is drawn as faint raw points (sized by the samples they cover) under a smoothed line: a
sample-weighted exponential moving average over updates (`smooth`), so a line graded on 2 samples
moves the curve 2 samples' worth, not as much as a line graded on 200. `plot_runs` draws several runs
on one figure (one colour per run), e.g. the arms of an ablation.

It lives beside experiments/report.py, not in control/: both are offline readers of run directories
(they draw what the controller wrote to metrics.jsonl, after or during a run, in a process of their own),
and the experiment command draws every run with `plot_runs` next to the report's figure of seed means.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl

PANELS = (
    ("reward", ("reward/mean", "reward/format_ok")),
    ("pass rate", ("pass_rate",)),  # = reward/correct averaged over the line's samples: drawn once, here
    ("completion length", ("length/mean",)),
    ("loss / clip", ("train/loss", "train/clip_frac_low", "train/clip_frac_high")),
    ("entropy", ("train/entropy",)),
    ("grad norm", ("train/grad_norm",)),
    ("staleness", ("staleness/mean", "staleness/max")),
    ("idle fraction", ("generator_idle_frac", "trainer_idle_frac")),
    # trainer vs generator logprobs (docs/train.md "Trainer/generator mismatch"); lag 0 also by context
    ("logprob mismatch", ("mismatch/lag0/abs_mean", "mismatch/lag0_pure/abs_mean", "mismatch/lag0_mixed/abs_mean",
                          "mismatch/lag0/kl_k3", "mismatch/lag1/abs_mean")),
    # held-out evaluation (run.eval_every): a key ending in "*" draws every key it starts (eval/pass@k)
    ("eval (held-out)", ("eval/pass@*",)),
    # multi-turn episodes (env.name): drawn for runs whose episodes have more than one turn
    ("episode turns / tool calls", ("episode/turns", "episode/tool_calls")),
    ("episode tokens", ("episode/env_token_frac", "episode/cached_prefix_frac")),
    ("episode stops", ("episode/stop/*",)),
)
EPISODE_PANELS = {"episode turns / tool calls", "episode tokens", "episode stops"}
# Metrics averaged over the line's graded samples: weighted by `rollouts`; the others by the updates
# the line covers (`updates_in_line`, run.log_every).
PER_SAMPLE = ("reward/", "pass_rate", "length/", "finish/", "staleness/", "versions_per_sequence/", "episode/turns",
              "episode/tool_", "episode/stop/")
LINE_STYLES = ("-", "--", ":", "-.")


def _keys(pattern: str, rows: list[dict]) -> list[str]:
    if not pattern.endswith("*"):
        return [pattern]
    return sorted({k for r in rows for k in r if k.startswith(pattern[:-1])}, key=lambda k: (len(k), k))


def weight(key: str, row: dict) -> float:
    """How many samples (or updates) the line's value of `key` covers."""
    if key.startswith(PER_SAMPLE):
        return float(row.get("rollouts") or 0.0)
    return float(row.get("updates_in_line") or 1.0)


def smooth(x: Sequence[float], y: Sequence[float], w: Sequence[float], halflife: float) -> list[float]:
    """Weighted exponential moving average: at x_t, sum_i w_i d^(x_t - x_i) y_i / sum_i w_i d^(x_t - x_i)
    over the points i <= t, with d = 0.5 ** (1 / halflife): a point's weight halves every `halflife`
    updates (not every point: lines every run.log_every updates decay as much per update)."""
    decay = 0.5 ** (1.0 / halflife)
    num = den = 0.0
    prev = None
    out = []
    for xt, yt, wt in zip(x, y, w):
        if prev is not None:
            num, den = num * decay ** (xt - prev), den * decay ** (xt - prev)
        num, den, prev = num + wt * yt, den + wt, xt
        out.append(num / den if den > 0 else math.nan)
    return out


def default_halflife(x: Sequence[float]) -> float:
    return max(1.0, (max(x) - min(x)) / 20) if x else 1.0


def series(rows: list[dict], key: str) -> tuple[list[int], list[float], list[float]]:
    """(update, value, weight) of the lines that hold a number for `key`, one per update (the last)."""
    by_update = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "update" in row:
            by_update[int(row["update"])] = (float(value), weight(key, row))
    xs = sorted(by_update)
    return xs, [by_update[u][0] for u in xs], [by_update[u][1] for u in xs]


def read_runs(run_dirs: Sequence[str | Path]) -> list[list[dict]]:
    runs = []
    for run_dir in run_dirs:
        rows = read_jsonl(Path(run_dir) / METRICS_FILE)
        if not rows:
            raise FileNotFoundError(f"no metrics in {Path(run_dir) / METRICS_FILE}")
        runs.append(rows)
    return runs


def _draw(ax, x, y, w, halflife, color, style, label) -> None:
    heaviest = max(w) or 1.0
    ax.scatter(x, y, s=[4 + 26 * wi / heaviest for wi in w], color=color, alpha=0.25, linewidths=0)
    ax.plot(x, smooth(x, y, w, halflife), color=color, linestyle=style, linewidth=1.6, label=label)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
              metrics: Sequence[str] | None = None, halflife: float | None = None) -> Path:
    """One figure of the runs' curves: the PANELS, or one panel per key of `metrics` (a key ending in "*"
    draws every key it starts); a panel no run has a value for is left out. One colour per run (per key
    when there is one run); `halflife` in updates (default: a twentieth of the longest run, at least 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = read_runs(run_dirs)
    labels = list(labels) if labels else [Path(d).name or str(d) for d in run_dirs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    multi_turn = any(r.get("episode/turns", 1) > 1 for rows in runs for r in rows)
    panels = [(title, patterns) for title, patterns in ([(key, (key,)) for key in metrics] if metrics else PANELS)
              if any(series(rows, k)[0] for rows in runs for pattern in patterns for k in _keys(pattern, rows))
              and (multi_turn or title not in EPISODE_PANELS)]
    if not panels:  # e.g. --metrics naming keys the runs do not log
        raise ValueError(f"none of the metrics to draw is in {', '.join(str(d) for d in run_dirs)}")
    if halflife is None:
        halflife = max(default_halflife([r["update"] for r in rows if "update" in r]) for rows in runs)
    cols = min(3, len(panels))
    n_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.4 * cols, 3.4 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, patterns) in zip(axes.flat, panels):
        for r, (rows, label) in enumerate(zip(runs, labels)):
            keys = [k for pattern in patterns for k in _keys(pattern, rows)]
            for k, key in enumerate(keys):
                x, y, w = series(rows, key)
                if x:
                    color = f"C{r}" if len(runs) > 1 else f"C{k}"
                    name = key if len(runs) == 1 else label if len(keys) == 1 else f"{label}: {key}"
                    _draw(ax, x, y, w, halflife, color, LINE_STYLES[k % len(LINE_STYLES)] if len(runs) > 1 else "-",
                          name)
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(str(run_dirs[0]) if len(runs) == 1 else " vs ".join(labels))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """The curves of one run, to `out` (default RUN_DIR/curves.png)."""
    return plot_runs([run_dir], Path(out) if out else Path(run_dir) / "curves.png")
