"""Real SGLang CPU server on 127.0.0.1 serving a tiny random Llama: greedy output equals HF transformers'."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from megatron_rl.platform import sglang_cpu_env


def _post(url: str, payload: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from support.net import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("sglang") / "server.log", "w+")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_llama_dir), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--max-total-tokens", "2048", "--sleep-on-idle",
           "--skip-server-warmup", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=sglang_cpu_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"SGLang server exited {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("SGLang server did not become healthy in 300 s")
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_greedy_output_equals_hf_transformers(server, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt in ["1 + 1 =", "The quick brown fox", "def add(a, b):"]:
        ids = tok(prompt).input_ids
        out = _post(f"{server}/generate", {"input_ids": ids, "sampling_params": {
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
