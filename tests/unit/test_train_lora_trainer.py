"""trainer.lora in the trainer the RL run builds: only the adapters train (the base stays bit-exact, the
optimizer holds the adapters alone), checkpoints save and restore them (a mismatch is refused), and
`convert` exports the merged HF model and an HF PEFT adapter folder that PeftModel loads."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.records import Batch
from support.lora_refs import lora_matmuls
from support.tolerances import network_error

from test_train_step import hf_model, make_config, make_minibatch  # noqa: E402  (tests/unit on sys.path)

LORA = {"rank": 4, "alpha": 8.0}


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in trainer.model_chunks for n, p in c.named_parameters()}


def _optimizer_numel(optimizer) -> int:
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(p.numel() for o in opts for g in o.param_groups for p in g["params"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_config_trains_only_the_adapters(tiny_llama_dir, precision):
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    trainer = Trainer(make_config(tiny_llama_dir, lora=LORA, lr=1e-2, precision=precision))
    chunk = trainer.model_chunks[0]
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in chunk.parameters()} == {want}  # the frozen base stays in the compute dtype
    adapters = {n for n, p in chunk.named_parameters() if p.requires_grad}
    # 2 layers x 4 targets x (A, B), and nothing else trainable
    assert len(adapters) == 16 and all(n.endswith((".lora_A", ".lora_B")) for n in adapters)
    assert _optimizer_numel(trainer.optimizer) == sum(p.numel() for n, p in chunk.named_parameters() if n in adapters)
    before = _params(trainer)
    assert all(not before[n].any() for n in adapters if n.endswith("lora_B"))  # B = 0: starts as the base
    trainer.train_on(Batch(make_minibatch(hf, n=4), n_mini=2, policy_version=0))
    after = _params(trainer)
    for name, value in after.items():
        if name in adapters:  # step 1 moves B (A's gradient is B^T g = 0), step 2 moves A too
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name


def test_checkpoint_restores_adapters_and_convert_exports_merged_and_peft(tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from megatron_rl.train.checkpoint_manifest import CheckpointError
    from megatron_rl.train.convert import megatron_to_hf
    from megatron_rl.train.lora_weights import export_adapter_tensors
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    batches = [Batch(make_minibatch(hf, n=4, seed=s), n_mini=2, policy_version=s) for s in range(2)]
    cfg = make_config(tiny_llama_dir, lora=LORA, lr=1e-2)
    a = Trainer(cfg)
    a.train_on(batches[0])
    saved = _params(a)
    adapters = {n: t.clone() for n, t in export_adapter_tensors(a.model_chunks)}
    a.save(tmp_path / "ckpt")
    a.train_on(batches[1])
    final_a = _params(a)

    b = Trainer(cfg)
    b.load(tmp_path / "ckpt")
    assert b.last_load.optimizer_loaded and all(torch.equal(v, _params(b)[k]) for k, v in saved.items())
    b.train_on(batches[1])
    assert all(torch.equal(v, _params(b)[k]) for k, v in final_a.items())  # Adam state of the adapters too

    with pytest.raises(CheckpointError, match=r"other LoRA adapters \(trainer.lora\).*rank 4.*none"):
        Trainer(make_config(tiny_llama_dir)).load(tmp_path / "ckpt")

    merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
    megatron_to_hf(tmp_path / "ckpt", merged_dir, hf_config=tiny_llama_dir, peft_dir=peft_dir, backend="gloo")
    assert load_file(str(peft_dir / "adapter_model.safetensors")).keys() == adapters.keys()
    for name, t in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        assert torch.equal(t, adapters[name]), name  # the checkpoint's adapters, bit for bit
    tokens = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = hf(tokens).logits
        with_adapter = PeftModel.from_pretrained(hf_model(tiny_llama_dir), peft_dir).eval()(tokens).logits
        merged = hf_model(merged_dir)(tokens).logits
    rtol = network_error(lora_matmuls(2), hf.config.vocab_size)  # merged W + s B A vs x W + s (x A) B
    torch.testing.assert_close(merged, with_adapter, rtol=rtol, atol=rtol * with_adapter.abs().max())
    assert (with_adapter - base).abs().max() > 100 * rtol * with_adapter.abs().max()  # the adapters matter
