"""Real SGLang CPU server on 127.0.0.1 serving a tiny random Llama: greedy output equals HF transformers'."""
import pytest

from megatron_rl.rollout.server import ServerSpec, SGLangServer


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from support.net import free_port

    spec = ServerSpec(model_path=str(tiny_llama_dir), port=free_port(), max_total_tokens=2048,
                      log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"),
                      extra_args=["--dtype", "float32"])
    with SGLangServer(spec) as srv:
        yield srv


def test_greedy_output_equals_hf_transformers(server, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt in ["1 + 1 =", "The quick brown fox", "def add(a, b):"]:
        ids = tok(prompt).input_ids
        out = server.client.generate({"input_ids": ids, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}, "return_logprob": True})
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert out["output_ids"] == ref, prompt
        # Reported logprobs are those of the HF model for the same tokens.
        with torch.no_grad():
            full = torch.tensor([ids + ref])
            logp = torch.log_softmax(model(full).logits[0, len(ids) - 1:-1].float(), -1)
            expected = logp.gather(-1, torch.tensor(ref)[:, None]).squeeze(-1)
        got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()
