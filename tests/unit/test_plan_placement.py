"""Placement (plan/placement.py) and `megatron-rl plan`: rank maps over many layouts agree with
RankLayout, every rejection cause is named, and the shipped launch scripts take their task count
from plan."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli
from megatron_rl.config import length_stages, load_config
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.node import NodeEnvError, NodeInfo, assign_gpus, check_gpus_exist
from megatron_rl.plan.placement import PlacementError, check_run, default_hosts, notes, place
from megatron_rl.plan.estimate import Cluster, Shapes, estimate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SHAPES = Shapes(vocab=32000, hidden=1024, layers=16, heads=16, kv_heads=8, head_dim=64, ffn=4096, tied=False)


def _cfg(tp=1, pp=1, dp=1, gens=1, gtp=1, verifiers=0, **extra):
    over = [f"trainer.tensor_parallel={tp}", f"trainer.pipeline_parallel={pp}", f"trainer.data_parallel={dp}",
            f"generator.num_generators={gens}", f"generator.tp_size={gtp}", f"reward.verifier_ranks={verifiers}",
            "trainer.micro_batch_tokens=8192", "rollout.max_new_tokens=4096", "reward.l_max=null"]
    return load_config(None, over + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()])


def _causes(cfg, gpu_gb=80.0, prompt=1024):
    cluster = Cluster(gpu_memory_gb=gpu_gb, generator_tp=cfg.generator.tp_size, prompt_tokens=prompt)
    try:
        memory = estimate(cfg, cluster, SHAPES)
    except ValueError:  # layers not divisible by PP: check_run names it (as the plan command does)
        memory = None
    return check_run(cfg, SHAPES, memory, gpu_memory_gb=gpu_gb, max_prompt_tokens=prompt)


LAYOUTS = [  # tp, pp, dp, generators, generator tp, verifiers, nodes, gpus per node
    (1, 1, 1, 1, 1, 0, 1, 8), (1, 1, 1, 1, 1, 2, 1, 2), (2, 1, 2, 4, 1, 0, 1, 8), (8, 1, 4, 16, 2, 4, 8, 8),
    (8, 8, 4, 16, 8, 16, 48, 8), (2, 2, 1, 3, 2, 1, 3, 4), (1, 1, 3, 2, 4, 0, 3, 4), (4, 1, 1, 5, 2, 0, 2, 8),
    (1, 1, 1, 1, 4, 0, 2, 4), (1, 1, 6, 2, 1, 0, 1, 8),
]


@pytest.mark.parametrize("tp,pp,dp,gens,gtp,ver,nodes,gpn", LAYOUTS)
def test_rank_map_follows_rank_layout_and_the_rules(tp, pp, dp, gens, gtp, ver, nodes, gpn):
    cfg = _cfg(tp, pp, dp, gens, gtp, ver)
    p = place(cfg, default_hosts(nodes), gpn)
    layout = RankLayout.from_config(cfg)
    assert p.world_size == layout.world_size
    assert [r.role for r in p.ranks] == [layout.role(i) for i in range(layout.world_size)]
    assert [r.rank for r in p.of_role("trainer")] == layout.trainer_ranks
    for r in p.ranks:
        assert r.host == f"node{r.node}"
        assert len(r.gpus) == {"controller": 0, "verifier": 0, "trainer": 1, "generator": gtp}[r.role]
        assert all(0 <= g < gpn for g in r.gpus)
        if r.role in ("controller", "verifier"):
            assert r.node == 0
    taken = [(r.node, g) for r in p.ranks for g in r.gpus]
    assert len(taken) == len(set(taken)), "a GPU is given to two ranks"
    for node in range(nodes):  # local ranks count the node's ranks in rank order, from 0
        assert [r.local_rank for r in p.ranks if r.node == node] == list(range(sum(r.node == node for r in p.ranks)))
    # trainers first, from node 0 GPU 0; generators after every trainer GPU
    assert [(r.node, r.gpus[0]) for r in p.of_role("trainer")] == [divmod(i, gpn) for i in range(tp * pp * dp)]
    last_trainer = max([(r.node, r.gpus[0]) for r in p.of_role("trainer")])
    assert all((r.node, r.gpus[0]) > last_trainer for r in p.of_role("generator"))
    assert p.hostfile().splitlines() == [r.host for r in p.ranks]


def test_generator_never_spans_nodes_and_skips_to_the_next():
    p = place(_cfg(dp=3, gens=2, gtp=2), default_hosts(3), 4)  # 3 trainer GPUs leave 1 on node 0
    assert [(r.node, r.gpus) for r in p.of_role("generator")] == [(1, (0, 1)), (1, (2, 3))]
    assert notes(p) == ["the ranks use 2 of the 3 nodes given", "5 GPU(s) stay idle"]


def test_real_hosts_are_the_addresses():
    p = place(_cfg(dp=2, gens=2), ["gpu-a01", "gpu-a02"], 2)
    assert [(r.role, r.host, r.gpus) for r in p.ranks] == [
        ("controller", "gpu-a01", ()), ("trainer", "gpu-a01", (0,)), ("trainer", "gpu-a01", (1,)),
        ("generator", "gpu-a02", (0,)), ("generator", "gpu-a02", (1,))]


@pytest.mark.parametrize("cfg,hosts,gpn,match", [
    (_cfg(dp=8, gens=1), default_hosts(1), 8, r"need 2 nodes of 8 GPUs, but 1 were given"),
    (_cfg(dp=3, gens=3, gtp=2), default_hosts(2), 4, r"need 3 nodes of 4 GPUs"),  # 1 GPU of node 0 unusable
    (_cfg(gens=1, gtp=8), default_hosts(4), 4, r"generator.tp_size=8 is more than the 4 GPUs of a node"),
    (_cfg(gtp=0), default_hosts(1), 8, r"generator.tp_size must be >= 1"),
    (_cfg(), [], 8, r"no nodes"),
    (_cfg(), ["a", "a"], 8, r"hosts repeat"),
    (_cfg(), default_hosts(1), 0, r"gpus per node must be >= 1"),
])
def test_placement_rejections_name_the_cause(cfg, hosts, gpn, match):
    with pytest.raises(PlacementError, match=match):
        place(cfg, hosts, gpn)


def test_a_valid_run_has_no_causes():
    assert _causes(_cfg(tp=2, pp=2, dp=2, gens=2, gtp=2)) == []


@pytest.mark.parametrize("cfg,kw,match", [
    (_cfg(tp=3), {}, r"trainer.tensor_parallel=3 does not divide the model's 16 attention heads"),
    (_cfg(tp=16), {}, r"trainer.tensor_parallel=16 does not divide the model's 8 KV heads"),
    (_cfg(pp=3), {}, r"trainer.pipeline_parallel=3 x virtual_pipeline=1 does not divide the model's 16 layers"),
    (_cfg(pp=2, trainer__virtual_pipeline=3), {}, r"virtual_pipeline=3 does not divide"),
    (_cfg(gtp=3), {}, r"generator.tp_size=3 does not divide the model's 16 attention heads"),
    (_cfg(trainer__micro_batch_tokens=4096), {}, r"micro_batch_tokens=4096 is smaller than the longest sequence "
                                                r"the run can produce: 1024 prompt .* 4096 generated .* = 5120"),
    (_cfg(), {"prompt": 4097}, r"4097 prompt tokens \(--max-prompt-tokens\)"),
    (_cfg(rollout__length_schedule='["0:2048", "10:8000"]'), {}, r"8000 generated"),
    (_cfg(), {"gpu_gb": 5}, r"a trainer GPU needs .* GB, more than the 5 GB"),
    (_cfg(generator__max_total_tokens=4_000_000), {}, r"a generator GPU needs .* more than the 80 GB"),
])
def test_run_rejections_name_the_cause(cfg, kw, match):
    causes = _causes(cfg, **kw)
    assert any(re.search(match, c) for c in causes), causes


def test_generator_tp_may_replicate_kv_heads_but_not_split_them_unevenly():
    assert _causes(_cfg(gtp=16)) == []  # 16 query heads, 8 KV heads replicated twice
    shapes = Shapes(32000, 1024, 16, 12, 6, 64, 4096, False)
    cfg = _cfg(gtp=4)
    causes = check_run(cfg, shapes, None, gpu_memory_gb=80, max_prompt_tokens=16)
    assert causes == ["generator.tp_size=4 neither divides nor is a multiple of the model's 6 KV heads"]


def test_moe_layouts_the_trainer_refuses_are_refused_before_launch():
    moe = Shapes(32000, 1024, 16, 16, 8, 64, 512, False, experts=8, topk=2)
    ok = _cfg(tp=2, dp=2, trainer__expert_parallel=2, trainer__sequence_parallel="true")
    assert check_run(ok, moe, None, gpu_memory_gb=80, max_prompt_tokens=16) == []
    tp_without_sp = _cfg(tp=2, dp=2, trainer__expert_parallel=2)
    assert any("trainer.sequence_parallel" in c
               for c in check_run(tp_without_sp, moe, None, gpu_memory_gb=80, max_prompt_tokens=16))
    # once refused, now trained (tests/multiproc/test_train_moe_model_parallel.py): TP > 1 at EP = 1, aux loss + CP;
    # full recompute with EP > 1 and the aux loss (tests/multiproc/test_train_moe_recompute.py)
    aux_ep_full = _cfg(dp=2, trainer__expert_parallel=2, trainer__moe_aux_loss_coef=0.01, trainer__recompute="full")
    assert check_run(aux_ep_full, moe, None, gpu_memory_gb=80, max_prompt_tokens=16) == []
    tp_without_ep = _cfg(tp=2, dp=2, trainer__sequence_parallel="true")
    assert check_run(tp_without_ep, moe, None, gpu_memory_gb=80, max_prompt_tokens=16) == []
    aux_with_cp = _cfg(dp=1, trainer__context_parallel=2, trainer__moe_aux_loss_coef=0.01)
    assert check_run(aux_with_cp, moe, None, gpu_memory_gb=80, max_prompt_tokens=16) == []


# ---- the command and the shipped examples --------------------------------------------------------

def _sbatch_nodes(script: Path) -> tuple[int, int]:
    text = script.read_text()
    return (int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1)),
            int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1)))


def test_plan_accepts_the_cpu_demo_on_one_node(capsys):
    rc = cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "1", "--gpus-per-node", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "controller x1" in out and "trainer x1" in out and "generator x1" in out and "tasks: 3" in out
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "1", "--print-tasks"]) == 0
    assert capsys.readouterr().out == "3\n"
    # mpiexec_cpu_demo.sh takes NP from plan too
    assert "plan examples/cpu_demo.yaml" in (EXAMPLES / "mpiexec_cpu_demo.sh").read_text()


@pytest.mark.parametrize("name,ranks", [("magistral_small", 53), ("magistral_medium", 289)])
def test_sbatch_scripts_take_their_task_count_from_plan(name, ranks, capsys):
    script = EXAMPLES / f"srun_{name}.sbatch"
    text = script.read_text()
    nodes, gpn = _sbatch_nodes(script)
    assert f"CONFIG=examples/{name}.yaml" in text
    assert "#SBATCH --ntasks-per-node" not in text and not re.search(r"#SBATCH --ntasks=", text)
    assert re.search(r'PLAN=\(megatron-rl plan "\$CONFIG"', text) and f"--gpus-per-node {gpn}" in text
    assert 'NTASKS=$("${PLAN[@]}" --print-tasks)' in text and '--ntasks="$NTASKS" --distribution=arbitrary' in text
    assert '--print-hostfile > "$SLURM_HOSTFILE"' in text
    # The layout itself fits the script's allocation, and its rank count is the config's.
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    p = place(cfg, default_hosts(nodes), gpn)
    assert p.world_size == RankLayout.from_config(cfg).world_size == ranks
    assert p.nodes_used == nodes and notes(p) == []
    # The shipped recipes grow generation to 32k / 40k tokens; their bins hold the longest sequence
    # and SP + recompute keep a trainer GPU under 80 GB: plan accepts them and prints the count the
    # script hands srun.
    rc = cli(["plan", str(EXAMPLES / f"{name}.yaml"), "--nodes", str(nodes), "--gpus-per-node", str(gpn),
              "--print-tasks"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out == f"{ranks}\n"
    # the bin must hold prompt + the longest generation: one token less and plan refuses
    longest = 1024 + max(s.max_new_tokens for s in length_stages(cfg.rollout.length_schedule,
                                                                   cfg.rollout.max_new_tokens, cfg.reward))
    assert cfg.trainer.micro_batch_tokens == longest
    rc = cli(["plan", str(EXAMPLES / f"{name}.yaml"), f"trainer.micro_batch_tokens={longest - 8}", "--nodes",
              str(nodes), "--gpus-per-node", str(gpn), "--print-tasks"])
    captured = capsys.readouterr()
    assert rc == 3 and captured.out == "" and f"trainer.micro_batch_tokens={longest - 8} is smaller" in captured.err


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.mark.parametrize("name", ["magistral_small", "magistral_medium"])
def test_sbatch_scripts_name_srun_s_pmi_plugin_and_strict_kernels(name, tmp_path):
    """srun gets --mpi= from plan (Slurm's default, none, starts every task as an MPI job of 1) unless
    SRUN_MPI is set, and the ranks MEGATRON_RL_OPS_BACKEND=strict unless the job set another; plan,
    scontrol and srun are stand-ins recording what the script hands them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "scontrol", 'printf "n%s\\n" 0 1')
    _stub(bin_dir / "megatron-rl", 'case " $* " in *" --print-tasks "*) echo 53;; *" --print-hostfile "*) echo n0;;\n'
                                    '  *" --print-srun-mpi "*) echo pmi2;; esac')
    _stub(bin_dir / "srun", 'printf "%s\\n" "$@" > "$OUT/srun.args"; echo "$MEGATRON_RL_OPS_BACKEND" > "$OUT/backend"')
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MODEL": "m", "SLURM_JOB_NODELIST": "n[0-1]",
            "SLURM_JOB_NUM_NODES": "8", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "OUT": str(tmp_path)}
    script = EXAMPLES / f"srun_{name}.sbatch"
    for extra, mpi, backend in (({}, "pmi2", "strict"),
                                ({"SRUN_MPI": "pmix", "MEGATRON_RL_OPS_BACKEND": "auto"}, "pmix", "auto")):
        done = subprocess.run(["bash", str(script)], cwd=EXAMPLES.parent, env={**base, **extra},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        args = (tmp_path / "srun.args").read_text().split("\n")
        assert args[:3] == [f"--mpi={mpi}", "--ntasks=53", "--distribution=arbitrary"], args
        assert (tmp_path / "backend").read_text().strip() == backend


@pytest.mark.parametrize("library,plugin", [
    ("MPICH Version: 5.0.2", "pmi2"), ("Open MPI v5.0.3, package: Open MPI", "pmix"),
    ("MPI VERSION : CRAY MPICH version 8.1.29", "cray_shasta"), ("Intel(R) MPI Library 2021.13", "pmi2"),
    ("MVAPICH2 Version 2.3.7", "pmi2"), ("Some MPI 1.0", "pmi2"), (None, "pmi2")])
def test_srun_pmi_plugin_follows_the_mpi_library(library, plugin):
    from megatron_rl.plan.srun import pmi_plugin

    assert pmi_plugin(library)[0] == plugin


def test_plan_and_doctor_name_the_pmi_plugin_this_environment_needs(monkeypatch, capsys):
    from megatron_rl.plan import srun

    assert srun.mpi_library().startswith("MPICH Version: 5.0.2")  # the cpu extra's mpich wheel, not initialised
    monkeypatch.setattr(srun, "mpi_library", lambda: "Open MPI v5.0.3")
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "1", "--print-srun-mpi"]) == 0
    assert capsys.readouterr().out == "pmix\n"
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "1", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "tasks: 3 (srun --mpi=pmix --ntasks=3" in out
    assert "mpi: Open MPI v5.0.3; srun --mpi=pmix: Open MPI 5 starts its processes through PMIx only" in out


def test_plan_bad_input_is_one_line_naming_the_cause(tmp_path, capsys):
    assert cli(["plan", str(tmp_path / "missing.yaml"), "--nodes", "1"]) == 1
    assert "missing.yaml" in capsys.readouterr().err
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "2", "--hosts", "a"]) == 1
    assert "--hosts names 1 nodes but --nodes is 2" in capsys.readouterr().err
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "trainer.nope=1", "--nodes", "1"]) == 1
    assert "trainer.nope" in capsys.readouterr().err
    # too few nodes: exit 3, the cause on stderr
    assert cli(["plan", str(EXAMPLES / "cpu_demo.yaml"), "--nodes", "1", "--gpus-per-node", "1"]) == 3
    assert "need 2 nodes of 1 GPUs, but 1 were given" in capsys.readouterr().err


@pytest.mark.parametrize("tp,pp,dp,gens,gtp,ver,nodes,gpn", LAYOUTS)
def test_ranks_take_at_run_time_the_gpus_the_plan_printed(tp, pp, dp, gens, gtp, ver, nodes, gpn):
    """node.assign_gpus (what each rank computes from its node address and local rank when launched
    with the plan's hostfile) gives every rank the GPUs of the plan's rank map."""
    cfg = _cfg(tp, pp, dp, gens, gtp, ver)
    p = place(cfg, [f"10.0.0.{i + 1}" for i in range(nodes)], gpn)
    nodes_seen = [NodeInfo(r.host, r.local_rank) for r in p.ranks]
    assert assign_gpus([r.role for r in p.ranks], nodes_seen, gtp) == [r.gpus for r in p.ranks]


def test_the_first_trainer_takes_gpu_0_although_the_controller_is_local_rank_0():
    roles = ["controller", "trainer", "trainer", "generator", "verifier"]
    nodes_seen = [NodeInfo("127.0.0.1", i) for i in range(5)]
    assert assign_gpus(roles, nodes_seen, 2) == [(), (0,), (1,), (2, 3), ()]


def test_a_rank_given_a_gpu_its_node_lacks_is_named():
    with pytest.raises(NodeEnvError, match=r"rank 9 \(generator\) needs GPU 8 but its node shows 8"):
        check_gpus_exist((7, 8), 8, 9, "generator")
    check_gpus_exist((6, 7), 8, 9, "generator")


def test_sglang_gets_its_first_gpu_as_base_gpu_id(monkeypatch):
    import megatron_rl.rollout.server as server

    monkeypatch.setattr(server, "has_cuda", lambda: True)
    cmd = server.ServerSpec("m", 30000, tp_size=2, gpu_ids=(4, 5)).command()
    assert cmd[cmd.index("--base-gpu-id") + 1] == "4" and cmd[cmd.index("--tp-size") + 1] == "2"
    assert "--base-gpu-id" not in server.ServerSpec("m", 30000).command()
    with pytest.raises(ValueError, match="consecutive"):
        server.ServerSpec("m", 30000, tp_size=2, gpu_ids=(4, 6))
