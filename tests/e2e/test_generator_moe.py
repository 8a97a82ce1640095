"""A real SGLang server (CPU) serving a tiny random Qwen3-MoE (4 experts, top-2, renormalised): the
trainer's weight push of expert weights, checked against HF transformers.

SGLang 0.5.23 serves MoE on CPU without the real sgl_kernel: on a CPU without AMX, FusedMoE's
`UnquantizedFusedMoEMethod.forward_cpu` runs `fused_moe_native.moe_forward_native` (a torch loop
over experts) and top-k routing is plain torch. The pushed tensors are what the Megatron trainer
exports (`export_hf_tensors`, EP=1) after its weights were changed, and what two torchrun trainer
ranks at EP=2 push through the trainer's own `TrainerPush` (each holding two of the experts); SGLang's
Qwen3-MoE `load_weights` packs each expert's gate/up/down into the fused `experts.w13_weight` /
`experts.w2_weight`. The reference is an HF model holding exactly the pushed tensors: greedy tokens
must be equal, logprobs within float tolerance (as for the dense model, tests/e2e/test_generator.py).
Not Qwen2-MoE: SGLang gates its shared expert with a Triton-only kernel on CPU (docs/rollout.md).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # a torchrun rank of the EP=2 test (`ep2_trainer_rank` below): tests/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.sync.sender import WeightSender
from megatron_rl.sync.update import push_in_process, target_of
from support.runs import running_generator
from support.train_models import make_served_tiny_moe
from test_generator import PROMPTS, assert_matches_hf

pytestmark = [pytest.mark.long, pytest.mark.e2e]

EXPERTS = 4
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


@pytest.fixture(scope="module")
def moe_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny MoE with the tiny Llama's tokenizer (the server needs one; the vocab sizes agree)."""
    return make_served_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), tiny_llama_dir, family="qwen3_moe",
                                experts=EXPERTS, topk=2, expert_ffn=48)


@pytest.fixture(scope="module")
def gen(moe_dir, tmp_path_factory):
    # startup measured at 6-10 min while other jobs load the 2-core box: wait up to pytest's 900 s timeout
    with running_generator(moe_dir, tmp_path_factory.mktemp("sglang_moe"), max_total_tokens=2048, threads=1,
                           startup_timeout_s=840) as g:
        yield g


@pytest.fixture(scope="module")
def trainer_tensors(moe_dir, tp1):
    """What the trainer pushes after an update: the Megatron model loaded from disk, every weight
    moved (a sharper output layer, so greedy has no near-ties), exported with HF names."""
    from transformers import AutoConfig

    from megatron_rl.train.hf_weights import export_hf_tensors, load_hf_weights
    from megatron_rl.train.model import build_model

    chunks = build_model(AutoConfig.from_pretrained(moe_dir), tp1, torch.float32, use_te=False)
    load_hf_weights(chunks, moe_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
            if name.endswith("output_layer.weight"):
                p.mul_(6.0)
    return [(n, t.clone()) for n, t in export_hf_tensors(chunks)]


def hf_with(moe_dir, tensors, out):
    """The HF model loaded from a checkpoint of exactly `tensors` (HF's own loader packs the per-expert
    tensors into its fused experts; every parameter must come from `tensors`, no name may be left)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.mkdir()
    shutil.copy(moe_dir / "config.json", out / "config.json")
    save_file(dict(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    torch.set_num_threads(1)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def swapped_experts(tensors, layer: int, a: int, b: int):
    """`tensors` with experts a and b of `layer` exchanged (their names kept)."""
    def other(name):
        m = EXPERT.match(name)
        if m is None or int(m[1]) != layer or int(m[2]) not in (a, b):
            return name
        return name.replace(f".experts.{m[2]}.", f".experts.{b if int(m[2]) == a else a}.")
    by_name = dict(tensors)
    return [(n, by_name[other(n)]) for n, _ in tensors]


@torch.no_grad()
def assert_outputs_differ(model_a, model_b):
    """The two models' next-token log-probabilities differ on the test prompts (not only by rounding)."""
    ids = torch.tensor([PROMPTS[1]])
    a, b = (torch.log_softmax(m(ids).logits[0], -1) for m in (model_a, model_b))
    assert (a - b).abs().max() > 0.1


def test_moe_server_matches_hf_before_a_push(gen, moe_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    assert_matches_hf(gen, AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval(), 0)


def test_pushed_trainer_experts_are_served(gen, moe_dir, trainer_tensors, tmp_path):
    from safetensors.torch import load_file

    disk = {k: v for f in moe_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    experts = [n for n, _ in trainer_tensors if EXPERT.match(n)]
    assert len(experts) == 2 * EXPERTS * 3  # 2 layers x 4 experts x gate/up/down
    assert all(not torch.equal(t, disk[n]) for n, t in trainer_tensors)  # every pushed weight is new
    sender = WeightSender(0, [target_of(gen)], bucket_mb=0.05)
    try:
        report = push_in_process([gen], [(sender, trainer_tensors)], 1,
                                 expected_names=list(disk))
        assert report.reports[0].buckets > 1
        pushed = hf_with(moe_dir, trainer_tensors, tmp_path / "pushed")
        assert_matches_hf(gen, pushed, 1)
        # the experts land where their names say: exchanging two experts' weights changes the output,
        # and the server then equals the HF model with those two exchanged
        swapped = swapped_experts(trainer_tensors, layer=0, a=0, b=1)
        swapped_hf = hf_with(moe_dir, swapped, tmp_path / "swapped")
        assert_outputs_differ(pushed, swapped_hf)
        push_in_process([gen], [(sender, swapped)], 2, expected_names=list(disk))
        assert_matches_hf(gen, swapped_hf, 2)
    finally:
        sender.close()


@pytest.mark.timeout(1800)  # run alone it also pays the server's startup (>10 min on a loaded 2-core box)
def test_ep2_trainer_ranks_push_every_expert(gen, moe_dir, tmp_path):
    """Two trainer ranks at DP=2 x EP=2 (gloo, torchrun) each hold two of the four experts of a changed
    checkpoint and push it as the trainer does (`TrainerPush`): the experts are gathered over EP and
    one rank sends them all under their global names. The reference is HF loaded from that checkpoint's
    own file (no Megatron layout or expert numbering of ours in it)."""
    from safetensors.torch import load_file

    from support.torchrun import run_two_ranks

    disk = {k: v for f in moe_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    g = torch.Generator().manual_seed(11)
    # every weight moved; a sharper output layer (no greedy near-ties)
    changed = [(n, (t * 6.0 if n == "lm_head.weight" else t)
                + (0.5 * t.std() + 0.05) * torch.randn(t.shape, generator=g)) for n, t in disk.items()]
    reference = hf_with(moe_dir, changed, tmp_path / "changed")
    # the comparison sees a wrong EP offset: rank 0's experts (0, 1) exchanged with rank 1's (2, 3) change the output
    offset = changed
    for layer in (0, 1):
        offset = swapped_experts(swapped_experts(offset, layer, 0, 2), layer, 1, 3)
    assert_outputs_differ(reference, hf_with(moe_dir, offset, tmp_path / "offset"))
    version = 3
    gen.begin_update()
    run_two_ranks(__file__, tmp_path / "changed", gen.server.url, gen.server.spec.tp_size, gen.incarnation,
                  version, tmp_path / "report.json", timeout=600)
    gen.finish_update(version)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["local_experts"] == [EXPERTS // 2] * 2 and report["senders"] == [True, False]
    assert report["push"]["tensors"] == len(disk)  # every name, each expert once, sent by one rank
    assert_matches_hf(gen, reference, version)


def ep2_trainer_rank(model_dir: str, url: str, tp_size: str, incarnation: str, version: str, report_path: str) -> None:
    """One torchrun rank: Megatron at DP=2 x EP=2 loads `model_dir` and pushes it to the server at `url`."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_rl.sync.sender import SyncTarget
    from megatron_rl.sync.trainer_push import TrainerPush
    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.model import build_model
    from megatron_rl.train.parallel import ParallelLayout, destroy_parallel, init_parallel

    layout = init_parallel(ParallelLayout(dp=2, ep=2), backend="gloo")
    chunks = build_model(AutoConfig.from_pretrained(model_dir), layout, torch.float32, use_te=False)
    load_hf_weights(chunks, model_dir)
    push = TrainerPush(chunks, bucket_mb=0.05, node_addr="127.0.0.1")
    try:
        report = push.push(int(version), [SyncTarget(url, int(tp_size), int(incarnation))])
    finally:
        push.close()
    mine = (chunks[0].decoder.layers[0].mlp.experts.num_local_experts, push.is_sender)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(report_path).write_text(json.dumps({"push": dataclasses.asdict(report), "local_experts": [r[0] for r in ranks],
                                                 "senders": [r[1] for r in ranks]}))
    destroy_parallel(destroy_process_group=True)
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    ep2_trainer_rank(*sys.argv[1:])
