"""Real SGLang CPU server on 127.0.0.1 serving a tiny random Llama: greedy output equals HF transformers',
and every candidate's logprob equals HF fp32's to fp32 rounding (a server left to SGLang's default dtype
computes a float32 checkpoint in float16: ~10x the bound here, 2e-2-1e-1 on SmolLM2-135M)."""
import os

import pytest

from megatron_rl.rollout.server import ServerSpec, SGLangServer


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from support.net import free_port

    spec = ServerSpec(model_path=str(tiny_llama_dir), port=free_port(), max_total_tokens=2048,
                      log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"),
                      extra_args=os.environ.get("SMOKE_SERVER_ARGS", "").split())  # e.g. "--dtype float16"
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


def test_every_candidates_logprob_is_hf_fp32s_to_rounding(server, tiny_llama_dir):
    """The top-20 candidates at each position, not only the sampled token: near p = 1 a logit error
    cancels out of the sampled token's logprob, so only the candidates show the dtype the server ran."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.tolerances import logprob_error, network_error

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    cfg = model.config
    for prompt in ["1 + 1 =", "def add(a, b):"]:
        ids = tok(prompt).input_ids
        out = server.client.generate({"input_ids": ids, "sampling_params": {
            "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}, "return_logprob": True,
            "top_logprobs_num": 20})
        full = torch.tensor([ids + out["output_ids"]])
        with torch.no_grad():
            logits = model(full).logits[0, len(ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1)
        # logit error: the forward's chain of matmuls, relative to the largest logit; a logprob moves by at
        # most twice the largest logit error, plus the log-softmax's own rounding
        z_err = network_error(9 * cfg.num_hidden_layers + 1, max(cfg.hidden_size, cfg.intermediate_size)) * logits.abs().max()
        for k, top in enumerate(out["meta_info"]["output_top_logprobs"]):
            got = torch.tensor([t[0] for t in top])
            want = ref[k, torch.tensor([int(t[1]) for t in top])]
            bound = 2 * z_err + logprob_error(cfg.vocab_size, want)
            assert ((got - want).abs() <= bound).all(), (prompt, k, (got - want).abs().max().item(), bound.max().item())
