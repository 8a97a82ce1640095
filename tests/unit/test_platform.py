"""CPU shims: each probe of the upstream behaviour still holds, and the shims make the real code run.

The shim checks run in subprocesses: applying the shims changes torch globally, and the test process
must stay a plain CPU torch for the other tests.
"""
import importlib.metadata
import importlib.util
import inspect
import subprocess
import sys
import textwrap

from megatron_rl.platform import SGL_KERNEL_STUB_DIR, sglang_cpu_env

MCORE = importlib.metadata.version("megatron-core")


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)


def _expected_shims() -> set[str]:
    names = {"current_device", "rng_tracker", "cuda_to_cpu_mode", "sync_and_streams",
             "distopt_torch_adam", "torch_norm_sequence_parallel"}
    major, minor = (int(x) for x in MCORE.split(".")[:2])
    if (major, minor) >= (0, 19):
        names.add("paged_stash_stub")
    if importlib.util.find_spec("transformer_engine") is None:
        names.add("moe_router_gemm")
    return names


def test_every_upstream_behaviour_a_shim_works_around_is_still_there():
    # If this fails, upstream changed: the listed shim may be obsolete or must follow the change.
    out = _run("""
        from megatron_rl.platform import megatron_cpu
        print(",".join(s.name for s in megatron_cpu.SHIMS if s.needed()))
    """)
    assert out.returncode == 0, out.stderr
    needed = set(out.stdout.strip().split(",")) - {""}
    assert needed == _expected_shims(), f"megatron-core {MCORE}: needed={needed}"


# What a machine lacks, as the gates read it: CUDA (torch), TE (importable), apex. The subprocess fakes
# a CUDA device (and, for "te", an importable transformer_engine) before asking which shims it wants.
_GATES = """
    import importlib.machinery, sys, types, torch
    torch.cuda.is_available = lambda: {cuda}
    if {te}:
        te = types.ModuleType("transformer_engine")
        te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
        sys.modules["transformer_engine"] = te
    from megatron_rl.platform import megatron_cpu
    print(",".join(s.name for s in megatron_cpu.wanted()))
"""
_CUDA_SHIMS = {"current_device", "rng_tracker", "cuda_to_cpu_mode", "sync_and_streams"}
_TE_LESS_SHIMS = {"distopt_torch_adam", "torch_norm_sequence_parallel", "moe_router_gemm"}


def _wanted(cuda: bool, te: bool) -> set[str]:
    out = _run(_GATES.format(cuda=cuda, te=te))
    assert out.returncode == 0, out.stderr
    return set(out.stdout.strip().split(",")) - {"", "paged_stash_stub"}  # that one follows triton


def test_each_shim_is_gated_on_what_it_works_around_not_on_cuda():
    # a GPU without TE (MEGATRON_RL_GPU_TE=0): the local norm under sequence parallel, torch Adam in
    # DistributedOptimizer checkpoints and the MoE router still need their shims; nothing CUDA-shaped
    assert _wanted(cuda=True, te=False) == _TE_LESS_SHIMS
    assert _wanted(cuda=True, te=True) == set()  # TE's spec, TE's FusedAdam: the libraries untouched
    assert _wanted(cuda=False, te=False) == _CUDA_SHIMS | _TE_LESS_SHIMS


def test_megatron_gpt_fails_without_shims_and_runs_with_them():
    build = """
        import torch, torch.distributed as dist
        import torch.nn.functional as F
        {apply}
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from support.net import free_port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
            persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False)
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                         max_sequence_length=16, position_embedding_type="rope")
        tokens = torch.randint(0, 64, (2, 8))
        pos = torch.arange(8).expand(2, 8)
        mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).view(1, 1, 8, 8)
        logits = model(tokens, pos, mask)
        logits.float().sum().backward()
        print("OK", tuple(logits.shape), torch.zeros(1, device="cuda").device)
    """
    env = dict(__import__("os").environ, PYTHONPATH=str(__import__("pathlib").Path(__file__).parents[1]))
    raw = _run(build.format(apply=""), env=env)
    assert raw.returncode != 0, "Megatron ran on CPU without shims: upstream changed, revisit platform/"
    shimmed = _run(build.format(apply="from megatron_rl.platform import ensure_megatron_shims; ensure_megatron_shims()"),
                   env=env)
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    assert "OK (2, 8, 64) cpu" in shimmed.stdout


def test_sglang_still_imports_the_cpu_kernel_we_stub():
    import sglang.srt.mem_cache.allocation as allocation

    assert importlib.util.find_spec("sgl_kernel") is None, "a real sgl_kernel is installed: drop the stub?"
    assert "from sgl_kernel import assign_req_to_token_pool_cpu" in inspect.getsource(allocation)


def test_sgl_kernel_stub_matches_a_reference_loop():
    env = sglang_cpu_env({"PATH": "/usr/bin:/bin"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(SGL_KERNEL_STUB_DIR)
    out = _run("""
        import torch, sgl_kernel
        req_to_token = torch.zeros(4, 10, dtype=torch.int32)
        rows, start, end = torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([4, 5])
        locs = torch.arange(100, 105)
        sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 10)
        assert req_to_token[2, 1:4].tolist() == [100, 101, 102], req_to_token
        assert req_to_token[0, 3:5].tolist() == [103, 104]
        assert int(req_to_token.count_nonzero()) == 5
        try:
            sgl_kernel.some_fused_op(1)
        except NotImplementedError as e:
            assert "some_fused_op" in str(e)
            print("OK")
    """, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


def test_sgl_kernel_stub_unpins_sglangs_lora_modules_only():
    """SGLang's LoRA code pins its host index tensors, which raises on a CPU-only torch; the stub gives its
    modules a torch whose factories ignore pin_memory and makes Tensor.pin_memory the identity (it could
    only raise here). Other modules keep the real torch."""
    out = _run("""
        import torch, sgl_kernel
        try:
            torch.tensor([1], pin_memory=True)
        except RuntimeError:
            pass
        else:
            raise AssertionError("this torch pins memory: the LoRA shim is not needed")
        import sglang.srt.lora.backend.torch_backend as tb, sglang.srt.lora.layers as layers
        import sglang.srt.mem_cache.allocation as other
        assert tb.torch is not torch and layers.torch is not torch and other.torch is torch
        x = tb.torch.tensor([1, 2], dtype=torch.int32, pin_memory=True, device="cpu")
        assert isinstance(x, torch.Tensor) and x.tolist() == [1, 2] and tb.torch.float32 is torch.float32
        assert x.pin_memory() is x
        print("OK")
    """, env=sglang_cpu_env({"PATH": "/usr/bin:/bin"}))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_sgl_kernel_stub_batches_the_torch_native_decode_exactly():
    """The stub replaces the torch_native backend's per-request decode loop by one padded SDPA call per
    chunk of requests; against the original loop (kept as __wrapped__) on random pools: GQA and MHA,
    lengths 1 to 300 in one batch, sliding windows, K/V of another dtype than the query, chunks forced
    small. fp32 results agree to a few ulp of the outputs (~1e-7 on values of order 1: the same
    products, summed in another order)."""
    out = _run("""
        import itertools, torch, sgl_kernel
        from sgl_kernel import _batched_decode
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as T
        fast = T._run_sdpa_forward_decode
        original = fast.__wrapped__
        torch.manual_seed(0)
        worst = 0.0
        for (h, hk), window, kv_dtype, block in itertools.product(
                [(9, 3), (4, 4)], [None, 0, 5], [torch.float32, torch.bfloat16], [64 << 20, 4096]):
            _batched_decode.MAX_BLOCK_BYTES = block
            d, pool, b = 16, 4000, 7
            k, v = torch.randn(pool, hk, d).to(kv_dtype), torch.randn(pool, hk, d).to(kv_dtype)
            lens = torch.tensor([1, 300, 17, 5, 300, 2, 64])
            table = torch.randint(0, pool, (b + 3, 320), dtype=torch.int32)  # garbage past each length
            rows = torch.tensor([4, 0, 9, 2, 1, 7, 5])
            q = torch.randn(b, h, d)
            want, got = torch.empty_like(q), torch.empty_like(q)
            args = (k, v, table, rows, lens)
            kw = dict(scaling=d ** -0.5, enable_gqa=h != hk, sliding_window_size=window)
            original(T, q, want, *args, **kw)  # self: only its static mask maker is used
            assert fast(T, q, got, *args, **kw) is got
            worst = max(worst, (want - got).abs().max().item())
        assert worst < 1e-5, worst
        # encoder lengths (cross-attention models) keep the original loop
        calls = []
        wrapped = _batched_decode.batched_decode(lambda *a: calls.append(a) or "loop")
        assert wrapped(T, q, got, *args, encoder_lens=torch.zeros(b, dtype=torch.int64)) == "loop" and calls
        print("OK", worst)
    """, env=sglang_cpu_env({"PATH": "/usr/bin:/bin"}))
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("OK"), out.stderr[-3000:]


def test_cpu_torch_survived_every_install():
    import torch

    assert torch.version.cuda is None and torch.__version__.startswith("2.13.0")


# ---------------------------------------------------------------- Megatron kernel options per machine

_FUSIONS = ("bias_dropout_fusion", "bias_activation_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
            "masked_softmax_fusion", "persist_layer_norm")


def _tiny_dims(layers=4):
    from transformers import LlamaConfig

    from megatron_rl.train.model import model_dims

    return model_dims(LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, hidden_size=64,
                                  intermediate_size=128, vocab_size=128))


def test_cpu_answer_turns_every_fusion_and_interleaved_batched_p2p_off():
    import torch

    from megatron_rl.platform import megatron_kernel_options
    from megatron_rl.train.model import transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    assert not torch.cuda.is_available()  # this test states the CPU answer
    for use_te in (False, True):
        plain = megatron_kernel_options(use_te=use_te, interleaved=False)
        assert not any(plain[k] for k in _FUSIONS) and plain["use_cpu_initialization"]
        assert plain["batch_p2p_comm"]  # plain 1F1B batches its p2p fine on gloo
        # interleaved PP=2 with batched p2p gives silently wrong losses on gloo (ENVIRONMENT.md)
        assert not megatron_kernel_options(use_te=use_te, interleaved=True)["batch_p2p_comm"]
    config = transformer_config(_tiny_dims(), ParallelLayout(pp=2, vpp=2))
    assert not any(getattr(config, k) for k in _FUSIONS)
    assert not config.batch_p2p_comm and config.use_cpu_initialization


def test_cuda_answer_turns_megatron_defaults_on_where_the_kernels_exist(monkeypatch):
    import megatron_rl.platform as platform
    from megatron_rl.train.model import transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    monkeypatch.setattr(platform, "has_cuda", lambda: True)  # the only fact mocked: a CUDA device exists
    config = transformer_config(_tiny_dims(), ParallelLayout(pp=2, vpp=2), use_te=False)
    assert config.bias_dropout_fusion and config.bias_activation_fusion  # torch kernels: always there
    assert config.batch_p2p_comm and not config.use_cpu_initialization  # NCCL batches interleaved p2p
    # the kernel-backed switches follow what is installed (none of them is on this CPU machine)
    assert config.apply_rope_fusion is False  # the local spec (use_te=False) never takes TE's RoPE
    assert config.gradient_accumulation_fusion == (importlib.util.find_spec("fused_weight_gradient_mlp_cuda")
                                                   is not None)
    assert config.masked_softmax_fusion == (importlib.util.find_spec("scaled_masked_softmax_cuda") is not None)
    assert config.persist_layer_norm is False  # apex's LayerNorm-only kernel; these models use RMSNorm
    te = platform.megatron_kernel_options(use_te=True, interleaved=True)
    assert te["apply_rope_fusion"] == platform._te_rope_fusion_available()


def test_yarn_rope_never_takes_the_fused_rope(monkeypatch):
    """TE's fused THD RoPE ignores YaRN's mscale: the config keeps the unfused RoPE for YaRN models."""
    import dataclasses

    import megatron_rl.platform as platform
    from megatron_rl.train.model import RopeSpec, transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    monkeypatch.setattr(platform, "_te_rope_fusion_available", lambda: True)
    dims = _tiny_dims()
    yarn = dataclasses.replace(dims, rope=RopeSpec(10000.0, "yarn", 4.0, 512, mscale=1.1386))
    assert platform.megatron_kernel_options(use_te=True, interleaved=False)["apply_rope_fusion"]
    # only the flag is checked: building a config with apply_rope_fusion=True needs TE installed
    monkeypatch.setattr("megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
                        lambda self: None)
    assert transformer_config(yarn, ParallelLayout(), use_te=True).apply_rope_fusion is False
    assert transformer_config(dims, ParallelLayout(), use_te=True).apply_rope_fusion is True


def test_trainer_and_server_of_an_update_group_get_one_nccl_cumem_setting(monkeypatch):
    """SGLang sets NCCL_CUMEM_ENABLE=0 in its server when unset, NCCL defaults to 1: the trainer rank
    (before its first communicator) and the server's environment take the same value, the job's when set."""
    import os

    from megatron_rl.control.trainer_worker import TrainerPlace, _setup_dist_env

    place = TrainerPlace(0, 1, 0, "127.0.0.1", "127.0.0.1", 29500)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")  # restored after the test: _setup_dist_env writes them
    for job in (None, "1", "0"):
        if job is None:
            monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
        else:
            monkeypatch.setenv("NCCL_CUMEM_ENABLE", job)
        server = sglang_cpu_env()["NCCL_CUMEM_ENABLE"]
        _setup_dist_env(place)
        assert os.environ["NCCL_CUMEM_ENABLE"] == server == (job or "0")


def test_cpu_flags_and_bf16_arithmetic(tmp_path):
    from megatron_rl.platform import cpu_flags, cpu_has_fast_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\nbogomips\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx2", "fma"}
    assert cpu_flags(tmp_path / "none") is None
    assert cpu_has_fast_bf16({"avx2"}) is False
    assert cpu_has_fast_bf16({"avx2", "avx512_bf16"}) and cpu_has_fast_bf16({"amx_bf16"})


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_warned_naming_the_key(monkeypatch):
    from megatron_rl.config import config_from_dict
    from megatron_rl.control import preflight

    monkeypatch.setattr("megatron_rl.platform.has_cuda", lambda: False)
    for flags, precision, warned in [({"avx2"}, "bf16", True), ({"avx2"}, "fp32", False),
                                     ({"amx_bf16"}, "bf16", False), (None, "bf16", False)]:
        monkeypatch.setattr("megatron_rl.platform.cpu_has_fast_bf16",
                            lambda flags=flags: None if flags is None else bool({"amx_bf16"} & flags))
        why = preflight.warn_slow_bf16(config_from_dict({"trainer": {"precision": precision}}))
        assert (why is not None) == warned
        assert why is None or why.startswith("trainer.precision: bf16 on a CPU without AVX512-BF16 or AMX")


RUN_ON_CORES = """
import json, os, subprocess, sys, threading, time
import torch
from megatron_rl.platform import run_on_cores
stop = threading.Event()
t = threading.Thread(target=stop.wait)  # a thread started before the placement moves too
t.start()
core = min(os.sched_getaffinity(0))
run_on_cores((core,), sglang_tp=1)
tasks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout.strip()
stop.set()
outside = run_on_cores((max(os.sched_getaffinity(0)) + 1000,))  # not ours to take: stays where it is
print(json.dumps({"outside": list(outside), "core": core, "tasks": list(tasks.values()), "threads": torch.get_num_threads(), "child": child,
                  "omp": os.environ["OMP_NUM_THREADS"], "bind": os.environ["SGLANG_CPU_OMP_THREADS_BIND"]}))
"""


def test_run_on_cores_moves_every_thread_and_what_the_process_starts():
    """run.cpu_placement split's mechanism: every thread (not only the calling one), one torch thread
    per core, children inherit the cores, an SGLang server is told to bind its threads there."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RUN_ON_CORES], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    core = got["core"]
    assert len(got["tasks"]) >= 2 and all(t == [core] for t in got["tasks"])
    assert got["threads"] == 1 and got["child"] == str([core]) and got["omp"] == "1" and got["bind"] == str(core)
    assert got["outside"] == [core]


GROUP_CHILD = """
import os, sys, threading, time
# a process group of two processes with several threads each, as an SGLang server's tree
if len(sys.argv) == 1:
    import subprocess
    kid = subprocess.Popen([sys.executable, __file__, "x"])
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_processes_of_a_group_by_title_move_with_every_thread(tmp_path):
    """A server's schedulers move to its share once healthy (ServerSpec.cpu_cores): found in its
    process group by their title, every thread of them moves; the rest of the group stays."""
    import os
    import subprocess
    import sys
    import time

    from megatron_rl.platform import move_processes, process_group

    cores = sorted(os.sched_getaffinity(0))
    script = tmp_path / "group.py"
    script.write_text(GROUP_CHILD)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        members = []
        for _ in range(100):  # the child process starts its threads too
            members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(p) == proc.pid]
            if len(members) == 2 and all(len(os.listdir(f"/proc/{m}/task")) >= 4 for m in members):
                break
            time.sleep(0.1)
        assert sorted(process_group(proc.pid)) == sorted(members) and len(members) == 2
        (kid,) = process_group(proc.pid, f"{sys.executable} {script} x")
        assert kid != proc.pid
        tids = [int(t) for t in os.listdir(f"/proc/{kid}/task")]
        assert move_processes([kid], {cores[-1]}) == len(tids)
        assert all(os.sched_getaffinity(t) == {cores[-1]} for t in tids)
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert all(os.sched_getaffinity(t) == set(cores) for t in others)  # the rest of the group stays
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _pgid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[2])
