"""The comparison of an experiment's arms: a markdown table and one figure, from RESULTS/ARM-seedK.jsonl.

Single metrics lines are noisy (one line per update covers that update's ~16-48 graded samples), so
every number is a trailing window: at update u, the mean over the lines of updates (u - window, u],
weighted by the samples each line graded for per-sample metrics (reward/..., pass_rate, length/...),
unweighted for the trainer's (train/...); eval/... (held-out, only on evaluated updates) is the last
value at or before u within the window. Over seeds: the mean and the [min, max] range.
Wall time: `elapsed_s`, the running sum of the lines' `wall_s` (each line's own duration; the first one
includes the generators' first fill), so the time a stopped run spent stopped does not count. With a
target (experiment.yaml `target`): the elapsed time at which the trailing mean first reaches the value,
per seed; "not reached" when it never does.

The figure (figure.png) is drawn here: per arm the mean over seeds and a band from min to max. The
command also draws every run on its own with `experiments.plot.plot_runs` (runs.png, from the run directories).
"""
from __future__ import annotations

import math
from pathlib import Path

from megatron_rl.control.metrics import read_jsonl
from megatron_rl.experiments.spec import Experiment

PER_SAMPLE = ("reward/", "pass_rate", "length/", "finish/", "staleness/")
Results = dict[str, dict[int, list[dict]]]  # arm -> seed -> metrics rows


def load_results(exp: Experiment, results_dir: Path) -> Results:
    out: Results = {}
    for arm in exp.arms:
        for path in sorted(results_dir.glob(f"{arm}-seed*.jsonl")):
            seed = path.stem[len(arm) + len("-seed"):]
            if seed.isdigit():
                out.setdefault(arm, {})[int(seed)] = with_elapsed(read_jsonl(path))
    return out


def with_elapsed(rows: list[dict]) -> list[dict]:
    """The rows with `elapsed_s`: the running sum of their `wall_s` (rows without it get none)."""
    total, out = 0.0, []
    for r in rows:
        r = dict(r)
        if _finite(r.get("wall_s")):
            total += float(r["wall_s"])
            r["elapsed_s"] = total
        out.append(r)
    return out


def trailing_mean(rows: list[dict], key: str, upto: float, window: int, x: str = "update") -> float | None:
    """The window's mean of `key` at x = upto (see the module docstring); None without values."""
    if key.startswith("eval/"):
        vals = [r[key] for r in rows if key in r and upto - window < r["update"] <= upto] if x == "update" else \
            [r[key] for r in rows if key in r and r.get(x, math.inf) <= upto]
        return float(vals[-1]) if vals else None
    ups = [r["update"] for r in rows if r.get(x, math.inf) <= upto]
    if not ups:
        return None
    last = max(ups)
    sel = [r for r in rows if key in r and last - window < r["update"] <= last and _finite(r[key])]
    weights = [float(r.get("rollouts", 0)) if key.startswith(PER_SAMPLE) else 1.0 for r in sel]
    total = sum(weights)
    return sum(w * float(r[key]) for w, r in zip(weights, sel)) / total if total else None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def time_to_target(rows: list[dict], key: str, value: float, window: int) -> float | None:
    """Elapsed time (s) of the first update whose trailing mean of `key` reaches `value`."""
    for r in rows:
        m = trailing_mean(rows, key, r["update"], window)
        if m is not None and m >= value and "elapsed_s" in r:
            return float(r["elapsed_s"])
    return None


def _summary(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    spread = f" [{min(vals):.3g}, {max(vals):.3g}]" if len(vals) > 1 else ""
    missing = f" ({len(values) - len(vals)} n/a)" if len(vals) < len(values) else ""
    return f"{mean:.3g}{spread}{missing}"


def window_for(updates: int) -> int:
    return max(1, updates // 4)


def table(exp: Experiment, results: Results, updates: int) -> str:
    """Markdown: per metric, arms x fixed update counts (mean [min, max] over seeds)."""
    at = exp.table_updates(updates)
    window = window_for(updates)
    lines = [f"# {exp.name}", "", f"Trailing mean over {window} update(s) at each update count; "
             f"mean [min, max] over seeds (n = seeds per arm).", ""]
    for key in exp.metrics:
        lines += [f"## {key}", "", "| arm | n | " + " | ".join(f"@{u}" for u in at) + " |",
                  "|---|---|" + "---|" * len(at)]
        for arm, seeds in results.items():
            cells = [_summary([trailing_mean(rows, key, u, window) for rows in seeds.values()]) for u in at]
            lines.append(f"| {arm} | {len(seeds)} | " + " | ".join(cells) + " |")
        lines.append("")
    if exp.target:
        t = exp.target
        lines += [f"## wall time to {t.metric} >= {t.value} (s)", "", "| arm | n | time to target | s / update |",
                  "|---|---|---|---|"]
        for arm, seeds in results.items():
            reach = [time_to_target(rows, t.metric, t.value, window) for rows in seeds.values()]
            per_update = [_wall_per_update(rows) for rows in seeds.values()]
            lines.append(f"| {arm} | {len(seeds)} | {_summary(reach) if any(reach) else 'not reached'} | "
                         f"{_summary(per_update)} |")
        lines.append("")
    return "\n".join(lines)


def _wall_per_update(rows: list[dict]) -> float | None:
    """Seconds per update after the first line (which also holds the start-up)."""
    timed = [r for r in rows if "elapsed_s" in r]
    if len(timed) < 2:
        return None
    return (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"]) / (timed[-1]["update"] - timed[0]["update"])


def figure(exp: Experiment, results: Results, updates: int, out: Path) -> Path:
    """One panel per metric: per arm the mean over seeds of the trailing mean, a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = window_for(updates)
    cols = min(3, len(exp.metrics))
    n_rows = -(-len(exp.metrics) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.6 * cols, 3.4 * n_rows), squeeze=False)
    for ax in axes.flat[len(exp.metrics):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, exp.metrics):
        drawn = False
        for i, (arm, seeds) in enumerate(results.items()):
            xs, mean, lo, hi = _curve(list(seeds.values()), key, window, exp.x)
            if not xs:
                continue
            drawn = True
            color = f"C{i}"
            ax.plot(xs, mean, color=color, label=f"{arm} (n={len(seeds)})", marker="." if len(xs) < 4 else None)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.18, linewidth=0)
        if not drawn:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.set_title(key)
        ax.set_xlabel("update" if exp.x == "update" else "elapsed wall time (s)")
        ax.grid(alpha=0.3)
    if exp.target and exp.target.metric in exp.metrics:
        axes.flat[exp.metrics.index(exp.target.metric)].axhline(exp.target.value, color="k", ls=":", lw=1)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{exp.name}: trailing mean over {window} update(s); band = min-max over seeds", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _curve(runs: list[list[dict]], key: str, window: int, x: str):
    """x values (updates, or each run's wall times pooled) and mean/min/max over runs at each."""
    if x == "update":
        grid = sorted({r["update"] for rows in runs for r in rows if key in r})
    else:
        grid = sorted({r[x] for rows in runs for r in rows if key in r and x in r})
    xs, mean, lo, hi = [], [], [], []
    for g in grid:
        vals = [v for rows in runs if (v := trailing_mean(rows, key, g, window, x)) is not None]
        if len(vals) == len(runs):  # every seed has a value here: the band is over all of them
            xs.append(g), mean.append(sum(vals) / len(vals)), lo.append(min(vals)), hi.append(max(vals))
    return xs, mean, lo, hi


def write_report(exp: Experiment, results_dir: Path, updates: int) -> tuple[Path, Path]:
    results = load_results(exp, results_dir)
    if not results:
        raise FileNotFoundError(f"no results in {results_dir} (ARM-seedK.jsonl)")
    table_path = results_dir / "table.md"
    table_path.write_text(table(exp, results, updates) + "\n")
    return table_path, figure(exp, results, updates, results_dir / "figure.png")
