"""HF <-> Megatron dist-checkpoint conversion (megatron_rl.train.convert) with 2 gloo processes.

One torchrun launch converts each model HF -> Megatron at one layout and back to HF at other
layouts (resharding: TP=2 -> PP=2 and -> TP=1; across TP padding, which the odd-sized models need
at TP=2: PP=2 -> TP=2 (padding added) and TP=2 -> TP=1 (padding removed)). References are the source
safetensors (bit-exact equality of every tensor) and HF transformers logits of the source model.
"""
import json
from pathlib import Path

import pytest
import torch

from support.torchrun import run_two_ranks
from support.train_models import make_tiny_hf, make_tiny_moe, smollm2_fp32_dir

pytestmark = pytest.mark.long  # minutes of multi-process runs: the long tier (README "Tests")

WORKER = Path(__file__).resolve().parent / "scripts" / "train_convert_worker.py"
TINY = {  # llama: even sizes (no TP padding); the others odd (padded at TP=2)
    "llama": dict(family="llama", layers=2, heads=4, kv_heads=2, intermediate=96, vocab=302),
    "mistral": dict(family="mistral", layers=2, seed=3),
    "qwen2_tied": dict(family="qwen2", layers=2, tie=True, seed=2),
    "qwen3": dict(family="qwen3", layers=2, head_dim=12, seed=4),  # q/k norms, head_dim != hidden / heads
}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_convert")
    sources = {"smollm2": smollm2_fp32_dir(tmp_path_factory.getbasetemp())}
    sources.update({name: make_tiny_hf(root / name, **spec) for name, spec in TINY.items()})
    sources["qwen3_moe"] = make_tiny_moe(root / "qwen3_moe", seed=5)
    cases, exports = [], {}
    for name, src in sources.items():
        if name == "smollm2":  # TP=2 (padded: 3 -> 4 KV groups) read back at TP=1 x DP=2; 100 MB shards
            to_m, outs = {"tp": 2, "pp": 1}, [("tp1", 1, 1, 100)]
        elif name == "llama":  # resharding: TP=2 checkpoint read back at PP=2 and TP=1 (x DP=2)
            to_m, outs = {"tp": 2, "pp": 1}, [("pp2", 1, 2, 1), ("tp1", 1, 1, 1)]
        elif name == "qwen3_moe":  # experts split over EP=2 (2 of 4 per rank) read back at EP=1 x DP=2
            to_m, outs = {"tp": 1, "pp": 1, "ep": 2}, [("tp1", 1, 1, 1)]
        elif name == "mistral":  # TP padding added: unpadded PP=2 checkpoint read back at TP=2
            to_m, outs = {"tp": 1, "pp": 2}, [("tp2", 2, 1, 1)]
        else:  # TP padding removed: padded TP=2 checkpoint read back at TP=1 x DP=2; tiny shards
            to_m, outs = {"tp": 2, "pp": 1}, [("tp1", 1, 1, 1)]
        ex = [{"out": str(root / f"{name}.{tag}"), "tp": tp, "pp": pp, "shard_mb": mb} for tag, tp, pp, mb in outs]
        for e, (tag, *_rest) in zip(ex, outs):
            exports[(name, tag)] = e
        cases.append({"src": str(src), "ckpt": str(root / f"{name}.ckpt"), "to_megatron": to_m, "exports": ex})
    (root / "cases.json").write_text(json.dumps(cases))
    run_two_ranks(WORKER, root / "cases.json", root / "report.json", timeout=900)
    return sources, exports, json.loads((root / "report.json").read_text())


def _export_keys():
    return [("smollm2", "tp1"), ("llama", "pp2"), ("llama", "tp1"), ("mistral", "tp2"), ("qwen2_tied", "tp1"), ("qwen3", "tp1"),
            ("qwen3_moe", "tp1")]


@pytest.mark.parametrize("key", _export_keys(), ids=lambda k: f"{k[0]}-{k[1]}")
def test_round_trip_tensors_bit_exact(converted, key):
    sources, exports, _ = converted
    src = read_tensors(sources[key[0]])
    got = read_tensors(Path(exports[key]["out"]))
    assert set(got) == set(src)
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("key", _export_keys(), ids=lambda k: f"{k[0]}-{k[1]}")
def test_round_trip_logits_equal(converted, key):
    from transformers import AutoModelForCausalLM

    sources, exports, _ = converted
    torch.set_num_threads(1)
    ref = AutoModelForCausalLM.from_pretrained(sources[key[0]], dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(exports[key]["out"], dtype=torch.float32).eval()
    tokens = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(tokens).logits, new(tokens).logits)


def test_shards_index_and_memory_bound(converted):
    sources, exports, report = converted
    e = exports[("llama", "pp2")]
    out = Path(e["out"])
    files = report[e["out"]]["files"]
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(read_tensors(sources["llama"]))
    largest = max(t.numel() * t.element_size() for t in read_tensors(sources["llama"]).values())
    # a writer holds at most one shard, or one tensor when a single tensor is larger than a shard
    assert report[e["out"]]["peak_buffer_bytes"] <= max(e["shard_mb"] << 20, largest)
    smol = exports[("smollm2", "tp1")]
    smol_tensors = read_tensors(sources["smollm2"])
    largest = max(t.numel() * t.element_size() for t in smol_tensors.values())  # the embedding, 113 MB
    total = sum(t.numel() * t.element_size() for t in smol_tensors.values())  # 540 MB
    assert report[smol["out"]]["peak_buffer_bytes"] <= max(100 << 20, largest) < total
    assert (Path(smol["out"]) / "config.json").is_file()
