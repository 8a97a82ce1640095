"""Adapter push (trainer.lora.push: adapter; rollout/adapters.py, sync/adapter_push.py): the config's
refusals, the request body SGLang's own unpickler reads back bit for bit, the server flags, and the
version rule's bookkeeping (a turn keeps the adapter it named; idle adapters are freed)."""
import pickle

import pytest
import torch

from megatron_rl.config import ConfigError, config_from_dict
from megatron_rl.rollout.adapters import AdapterVersions, adapter_name, lora_server_args
from megatron_rl.sync.adapter_push import load_body, serialize


def _cfg(**lora):
    return config_from_dict({"trainer": {"lora": lora}})


def test_push_defaults_to_merged_and_adapter_is_accepted_with_adapters():
    assert _cfg().trainer.lora.push == "merged"
    assert _cfg(rank=8, push="adapter").trainer.lora.push == "adapter"


@pytest.mark.parametrize("tree, key", [
    ({"trainer": {"lora": {"rank": 0, "push": "adapter"}}}, "trainer.lora.push"),
    ({"trainer": {"lora": {"rank": 8, "push": "adapters"}}}, "trainer.lora.push"),
    ({"trainer": {"lora": {"rank": 8, "push": "adapter"}}, "generator": {"extra_args": ["--max-lora-rank", "4"]}},
     "trainer.lora.push"),
    ({"trainer": {"lora": {"rank": 8, "push": "adapter"}}, "generator": {"extra_args": ["--enable-lora"]}},
     "trainer.lora.push"),
])
def test_refusals_name_the_key_in_one_line(tree, key):
    with pytest.raises((ConfigError, ValueError)) as e:
        config_from_dict(tree)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_user_lora_backend_is_allowed_with_adapter_push():
    cfg = config_from_dict({"trainer": {"lora": {"rank": 8, "push": "adapter"}},
                            "generator": {"extra_args": ["--lora-backend", "triton"]}})
    assert lora_server_args(8, cfg.trainer.lora.target_modules, cfg.generator.extra_args)[-1] != "torch_native"


def test_server_args_name_pefts_projections_and_the_cpu_backend():
    args = lora_server_args(16, ["linear_qkv", "linear_fc2"])
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "16"]
    assert args[args.index("--lora-target-modules") + 1:][:4] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert args[-2:] == ["--lora-backend", "torch_native"]  # this machine has no CUDA


def test_body_round_trips_through_sglangs_restricted_unpickler_bit_for_bit():
    import base64

    from sglang.srt.utils.common import MultiprocessingSerializer

    g = torch.Generator().manual_seed(0)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                   torch.randn(64, 4, generator=g).to(torch.bfloat16)}
    body = load_body("policy-v3", serialize(tensors), {"r": 4, "lora_alpha": 8}, tp_size=2)
    assert body["lora_name"] == "policy-v3" and len(body["serialized_named_tensors"]) == 2
    back = MultiprocessingSerializer.deserialize(base64.b64decode(body["serialized_named_tensors"][1]))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_views_of_a_larger_storage_are_sent_alone():
    # on a CPU trainer the adapters are views (the fused layers' splits, Megatron's parameter buffer):
    # pickle would write each view's whole storage (a whole-run push sent 22x the adapters' bytes)
    buffer = torch.randn(1000, 64)
    views = {"a": buffer[:4], "b": buffer[4:8].t()}
    payload = serialize(views)
    assert len(payload) < 2 * 4 * 64 * 4 + 2000
    back = pickle.loads(payload)
    assert all(torch.equal(back[n], t) and back[n].is_contiguous() for n, t in views.items())


def test_an_empty_push_is_refused_before_it_reaches_the_server():
    with pytest.raises(ValueError):  # SGLang's scheduler dies on an empty list (IndexError)
        load_body("policy-v1", b"", {}, tp_size=1)


def test_a_turn_keeps_the_adapter_it_named_and_idle_adapters_are_freed():
    a = AdapterVersions(initial_version=0)
    assert a.acquire() == (None, 0)  # before the first push: the base on disk is version 0
    assert a.switch(1) == []
    turn1 = a.acquire()
    assert turn1 == (adapter_name(1), 1)
    assert a.switch(2) == []  # version 1 still has a turn running: kept
    assert a.acquire() == (adapter_name(2), 2)
    assert a.release(None) == []
    assert a.release(adapter_name(1)) == [adapter_name(1)]  # its last turn returned: free it
    assert a.switch(3) == []  # v2's turn above is still running
    assert a.release(adapter_name(2)) == [adapter_name(2)] and a.loaded == {3}
    a.reset()  # the server restarted: it serves the base again
    assert a.acquire() == (None, 0) and a.loaded == set()
