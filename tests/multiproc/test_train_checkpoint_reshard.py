"""Trainer checkpoints of a TP-padded model reshard weights AND Adam state across TP/PP/VPP/DP.

The model (tests/support/train_models.make_tiny_hf defaults: 3 KV groups, vocab 301, MLP width 97) is
padded at TP=2 (4 groups, 302 rows, 98) and not at TP=1, so the stored global shapes differ.

One torchrun launch (2 gloo ranks, this file's `__main__` part) trains 2 RL steps at TP=2 and saves A
(fully_reshardable) and A_dp (dp_reshardable); then loads A at TP=1 x DP=2 (saving B there: a TP=1
checkpoint, padding removed), at PP=2, at PP=2 x VPP=2 and at TP=2 again, and B at TP=2 (padding
added). The pytest process loads A and A_dp at TP=1 (single process). For each load:
(a) the HF-named weights equal the saved ones exactly (`hf_weights.export_hf_tensors`);
(b) the Adam state (fp32 main params, exp_avg, exp_avg_sq, step) mapped to HF names equals the saved
    state exactly, and every TP-padded slot of weights and state is exactly zero;
(c) one more RL step gives the weights one more step at TP=2 gave (the independent reference that
    the optimizer state really moved: a restarted Adam (A_dp at TP=1) is checked to miss it).
(e) a checkpoint of another model is refused with an error naming the differing field.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
# phase -> (tp, pp, dp, vpp, checkpoint it loads); "tp2" trains, saves A and A_dp (2-rank worker)
PHASES = {"tp1dp2": (1, 1, 2, None, "A"), "pp2": (1, 2, 1, None, "A"), "pp2vpp2": (1, 2, 1, 2, "A"),
          "tp2again": (2, 1, 1, None, "A"), "tp2_from_tp1": (2, 1, 1, None, "B")}
LR, BETAS, STEP = 1e-2, (0.9, 0.95), 3  # _config's lr, the trainer's Adam betas; the step after A

pytestmark = pytest.mark.long  # minutes of multi-process runs: the long tier (README "Tests")


def _config(model_dir: str, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": 24, "lr": LR,
                    "grad_clip": 1.0, "weight_decay": 0.01, "tensor_parallel": tp, "pipeline_parallel": pp,
                    "data_parallel": dp, "virtual_pipeline": vpp},
        "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def _trainer(model_dir: str, tp=1, pp=1, dp=1, vpp=None, load_weights=False):
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.trainer import Trainer

    return Trainer(_config(model_dir, tp, pp, dp, vpp), hf_config=resolve_model(model_dir).config(),
                   load_weights=load_weights)


def _batches(path: Path):
    from megatron_rl.records import Batch, TrainSequence

    data = json.loads(path.read_text())
    seqs = [[TrainSequence(**d) for d in b] for b in data]
    # 2 optimizer steps before the save, then the "one more step"
    return Batch(seqs[0], n_mini=2, policy_version=0), Batch(seqs[1], n_mini=1, policy_version=1)


# ---------------------------------------------------------------- HF-named snapshots of this rank

def _padding_is_zero(kind: str, layer, full: torch.Tensor, dims) -> bool:
    """Re-pad the unpadded HF pieces of `full` with zeros: equal to `full` iff its padding is zero."""
    from megatron_rl.train.hf_weights import _full_megatron, _to_hf

    pieces = dict(_to_hf(kind, layer, full, dims))
    return torch.equal(_full_megatron(kind, layer, pieces.__getitem__, dims), full)


def snapshot(trainer, with_adam: bool = True) -> dict:
    """weights (export_hf_tensors), Adam state mapped to HF names (`exp_avg/model.norm.weight`...),
    step counts, and the names whose TP padding is not exactly zero. Collective over TP.

    Adam state is read per parameter from the DistributedOptimizer; at DP=1 a rank owns whole
    parameters (`with_adam=False` at DP>1)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.train.hf_weights import _classify, _gather, _to_hf, export_hf_tensors
    from megatron_rl.train.model import layer_offset

    chunks = trainer.model_chunks
    snap = {"weights": {n: t.clone() for n, t in export_hf_tensors(chunks)}, "adam": {}, "steps": set(),
            "nonzero_padding": []}
    if not with_adam:
        return snap
    tp = ps.get_tensor_model_parallel_world_size()
    opts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    for chunk in chunks:
        dims = chunk.mrl_dims
        for name, p in chunk.named_parameters():
            kind, dim, layer = _classify(name, layer_offset(chunk))
            if kind == "output" and dims.tie_embeddings:
                continue
            opt = next(o for o in opts if p in o.model_param_group_index_map)
            state = opt._get_main_param_and_optimizer_states(p)
            snap["steps"].add(float(state["step"]))
            for key, local in [("weight", p.detach())] + [(k, state[k].detach().view(p.shape)) for k in STATE_KEYS]:
                full = _gather(kind, dim, local, tp)
                if not _padding_is_zero(kind, layer, full, dims):
                    snap["nonzero_padding"].append(f"{key}/{name}")
                if key != "weight":
                    snap["adam"].update({f"{key}/{n}": t.clone() for n, t in _to_hf(kind, layer, full, dims)})
    return snap


def _dump(trainer, out: Path, with_adam: bool = True, **info) -> None:
    import torch.distributed as dist

    snap = snapshot(trainer, with_adam)
    snap.update(info)
    torch.save(snap, f"{out}.rank{dist.get_rank() if dist.is_initialized() else 0}.pt")


def _merged(root: Path, phase: str) -> dict:
    """Merge the per-rank snapshots of a phase (PP ranks hold different layers)."""
    out: dict = {}
    for f in sorted(root.glob(f"{phase}.rank*.pt")):
        snap = torch.load(f, weights_only=False)
        for key in ("weights", "adam"):
            out.setdefault(key, {}).update(snap[key])
        out.setdefault("steps", set()).update(snap["steps"])
        out.setdefault("nonzero_padding", []).extend(snap["nonzero_padding"])
        out.update({k: v for k, v in snap.items() if k not in ("weights", "adam", "steps", "nonzero_padding")})
    return out


# ---------------------------------------------------------------- worker (2 ranks)

def worker(root: Path) -> None:
    from megatron_rl.train.parallel import destroy_parallel

    torch.set_num_threads(1)
    model_dir = json.loads((root / "spec.json").read_text())["model_dir"]
    train, more = _batches(root / "batches.json")

    tr = _trainer(model_dir, tp=2, load_weights=True)
    tr.train_on(train)
    tr.save(root / "A")
    tr.config.trainer.checkpoint_optimizer = "dp_reshardable"
    tr.save(root / "A_dp")
    _dump(tr, root / "saved")
    tr.train_on(more)
    _dump(tr, root / "saved_next")
    destroy_parallel()

    for phase, (tp, pp, dp, vpp, source) in PHASES.items():
        tr = _trainer(model_dir, tp, pp, dp, vpp)
        tr.load(root / source)
        load = {"optimizer_loaded": tr.last_load.optimizer_loaded, "rng_restored": tr.last_load.rng_restored,
                "step": tr.step, "version": tr.version}
        _dump(tr, root / phase, with_adam=dp == 1, load=load)
        if phase == "tp1dp2":
            tr.save(root / "B")  # a TP=1 checkpoint of the loaded state: the source of the reverse direction
        tr.train_on(more)
        _dump(tr, root / f"{phase}_next", with_adam=False)
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from support.torchrun import run_two_ranks
    from support.train_models import make_tiny_hf
    from unit.test_train_step import hf_model, make_minibatch

    root = tmp_path_factory.mktemp("ckpt_reshard")
    model_dir = make_tiny_hf(root / "model", layers=4)  # 4 layers: PP=2 x VPP=2
    hf = hf_model(model_dir)
    batches = [make_minibatch(hf, n=4, seed=s) for s in (0, 1)]
    (root / "batches.json").write_text(json.dumps([[dataclasses.asdict(s) for s in b] for b in batches]))
    (root / "spec.json").write_text(json.dumps({"model_dir": str(model_dir)}))
    run_two_ranks(__file__, root)
    torch.set_num_threads(1)
    _capture_step_grads(root, str(model_dir))
    return root, str(model_dir)


def _assert_equal_maps(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{what}: {name} differs"


def _step_tolerance(root: Path, saved: dict) -> dict[str, torch.Tensor]:
    """Per element: how far one Adam step at another layout may land from the reference step
    (support/adam_steps.step_tolerance), from this step's gradient and the saved Adam state."""
    from support.adam_steps import step_tolerance

    captured = torch.load(root / "grads.pt", weights_only=False)
    v = {k.split("/", 1)[1]: t for k, t in saved["adam"].items() if k.startswith("exp_avg_sq/")}
    return step_tolerance(captured["grads"], captured["grad_norm"], saved["weights"], lr=LR, betas=BETAS,
                          step=STEP, grad_clip=1.0, n_terms=2 * 64, exp_avg_sq=v)  # <= 64 tokens x 2 ranks


def _capture_step_grads(root: Path, model_dir: str) -> None:
    """The step after A's gradient (before clipping) and grad norm, at TP=1 in this process."""
    from support.adam_steps import step_gradients

    from megatron_rl.train.parallel import destroy_parallel

    _, more = _batches(root / "batches.json")
    tr = _trainer(model_dir)
    tr.load(root / "A", load_optimizer=False)  # the gradient does not depend on Adam's state
    grads, grad_norm = step_gradients(tr, more)
    torch.save({"grads": grads, "grad_norm": grad_norm}, root / "grads.pt")
    destroy_parallel()


def _assert_close_maps(got: dict, want: dict, tol: dict, what: str) -> None:
    from support.adam_steps import misses

    assert set(got) == set(want), what
    assert not misses(got, want, tol), what


def test_saved_state_is_padded_with_zeros(run):
    root, _ = run
    saved = _merged(root, "saved")
    assert saved["steps"] == {2.0} and not saved["nonzero_padding"]
    assert {k.split("/")[0] for k in saved["adam"]} == set(STATE_KEYS)
    assert all(k.split("/", 1)[1] in saved["weights"] for k in saved["adam"])  # every weight has its state


@pytest.mark.parametrize("phase", list(PHASES))
def test_reshard_weights_and_adam_then_step(run, phase):
    root, _ = run
    saved, ref_next = _merged(root, "saved"), _merged(root, "saved_next")
    got, got_next = _merged(root, phase), _merged(root, f"{phase}_next")
    assert got["load"] == {"optimizer_loaded": True, "rng_restored": phase == "tp2again", "step": 2,
                           "version": 1}
    _assert_equal_maps(got["weights"], saved["weights"], f"{phase} weights")  # (a)
    if got["adam"]:  # (b): DP=1 phases
        _assert_equal_maps(got["adam"], saved["adam"], f"{phase} Adam state")
        assert got["steps"] == {2.0} and not got["nonzero_padding"], got["nonzero_padding"]
    else:
        assert phase == "tp1dp2"
    _assert_close_maps(got_next["weights"], ref_next["weights"], _step_tolerance(root, saved),
                       f"{phase} after one more step")  # (c)
    if phase == "tp2again":  # the saving layout itself resumes bit-exactly
        _assert_equal_maps(got_next["weights"], ref_next["weights"], "tp2again after one more step")


def test_tp1_single_process_and_restarted_adam_control(run):
    from support.adam_steps import misses

    root, model_dir = run
    saved, ref_next = _merged(root, "saved"), _merged(root, "saved_next")
    _, more = _batches(root / "batches.json")
    torch.set_num_threads(1)
    tr = _trainer(model_dir)
    tr.load(root / "A")
    assert tr.last_load.optimizer_loaded and not tr.last_load.rng_restored and tr.step == 2
    mine = snapshot(tr)
    _assert_equal_maps(mine["weights"], saved["weights"], "tp1 weights")
    _assert_equal_maps(mine["adam"], saved["adam"], "tp1 Adam state")
    assert mine["steps"] == {2.0} and not mine["nonzero_padding"]
    tr.train_on(more)
    tol = _step_tolerance(root, saved)
    _assert_close_maps(snapshot(tr, with_adam=False)["weights"], ref_next["weights"], tol, "tp1 after one more step")

    # dp_reshardable keeps its old behaviour: across a TP change the weights reshard, Adam restarts ...
    fresh = _trainer(model_dir)
    fresh.load(root / "A_dp")
    assert not fresh.last_load.optimizer_loaded and fresh.last_load.optimizer_format == "dp_reshardable"
    _assert_equal_maps(snapshot(fresh, with_adam=False)["weights"], saved["weights"], "A_dp weights")
    fresh.train_on(more)
    # ... and a restarted Adam misses the tolerance used above on most elements
    restarted = snapshot(fresh, with_adam=False)["weights"]
    numel = sum(t.numel() for t in ref_next["weights"].values())
    assert sum(misses(restarted, ref_next["weights"], tol).values()) > numel / 2


def test_checkpoint_of_another_model_is_refused(run, tmp_path):
    from support.train_models import make_tiny_hf

    from megatron_rl.train.checkpoint import CheckpointError

    root, _ = run
    other = make_tiny_hf(tmp_path / "other", layers=4, kv_heads=2)  # 6 heads in 2 KV groups instead of 3
    tr = _trainer(str(other))
    with pytest.raises(CheckpointError, match="num_kv_heads=3 in the checkpoint, 2 in the model"):
        tr.load(root / "A")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
