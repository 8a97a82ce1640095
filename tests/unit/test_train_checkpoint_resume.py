"""Resume is bit-exact: 2 updates, save, 2 more == load into a fresh trainer, the same 2 more."""
from __future__ import annotations

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
