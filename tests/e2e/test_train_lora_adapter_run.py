"""A whole `megatron-rl train` run (mpiexec: controller, Megatron trainer, one CPU SGLang generator) with
LoRA and `trainer.lora.push: adapter`, 3 updates of the tiny Llama (fp32, rank 4 on every target).

While the run goes the test asks the run's own server, beside the run's requests: a greedy request without
an adapter name (the base) as soon as the server is up and again after an adapter was pushed, and one
naming a pushed adapter `policy-v<N>`. From the run's outputs and those answers:
- every update's push was an adapter push (`push/mode`), its bytes about the adapters' raw bytes and
  far below the model's, its tensor count PEFT's (A and B of 7 projections per layer);
- sampled tokens carry versions that never exceed the trainer's (`batch/staleness_min` >= 0), increase
  across updates, and one per sequence (a turn keeps its adapter to its end);
- the base on the server never changed: its greedy tokens and logprobs before and after the pushes equal
  HF's of the model on disk, and the server's own weight version stays the disk's (0);
- the pushed adapter is the trainer's: the checkpoint of version N, exported as a PEFT adapter (`megatron-rl
  convert to-hf --peft-adapter`), gives under HF + PEFT the tokens and logprobs the server gave for
  `policy-v<N>`; its B matrices are nonzero (trained from PEFT's zero start); the final checkpoint records
  the adapters.
Measured 2026-11-28 (2-core CPU, load average 10-13): 404 s; every push 42,803 bytes (pickle of 32,768 bytes
of adapters in 28 tensors; the model is 486,144 bytes), 0.10-0.27 s; the batches' mean token versions 0, 0,
1; the probe served policy-v2 as HF + PEFT serve the iter_0000002 adapter. Before the fix to
sync/adapter_push.serialize (clone: pickle writes a view's whole storage) each push sent 735,147 bytes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from megatron_rl.control.metrics import METRICS_FILE, read_jsonl
from megatron_rl.data.synthetic import addition_problems
from megatron_rl.rollout.client import SGLangClient, SGLangHTTPError
from support.net import free_port
from support.runs import launch_train

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]  # about 4 min on the loaded 2-core CPU
PLUGINS = Path(__file__).resolve().parents[1] / "support" / "reward_plugins.py"
RANK, ALPHA, LAYERS = 4, 8.0, 2
PROBE = [0, 5, 6, 7, 8]  # token ids of the probing requests
PROBE_TOKENS = 12
LOGPROB_TOL = 1e-4  # fp32 server vs fp32 HF of a 2-layer, 64-wide model: measured <= 5e-7


def _greedy(client: SGLangClient, adapter: str | None = None) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROBE, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": PROBE_TOKENS, "ignore_eos": True}}
    if adapter is not None:
        body["lora_path"] = adapter
    out = client.generate(body)
    pairs = out["meta_info"]["output_token_logprobs"]
    return [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]


def _hf_greedy(model) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        ids = model.generate(input_ids=torch.tensor([PROBE]), max_new_tokens=PROBE_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=2)[0, len(PROBE):].tolist()
        logits = model(input_ids=torch.tensor([PROBE + ids])).logits[0, len(PROBE) - 1:-1].float()
    return ids, torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


class Probe:
    """Asks the run's server while the run goes (its answers: `base_before`, `base_after`, `adapter`)."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.client = proc, SGLangClient(f"http://127.0.0.1:{port}", timeout_s=60)
        self.base_before = self.base_after = self.adapter = self.weight_version = None
        self.loaded_seen: set[str] = set()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 — reported by the test
            self.error = e

    def _alive(self) -> bool:
        return self.proc.poll() is None

    def _run(self) -> None:
        while self._alive() and not self.client.healthy(timeout=2):
            time.sleep(0.5)
        if not self._alive():
            return
        self.base_before = _greedy(self.client)
        # the newest pushed adapter, at version >= 2 if the run gets there before it ends
        while self._alive():
            try:
                names = self.client.loaded_adapters()
            except Exception:  # noqa: BLE001 — the run is ending
                return
            self.loaded_seen |= names
            versions = sorted(int(n.removeprefix("policy-v")) for n in names)
            if versions and (versions[-1] >= 2 or self.adapter is None):
                name = f"policy-v{versions[-1]}"
                try:
                    self.adapter = (versions[-1], *_greedy(self.client, name))
                except SGLangHTTPError:  # unloaded between the listing and the request: ask again
                    continue
                self.base_after = _greedy(self.client)
                self.weight_version = self.client.weight_version()
                if versions[-1] >= 2:
                    return
            time.sleep(0.3)


def _config(tmp_path: Path, tiny_llama_dir: Path, port: int) -> dict:
    return {
        "trainer": {"model": str(tiny_llama_dir), "precision": "fp32", "lr": 1e-3, "micro_batch_tokens": 1024,
                    "lora": {"rank": RANK, "alpha": ALPHA, "push": "adapter"}},
        "rollout": {"group_size": 4, "n_async": 8, "n_batch": 8, "n_mini": 1, "max_new_tokens": 16},
        "generator": {"max_total_tokens": 4096, "port_base": port},
        "reward": {"custom": f"{PLUGINS}:digit_share", "l_max": 16, "l_cache": 4, "language_check": False,
                   "verifier_workers": 1},
        "data": {"source": "jsonl", "path": str(addition_problems(tmp_path / "problems.jsonl", 32)),
                 "system_prompt": "none"},
        "run": {"output_dir": str(tmp_path / "run"), "updates": 3, "checkpoint_every": 1, "keep_checkpoints": 0},
    }


def _peft_export(ckpt: Path, base: Path, out: Path) -> Path:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "convert", "to-hf", str(ckpt), str(out / "merged"),
           "--hf-config", str(base), "--peft-adapter", str(out / "adapter")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return out / "adapter"


def test_a_lora_run_pushes_only_adapters_and_the_base_on_the_generator_never_changes(tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    port = free_port()
    cfg = _config(tmp_path, tiny_llama_dir, port)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = Path(cfg["run"]["output_dir"])

    proc = launch_train(config)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(proc.communicate(timeout=800)[0]), daemon=True)
    reader.start()
    probe = Probe(proc, port)
    probe.run()
    reader.join(timeout=800)
    assert proc.returncode == 0, (output or [""])[0][-6000:]
    assert probe.error is None, probe.error

    rows = read_jsonl(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows] == [1, 2, 3]

    # every push sent only the adapters: PEFT's A and B of 7 projections per layer, about their raw bytes
    model_bytes = 4 * sum(t.numel() for t in load_file(str(tiny_llama_dir / "model.safetensors")).values())
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    adapter_bytes = 4 * sum(RANK * (m.in_features + m.out_features) for n, m in hf.named_modules()
                            if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"))
    for r in rows:
        assert r["push/mode"] == "adapter", r
        assert r["push/tensors"] == 2 * 7 * LAYERS
        assert adapter_bytes <= r["push/bytes"] <= 1.2 * adapter_bytes + 16384, (r["push/bytes"], adapter_bytes)
        assert r["push/bytes"] < 0.15 * model_bytes, (r["push/bytes"], model_bytes)

    # token versions: never above the trainer's, one per sequence, rising across updates
    for r in rows:
        assert r["batch/staleness_min"] >= 0, r
        if r["rollouts"]:
            assert r["versions_per_sequence/mean"] == 1.0  # a turn keeps the adapter it named to its end
    token_version = [r["update"] - 1 - r["batch/staleness_mean"] for r in rows]  # the batch's mean version
    assert token_version == sorted(token_version) and token_version[-1] > 0, token_version

    # the base on the server never changed, and the server never took a merged push
    assert probe.base_before is not None and probe.base_after is not None, "the probe never saw an adapter"
    ref_ids, ref_logp = _hf_greedy(hf)
    for ids, logp in (probe.base_before, probe.base_after):
        assert ids == ref_ids and _close(logp, ref_logp) < LOGPROB_TOL
    assert probe.weight_version == "0"

    # the adapter the server served under policy-v<N> is the trainer's version N (its checkpoint)
    version, ids, logp = probe.adapter
    assert version >= 1
    adapter_dir = _peft_export(run_dir / "checkpoints" / f"iter_{version:07d}", tiny_llama_dir, tmp_path / "export")
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * LAYERS
    assert all(t.abs().max() > 0 for n, t in tensors.items() if "lora_B" in n)  # trained: PEFT starts B at 0
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
                                     str(adapter_dir)).eval()
    peft_ids, peft_logp = _hf_greedy(peft)
    assert ids == peft_ids and _close(logp, peft_logp) < LOGPROB_TOL, (ids, peft_ids)

    # the run's final checkpoint holds the adapters
    from megatron_rl.train.checkpoint import read_common

    final = read_common(run_dir / "checkpoints")
    assert final["step"] == 3 and final["lora"]["rank"] == RANK, final["lora"]
    print(json.dumps({"probed_version": version, "adapters_seen": sorted(probe.loaded_seen),
                      "push_bytes": [r["push/bytes"] for r in rows], "adapter_bytes": adapter_bytes,
                      "model_bytes": model_bytes, "push_s": [r["push/wall_s"] for r in rows],
                      "token_version": token_version}))
