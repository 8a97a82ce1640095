"""benchmarks/vs_trl.py, its pure parts: our run's figures from metrics.jsonl lines (median s/update over
updates 3..N, launch to the end of update 1, held-out pass@1 of the last update, the per-role seconds),
TRL's from the worker's result, the table with its ratio row, seeds combined, and the PSS sum over a
process tree (this process and a child it starts). No run of either system, no timing asserts."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _line(update: int, time: float, wall: float, **extra) -> dict:
    row = {"update": update, "version": update, "time": time, "wall_s": wall, "generator_idle_frac": 0.25,
           "trainer_idle_frac": 0.5, "push/wall_s": 1.0, "updates_in_line": 1}
    return row | extra


def test_ours_figures_from_metrics_lines(bench):
    t0 = 1000.0
    rows = [_line(1, t0 + 50, 40.0), _line(2, t0 + 60, 10.0), _line(3, t0 + 80, 20.0), _line(4, t0 + 84, 4.0),
            _line(5, t0 + 92, 8.0, **{"eval/pass@1": 0.625, "eval/wall_s": 9.0})]
    fig = bench.ours_figures(rows, t0, t0 + 120, 5)
    assert fig.measured == (3, 5)
    assert fig.s_per_update == 8.0  # median of 20, 4, 8: updates 1 and 2 are left out
    assert fig.to_update1_s == 50.0 and fig.total_s == 120.0 and fig.pass_at_1 == 0.625
    # roles: means over updates 3..5 of wall 20, 4, 8 (mean 32/3)
    assert fig.roles["generation"] == pytest.approx(32 / 3 * 0.75)
    assert fig.roles["generator idle"] == pytest.approx(32 / 3 * 0.25)
    assert fig.roles["trainer idle"] == pytest.approx(32 / 3 * 0.5)
    assert fig.roles["push"] == pytest.approx(1.0)
    assert fig.roles["training"] == pytest.approx(32 / 3 * 0.5 - 1.0)
    assert any("grading" in n for n in fig.notes)


def test_ours_figures_skip_the_update0_evaluation_line_and_short_runs(bench):
    t0 = 0.0
    rows = [{"update": 0, "version": 0, "time": 5.0, "eval/pass@1": 0.1},  # an update-0 round has no wall_s
            _line(1, 30.0, 25.0), _line(2, 40.0, 10.0, **{"eval/pass@1": 0.5})]
    fig = bench.ours_figures(rows, t0, 60.0, 2)
    assert fig.measured == (2, 2) and fig.s_per_update == 10.0  # N < 3: the last update still counts
    assert fig.pass_at_1 == 0.5 and fig.to_update1_s == 30.0
    missing = bench.ours_figures(rows[:2], t0, 60.0, 2)
    assert missing.s_per_update is None and missing.pass_at_1 is None
    assert any("1 of updates 2..2" in n or "0 of updates 2..2" in n for n in missing.notes)
    no_gen = bench.ours_figures([_line(1, 30.0, 25.0, generator_idle_frac=None)], t0, 60.0, 1)
    assert "generation" not in no_gen.roles and "training" in no_gen.roles


def test_measured_updates(bench):
    assert bench.measured_updates(20) == (3, 20)
    assert bench.measured_updates(3) == (3, 3)
    assert bench.measured_updates(2) == (2, 2)
    assert bench.measured_updates(1) == (1, 1)


def test_trl_figures_from_the_worker_result(bench):
    t0 = 100.0
    result = {"t_train": 110.0, "step_end": [130.0, 140.0, 152.0, 160.0], "generate_s": [15.0, 6.0, 7.0, 5.0],
              "grade_s": [1.0, 1.0, 2.0, 1.0], "eval": {"pass@1": 0.25}}
    fig = bench.trl_figures(result, t0, 200.0, 1)
    assert fig.measured == (3, 4)
    assert fig.s_per_update == 10.0  # updates 3 and 4 took 12 and 8 s
    assert fig.to_update1_s == 30.0 and fig.total_s == 100.0 and fig.pass_at_1 == 0.25
    assert fig.roles == pytest.approx({"generation": 6.0, "grading": 1.5, "training": 2.5})
    # two optimizer steps per update: an update ends with its second step
    two = bench.trl_figures(dict(result, generate_s=[15.0, 6.0], grade_s=[1.0, 1.0]), t0, 200.0, 2)
    assert two.measured == (2, 2) and two.s_per_update == 20.0 and two.to_update1_s == 40.0


def test_table_and_ratio_row(bench):
    ours = bench.RunFigures("ours", s_per_update=10.0, measured=(3, 20), to_update1_s=60.0, total_s=300.0,
                            peak_pss_kib=4 * 2**20, pass_at_1=0.5, roles={"generation": 8.0, "push": 1.0})
    trl = bench.RunFigures("trl", s_per_update=20.0, measured=(3, 20), to_update1_s=30.0, total_s=600.0,
                           peak_pss_kib=2 * 2**20, pass_at_1=0.25, roles={"generation": 15.0, "grading": 1.0})
    text = bench.table(ours, trl)
    lines = text.splitlines()
    assert lines[0].startswith("| system | s/update (median, updates 3-20) |")
    assert lines[2] == "| ours | 10.0 | 60.0 | 300.0 | 4.00 | 0.500 |"
    assert lines[3] == "| trl | 20.0 | 30.0 | 600.0 | 2.00 | 0.250 |"
    assert lines[4] == "| ratio ours/TRL | 0.50x | 2.00x | 0.50x | 2.00x | 2.00x |"
    one = bench.table(ours, None).splitlines()
    assert len(one) == 3 and "ratio" not in one[-1]
    roles = bench.roles_table(ours, trl).splitlines()
    assert roles[0] == "| role (s/update) | ours | trl |"
    assert "| grading | n/a | 1.0 |" in roles and "| push | 1.0 | n/a |" in roles
    assert bench.ratio(1.0, 0.0) is None and bench.ratio(None, 2.0) is None
    assert "n/a" in bench.table(bench.RunFigures("empty"), trl)


def test_seeds_combine_to_medians_and_mean_pass(bench):
    figs = [bench.RunFigures("ours", s_per_update=s, total_s=s * 10, pass_at_1=p, peak_pss_kib=k, roles={"push": s})
            for s, p, k in ((10.0, 0.5, 3), (30.0, 0.25, 1), (20.0, 0.0, 2))]
    c = bench.combine(figs)
    assert c.s_per_update == 20.0 and c.total_s == 200.0 and c.peak_pss_kib == 2
    assert c.pass_at_1 == pytest.approx(0.25) and c.roles == {"push": 20.0} and "3 seeds" in c.system
    assert bench.combine(figs[:1]) is figs[0]


def test_pss_sum_over_this_process_tree(bench, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(32 << 20); time.sleep(60)"])
    try:
        import time

        for _ in range(100):  # the child has touched its 32 MiB
            if bench.pss_kib(child.pid) > 16 << 10:
                break
            time.sleep(0.1)
        tree = bench.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        mine, theirs = bench.pss_kib(os.getpid()), bench.pss_kib(child.pid)
        assert mine > 0 and theirs > 16 << 10
        assert bench.tree_pss_kib(os.getpid()) >= mine + theirs - 1024  # both counted (PSS moves a little)
        assert bench.pss_kib(2**22 + 12345) == 0  # no such process
        run_dir = tmp_path / "run"  # the child as a run's trainer rank: labelled by its pid file
        (run_dir / "ranks").mkdir(parents=True)
        (run_dir / "ranks" / "1.pid").write_text(f"{child.pid} trainer 127.0.0.1\n")
        with bench.PeakPss(os.getpid(), every=0.05, run_dir=run_dir) as peak:
            time.sleep(0.2)
        assert peak.samples >= 1 and peak.peak_kib >= theirs
        assert peak.at_peak["trainer rank"] >= 16 << 10 and sum(peak.at_peak.values()) == peak.peak_kib
        assert bench.memory_line(bench.RunFigures("ours", peak_by_process=peak.at_peak)).startswith(
            "ours at its memory peak (PSS, GiB): ")
    finally:
        child.kill()
        child.wait()


def test_figures_saved_by_a_run_give_the_same_table(bench, tmp_path):
    fig = bench.RunFigures("ours", s_per_update=10.0, measured=(3, 20), to_update1_s=60.0, total_s=300.0,
                           peak_pss_kib=123, pass_at_1=0.5, roles={"push": 1.0}, notes=["a note"])
    bench.save_figures(fig, tmp_path / "ours-seed0.figures.json")
    again = bench.load_figures(tmp_path / "ours-seed0.figures.json")
    assert again == fig and bench.table(again, None) == bench.table(fig, None)
