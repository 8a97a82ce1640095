"""Parsing SGLang answers into turns; the prefix-cache epoch policy; server command line."""
from __future__ import annotations

import pytest

from megatron_rl.rollout.outputs import MalformedOutput, Turn, expand_version_spans, finish_reason
from megatron_rl.rollout.prefix_cache import PrefixCachePolicy
from megatron_rl.rollout.server import ServerSpec


def _answer(ids, spans, fr="length", version="3"):
    return {"text": "xy", "output_ids": ids,
            "meta_info": {"finish_reason": {"type": fr}, "weight_version": version,
                          "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)],
                          "weight_versions": spans}}


def test_spans_expand_per_token():
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    assert expand_version_spans(spans, 5, "3") == [2, 2, 2, 3, 3]
    assert expand_version_spans([["7", 0, 2]], 2, "7") == [7, 7]  # msgspec array form
    assert expand_version_spans(None, 4, "5") == [5, 5, 5, 5]


@pytest.mark.parametrize("spans,n", [
    ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 5}], 5),  # gap
    ([{"version": "1", "start": 0, "end": 2}], 3),  # short
    ([{"version": "x", "start": 0, "end": 1}], 1),  # not an int
])
def test_bad_spans_raise(spans, n):
    with pytest.raises(MalformedOutput):
        expand_version_spans(spans, n, "1")


def test_turn_and_finish_reasons():
    answer = _answer([5, 6, 7], [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}],
                     fr="stop")
    answer["meta_info"] |= {"prompt_tokens": 9, "cached_tokens": 4}
    t = Turn.of(answer)
    assert t.ids == [5, 6, 7] and t.versions == [2, 3, 3] and t.text == "xy"
    assert t.logprobs == [-0.5, -1.5, -2.5] and t.finish_reason == "stop"
    assert (t.prompt_tokens, t.cached_tokens) == (9, 4)
    for kind in ("stop", "length", "abort"):
        assert finish_reason({"finish_reason": {"type": kind}}) == kind
    with pytest.raises(MalformedOutput):
        finish_reason({"finish_reason": None})


def test_turn_rejects_inconsistent_answers():
    a = _answer([5, 6], None)
    a["meta_info"]["output_token_logprobs"] = a["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(MalformedOutput):
        Turn.of(a)
    a = _answer([5, 6], None)
    del a["meta_info"]["output_token_logprobs"]
    with pytest.raises(MalformedOutput, match="return_logprob"):
        Turn.of(a)


@pytest.mark.parametrize("s", [0, 1, 3])
def test_prefix_epochs_bound_staleness_exactly(s):
    """Two versions share a salt only if they differ by at most s (never reuse beyond s)."""
    p = PrefixCachePolicy(max_staleness=s)
    salts = {}
    for v in range(12):
        p.on_update(v)
        salts[v] = p.salt()
    for a in range(12):
        for b in range(12):
            if salts[a] == salts[b]:
                assert abs(a - b) <= s
    if s == 0:
        assert len(set(salts.values())) == 12


def test_prefix_policy_restart_changes_the_salt():
    """A restarted server starts empty; the incarnation in the salt keeps a late request of the old
    incarnation from sharing an epoch with the new one."""
    p = PrefixCachePolicy(max_staleness=0)
    p.on_update(2)
    salt = p.salt()
    p.on_restart(incarnation=2, version=2)
    assert p.salt() != salt and p.version == 2
    with pytest.raises(ValueError):
        PrefixCachePolicy(max_staleness=-1)


def test_server_command_is_loopback_with_required_flags(tmp_path):
    cmd = ServerSpec(str(tmp_path), 31234, max_total_tokens=4096).command()
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert "--sleep-on-idle" in cmd and "--disable-overlap-schedule" in cmd
    assert cmd[cmd.index("--weight-version") + 1] == "0"


@pytest.mark.parametrize("config,expected", [({"dtype": "float32"}, "float32"), ({"torch_dtype": "bfloat16"}, "bfloat16"),
                                             ({}, "float32")])
def test_the_server_computes_in_the_checkpoints_dtype_not_sglangs_auto(tmp_path, config, expected):
    """SGLang's --dtype auto serves a float32 checkpoint in float16; the command always names the dtype."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    cmd = ServerSpec(str(tmp_path), 31234).command()
    assert cmd[cmd.index("--dtype") + 1] == expected
    assert ServerSpec(str(tmp_path), 1, dtype="bfloat16").command().count("--dtype") == 1
    theirs = ServerSpec(str(tmp_path), 1, extra_args=["--dtype", "float16"]).command()
    assert theirs.count("--dtype") == 1 and theirs[theirs.index("--dtype") + 1] == "float16"
    assert not [a for a in ServerSpec(str(tmp_path), 1, extra_args=["--dtype=float16"]).command() if a == "--dtype"]


@pytest.mark.parametrize("precision,expected", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_a_runs_generators_compute_in_the_trainers_precision(tmp_path, precision, expected):
    from megatron_rl.config import Config
    from megatron_rl.control.generator_worker import server_spec

    cfg = Config()
    cfg.trainer.precision = precision
    cmd = server_spec(cfg, 0, str(tmp_path), tmp_path, 30000, "127.0.0.1").command()
    assert cmd[cmd.index("--dtype") + 1] == expected
