"""Resume is bit-exact: 2 updates, save, 2 more == load into a fresh trainer, the same 2 more (also
from a checkpoint in the previous format, 1)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.records import Batch

from test_train_step import hf_model, make_config, make_minibatch  # noqa: E402  (tests/unit on sys.path)


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}


def test_resume_is_bit_exact_and_restores_state(tiny_llama_dir, tmp_path):
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    batches = [Batch(make_minibatch(hf, n=4, seed=s), n_mini=2, policy_version=s) for s in range(4)]
    cfg = make_config(tiny_llama_dir, micro_batch_tokens=32, lr=1e-2, grad_clip=1.0)

    a = Trainer(cfg)
    for b in batches[:2]:
        a.train_on(b)
    saved = _params(a)
    path = a.save(tmp_path / "ckpt", extra={"data_position": 17})
    torch.manual_seed(999)  # disturb the RNG: load must restore it
    for b in batches[2:]:
        a.train_on(b)
    final_a = _params(a)

    b_tr = Trainer(cfg)
    assert not all(torch.equal(v, _params(b_tr)[k]) for k, v in saved.items())
    extra = b_tr.load(tmp_path / "ckpt")
    assert extra == {"data_position": 17} and b_tr.last_load.path == path
    assert b_tr.version == 2 and b_tr.step == 4 and b_tr.last_load.optimizer_loaded
    assert all(torch.equal(v, _params(b_tr)[k]) for k, v in saved.items())
    for b in batches[2:]:
        b_tr.train_on(b)
    final_b = _params(b_tr)
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k  # bit-exact, Adam moments and step included
    assert b_tr.version == a.version == 4


def test_load_restores_rng_streams(tiny_llama_dir, tmp_path):
    from megatron_rl.train.trainer import Trainer

    tr = Trainer(make_config(tiny_llama_dir))
    torch.manual_seed(5)
    tr.save(tmp_path / "c")
    expected = torch.rand(4)
    torch.manual_seed(6)
    tr.load(tmp_path / "c")
    assert torch.equal(torch.rand(4), expected) and tr.last_load.rng_restored


def test_format_1_checkpoint_still_loads_and_resumes(tiny_llama_dir, tmp_path):
    """A checkpoint in format 1's layout (Megatron's default keys: layers stacked, SwiGLU gate/up in
    one key; dp_reshardable Adam; no model dims) loads with its optimizer and resumes bit-exactly."""
    import json

    from megatron.core import dist_checkpointing

    from megatron_rl.train import checkpoint as ckpt
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    batches = [Batch(make_minibatch(hf, n=4, seed=s), n_mini=2, policy_version=s) for s in range(2)]
    cfg = make_config(tiny_llama_dir, micro_batch_tokens=32, lr=1e-2)
    a = Trainer(cfg)
    a.train_on(batches[0])
    state = ckpt._sharded_state(a.model, a.optimizer, a.layout, is_loading=False, with_optimizer=True,
                                with_rng=True, version=1, optimizer_format="dp_reshardable")
    state.update(step=1, extra_json=json.dumps({"_trainer": {"version": 1, "step": 2}, "user": {"k": 1}}),
                 layout={"tp": 1, "pp": 1, "dp": 1, "vpp": None}, has_optimizer=True, format_version=1)
    out = tmp_path / "v1" / ckpt.iter_dirname(1)
    out.mkdir(parents=True)
    dist_checkpointing.save(state, str(out))
    keys = set(dist_checkpointing.load_tensors_metadata(str(out)))
    assert "decoder.layers.mlp.linear_fc1.weight" in keys  # really the old layout
    saved = _params(a)
    a.train_on(batches[1])

    b = Trainer(cfg)
    assert b.load(tmp_path / "v1") == {"k": 1} and b.last_load.optimizer_loaded and b.step == 2
    assert all(torch.equal(v, _params(b)[k]) for k, v in saved.items())
    b.train_on(batches[1])
    assert all(torch.equal(v, _params(b)[k]) for k, v in _params(a).items())
    b.save(tmp_path / "v2")  # saves go to the current format
    assert "decoder.layers.0.mlp.linear_fc1.weight_w" in dist_checkpointing.load_tensors_metadata(
        str(tmp_path / "v2" / ckpt.iter_dirname(2)))
    assert ckpt.read_common(tmp_path / "v2")["format_version"] == ckpt.FORMAT_VERSION == 2


def test_format_1_refuses_a_tp_whose_padding_differs(tmp_path):
    from megatron_rl.train.checkpoint import CheckpointError, _check_v1_padding

    odd = {"vocab_size": 301, "num_kv_heads": 3, "ffn_size": 97}
    even = {"vocab_size": 302, "num_kv_heads": 2, "ffn_size": 96}
    _check_v1_padding(tmp_path, even, 2, 1)
    _check_v1_padding(tmp_path, odd, 2, 2)
    with pytest.raises(CheckpointError, match="load it at tp=2"):
        _check_v1_padding(tmp_path, odd, 2, 1)


@pytest.mark.parametrize("keep", [2, 0, None])
def test_run_keep_checkpoints_prunes_and_megatron_keys_are_stored(tiny_llama_dir, tmp_path, keep):
    """run.keep_checkpoints reaches the trainer's saves (0 or null: keep all), and the common state
    carries Megatron-LM's `iteration` and `checkpoint_version` beside our own keys."""
    from megatron.core import dist_checkpointing

    from megatron_rl.config import config_from_dict
    from megatron_rl.train.trainer import Trainer

    trainer_keys = {"model": str(tiny_llama_dir), "precision": "fp32", "micro_batch_tokens": 24}
    tr = Trainer(config_from_dict({"trainer": trainer_keys, "run": {"keep_checkpoints": keep}}))
    for version in (1, 2, 3):
        tr.version = version
        tr.save(tmp_path / "c")
    kept = sorted(p.name for p in (tmp_path / "c").iterdir() if p.name.startswith("iter_"))
    assert kept == (["iter_0000002", "iter_0000003"] if keep else ["iter_0000001", "iter_0000002", "iter_0000003"])
    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "c" / "iter_0000003"))
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "3"
