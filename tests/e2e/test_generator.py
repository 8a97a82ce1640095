"""Real SGLang server (CPU) + real weight sync, checked against HF transformers.

One server for the whole module (startup dominates). Tests run in file order and share the
server's weight version: each test that syncs uses the next version number.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import time

import pytest
import torch

from megatron_rl.sync.sender import WeightSender, WeightSyncError
from megatron_rl.sync.update import push_in_process, target_of
from support.runs import running_generator

PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 9, 11, 12]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
_versions = itertools.count(1)


def hf_model(path):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturbed(model, seed):
    """New weights that differ everywhere, with a sharper lm_head so greedy has no near-ties."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        m.lm_head.weight.mul_(6.0)
    return m


@torch.no_grad()
def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return lp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0]


def named(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def gen(tiny_llama_dir, tmp_path_factory):
    with running_generator(tiny_llama_dir, tmp_path_factory.mktemp("sglang"), threads=1) as g:
        yield g


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return hf_model(tiny_llama_dir)


def assert_matches_hf(gen, model, version):
    for i, prompt in enumerate(PROMPTS):
        gen.submit(f"p{i}", prompt, group_size=2, sampling=GREEDY)
    rollouts = list(gen.completions(timeout=120))
    assert len(rollouts) == 2 * len(PROMPTS)
    for r in rollouts:
        prompt = PROMPTS[int(r.group_id[1:])]
        assert r.prompt_ids == prompt
        assert r.completion_ids == hf_greedy(model, prompt, GREEDY["max_new_tokens"])
        ref = hf_logprobs(model, prompt, r.completion_ids)
        torch.testing.assert_close(torch.tensor(r.behaviour_logprobs), ref, atol=3e-3, rtol=1e-3)
        assert r.weight_versions == [version] * len(r.completion_ids)
        assert r.finish_reason == "length"


def test_greedy_matches_hf_before_sync(gen, hf):
    assert gen.version == 0
    assert_matches_hf(gen, hf, 0)


@contextlib.contextmanager
def idle_limit(gen, seconds):
    """The module's server read with a small /generate idle limit (the default is an hour)."""
    client = gen.server.client
    before, client.idle_timeout_s = client.idle_timeout_s, seconds
    try:
        yield seconds
    finally:
        client.idle_timeout_s = before


def test_a_completion_longer_than_the_idle_limit_streams_through(gen, hf):
    """GPU completions run for 330-1600 s; a read limit on the whole answer (600 s) ended the run. Here a
    completion takes longer than the limit, and a plain read with that limit does fail on it. A chunk per
    token keeps the gaps ~100x below the limit whatever this machine's load (the default interval gives
    STREAM_CHUNKS chunks per completion: the other tests)."""
    import time

    import requests

    n, sampling = 1000, {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True, "stream_interval": 1}
    with idle_limit(gen, 2.0) as limit:
        streamed, t0 = gen.tokens_streamed, time.monotonic()
        gen.submit("slow", PROMPTS[0], group_size=1, sampling=sampling)
        (r,) = gen.completions(timeout=600)
        took = time.monotonic() - t0
    assert took > limit, f"{took:.1f} s: too fast to show anything; raise n"
    assert gen.tokens_streamed - streamed == n and len(r.completion_ids) == n and r.weight_versions == [0] * n
    torch.testing.assert_close(torch.tensor(r.behaviour_logprobs), hf_logprobs(hf, PROMPTS[0], r.completion_ids),
                               atol=3e-3, rtol=1e-3)
    body = {"input_ids": PROMPTS[0], "sampling_params": sampling, "rid": "plain-read"}
    with pytest.raises(requests.ReadTimeout):  # what the client did before: nothing arrives until the end
        requests.post(gen.server.url + "/generate", json=body, timeout=(30, limit))
    gen.server.client.abort("plain-read")


def test_a_silent_stream_fails_naming_the_server_and_setting_and_is_aborted(gen):
    """A request paused longer than the idle limit: get() raises GenerationTimeout with the server and
    the key to raise; closing the stream makes SGLang abort the request (else it would run 3000 tokens)."""
    import time

    from megatron_rl.rollout.client import GenerationTimeout

    c = gen.server.client
    with idle_limit(gen, 2.0):
        gen.submit("paused", PROMPTS[0], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 3000,
                                                                  "ignore_eos": True})
        streamed, deadline = gen.tokens_streamed, time.monotonic() + 120
        while gen.tokens_streamed == streamed:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        c.pause("in_place")
        try:
            with pytest.raises(GenerationTimeout) as e:
                gen.get(timeout=60)
        finally:
            c.resume()
    assert gen.server.url in str(e.value) and "generator.request_idle_timeout_s" in str(e.value)
    assert gen.in_flight == 0
    deadline = time.monotonic() + 10  # flush is refused while any request runs or waits
    while not c.flush_cache():
        assert time.monotonic() < deadline, "the timed-out request still runs on the server"
        time.sleep(0.2)


def test_an_error_inside_the_stream_is_an_http_error(gen):
    """SGLang answers 200 to a streamed request and reports a refusal (a prompt past the context) as a
    `data: {"error": ...}` chunk: it must surface as SGLangHTTPError, not as an answer."""
    from megatron_rl.rollout.client import SGLangHTTPError

    with pytest.raises(SGLangHTTPError) as e:
        gen.server.client.generate({"input_ids": [5] * 5000, "sampling_params": GREEDY})
    assert e.value.status == 400


def test_sampled_group_is_streamed_as_rollouts(gen):
    gen.submit("s", PROMPTS[0], sampling={"temperature": 1.0, "max_new_tokens": 6})  # G from config
    rs = sorted(gen.completions(timeout=120), key=lambda r: r.sample_index)
    assert [r.sample_index for r in rs] == [0, 1]
    for r in rs:
        assert 1 <= len(r.completion_ids) <= 6 and r.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in r.behaviour_logprobs)


def test_trainer_scores_samples_at_their_temperature(gen, hf, tiny_llama_dir):
    """Samples at T=0.7 from the real server, before any update: the Megatron trainer's logprobs (logits
    divided by the temperature the rollout carries) equal SGLang's behaviour logprobs, ratio 1 within
    float tolerance; at T=1 (the bug this guards against) they would not."""
    import dataclasses

    from megatron_rl.records import TrainSequence
    from support.policies import make_trainer

    gen.submit("t", PROMPTS[1], group_size=4, sampling={"temperature": 0.7, "max_new_tokens": 16,
                                                        "ignore_eos": True})
    rollouts = list(gen.completions(timeout=120))
    assert len(rollouts) == 4 and all(r.temperature == 0.7 for r in rollouts)
    seqs = [TrainSequence(r.prompt_ids + r.completion_ids, len(r.prompt_ids), r.behaviour_logprobs,
                          advantage=float(i % 2) - 0.5, temperature=r.temperature) for i, r in enumerate(rollouts)]
    trainer = make_trainer(tiny_llama_dir, micro_batch_tokens=256)
    m = trainer.evaluate(seqs)
    assert m["ratio_min"] == pytest.approx(1.0, abs=3e-3) and m["ratio_max"] == pytest.approx(1.0, abs=3e-3)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    untempered = trainer.evaluate([dataclasses.replace(s, temperature=1.0) for s in seqs])
    assert max(abs(untempered["ratio_max"] - 1.0), abs(untempered["ratio_min"] - 1.0)) > 0.05


def test_sync_two_senders_matches_hf_with_new_weights(gen, hf):
    new = perturbed(hf, seed=1)
    tensors = named(new)
    half = len(tensors) // 2  # two "pipeline stages", each sending its own tensors
    senders = [WeightSender(r, [target_of(gen)], bucket_mb=0.05) for r in range(2)]
    v = next(_versions)
    report = push_in_process([gen], [(senders[0], tensors[:half]), (senders[1], tensors[half:])], v,
                          expected_names=[n for n, _ in tensors])
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    assert all(r.buckets > 1 for r in report.reports)  # really bucketed
    assert gen.server.client.weight_version() == str(v)
    assert_matches_hf(gen, new, v)
    gen._test_state = {"model": new, "senders": senders}


def test_inflight_request_spans_two_versions(gen, hf):
    state = gen._test_state
    old, new = state["model"], perturbed(hf, seed=2)
    v_old, v = gen.version, next(_versions)
    gen.submit("long", PROMPTS[0], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 400,
                                                            "ignore_eos": True})
    gen.submit("short", PROMPTS[1], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 8})
    short = gen.get(timeout=120)
    assert short.group_id == "short"  # the long one is decoding now, with tokens under v_old
    push_in_process([gen], [(state["senders"][0], named(new))], v)
    long = gen.get(timeout=300)
    assert long.group_id == "long" and long.finish_reason == "length"
    assert len(long.completion_ids) == 400
    k = long.weight_versions.index(v)
    assert 0 < k < 400 and long.weight_versions == [v_old] * k + [v] * (400 - k)
    # tokens before the switch are exactly the old model's greedy continuation
    assert long.completion_ids[:k] == hf_greedy(old, PROMPTS[0], k)
    # logprobs are the old model's up to the switch; the token tagged v is the first one sampled
    # by the new weights (on the old KV cache), so its logprob differs from the old model's
    ref_old = hf_logprobs(old, PROMPTS[0], long.completion_ids[:k + 1])
    torch.testing.assert_close(torch.tensor(long.behaviour_logprobs[:k]), ref_old[:k], atol=3e-3, rtol=1e-3)
    assert abs(long.behaviour_logprobs[k] - ref_old[k].item()) > 1e-2
    state["model"] = new


def test_prefix_cache_not_reused_across_versions(gen, hf):
    """A prompt cached under version v must not serve requests of version v+1, even though a
    running request makes SGLang refuse to flush the cache during the update."""
    state = gen._test_state
    new, v = perturbed(hf, seed=3), next(_versions)
    c = gen.server.client
    prompt = PROMPTS[1]
    gen.submit("warm", prompt, group_size=1, sampling=GREEDY)  # cached under the current version
    list(gen.completions(timeout=120))
    gen.submit("long", PROMPTS[0], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 300,
                                                            "ignore_eos": True})
    gen.submit("short", PROMPTS[1], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 4})
    assert gen.get(timeout=120).group_id == "short"
    assert not c.flush_cache()  # what SGLang allows: no flush while a request runs
    old_salt = gen.cache.salt()
    push_in_process([gen], [(state["senders"][0], named(new))], v)
    probe = c.generate({"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True,
                        "cache_salt": gen.cache.salt()})
    assert probe["meta_info"]["cached_tokens"] == 0  # salts isolate the epochs
    kept = c.generate({"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True,
                       "cache_salt": old_salt})
    assert kept["meta_info"]["cached_tokens"] > 0  # in_place does not flush: the old entry is only unreachable
    gen.submit("after", prompt, group_size=1, sampling=GREEDY)
    gen.submit("after2", PROMPTS[0], group_size=1, sampling=GREEDY)
    rs = {r.group_id: r for r in gen.completions(timeout=300)}
    assert rs["after"].completion_ids == hf_greedy(new, prompt, GREEDY["max_new_tokens"])
    assert rs["long"].weight_versions[-1] == v
    state["model"] = new


def test_in_place_update_of_an_idle_generator_does_not_flush(gen, hf):
    """SGLang's flush runs gc.collect (CPU) / empty_cache (CUDA) inside the update's pause, and the
    cache salt already hides the old epoch: an in_place update leaves the old entries in place."""
    state = gen._test_state
    new, v = perturbed(hf, seed=6), next(_versions)
    c = gen.server.client
    gen.submit("warm", PROMPTS[1], group_size=1, sampling=GREEDY)
    list(gen.completions(timeout=120))
    assert gen.in_flight == 0
    old_salt = gen.cache.salt()
    push_in_process([gen], [(state["senders"][0], named(new))], v)
    kept = c.generate({"input_ids": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True,
                       "cache_salt": old_salt})
    assert kept["meta_info"]["cached_tokens"] >= len(PROMPTS[1]) - 1  # not flushed
    gen.submit("after", PROMPTS[1], group_size=1, sampling=GREEDY)
    (after,) = gen.completions(timeout=120)
    assert after.completion_ids == hf_greedy(new, PROMPTS[1], GREEDY["max_new_tokens"])
    state["model"] = new


def test_retract_mode_reprefills_with_new_weights(gen, hf):
    state = gen._test_state
    new, v_old, v = perturbed(hf, seed=4), gen.version, next(_versions)
    gen.submit("long", PROMPTS[0], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 300,
                                                            "ignore_eos": True})
    gen.submit("short", PROMPTS[1], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 4})
    assert gen.get(timeout=120).group_id == "short"
    old_salt = gen.cache.salt()
    push_in_process([gen], [(state["senders"][0], named(new))], v, mode="retract")
    probe = gen.server.client.generate({"input_ids": PROMPTS[1], "sampling_params": GREEDY,
                                        "return_logprob": True, "cache_salt": old_salt})
    # retract flushed (at most the BOS token may match: the retracted request re-prefills under the old salt)
    assert probe["meta_info"]["cached_tokens"] <= 1
    long = gen.get(timeout=300)
    k = long.weight_versions.index(v)
    assert 0 < k < 300 and set(long.weight_versions[:k]) == {v_old}
    # after re-prefill with the new weights, every later logprob is the new model's, exactly
    ref = hf_logprobs(new, PROMPTS[0], long.completion_ids)
    torch.testing.assert_close(torch.tensor(long.behaviour_logprobs[k:]), ref[k:], atol=3e-3, rtol=1e-3)
    state["model"] = new


def test_failed_update_is_detected_and_retried(gen, hf):
    state = gen._test_state
    sender = state["senders"][0]
    old, new, v = state["model"], perturbed(hf, seed=5), next(_versions)
    tensors = named(new)
    bad = list(tensors)
    name, t = bad[3]
    bad[3] = (name, t.reshape(-1)[: t.numel() // 2].clone())  # wrong shape: SGLang's loader rejects it
    with pytest.raises(WeightSyncError):
        push_in_process([gen], [(sender, bad)], v)
    assert gen.server.client.weight_version() != str(v)  # never stamped
    # a partial update (a stage that did not send) is rejected too, before any version is stamped
    with pytest.raises(WeightSyncError, match="partial update"):
        push_in_process([gen], [(sender, tensors[:5])], v, expected_names=[n for n, _ in tensors])
    # retry in the same open session with the full, correct weights: consistent again
    push_in_process([gen], [(sender, tensors)], v, expected_names=[n for n, _ in tensors])
    assert_matches_hf(gen, new, v)
    state["model"] = new
    del old


def test_killed_server_is_restarted_and_samples_reissued(gen, hf):
    """Recovery policy: restart from disk (version 0), re-issue unfinished samples, ask for a sync."""
    state = gen._test_state
    gen.submit("k", PROMPTS[0], group_size=3, sampling={"temperature": 0.0, "max_new_tokens": 300,
                                                         "ignore_eos": True})
    gen.submit("short", PROMPTS[1], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 4})
    assert gen.get(timeout=120).group_id == "short"
    inc = gen.incarnation
    gen.server.kill_for_test()
    rs = list(gen.completions(timeout=300))
    assert gen.incarnation == inc + 1 and gen.needs_weight_sync
    assert sorted(r.sample_index for r in rs) == [0, 1, 2]
    for r in rs:  # re-issued from scratch on the restarted server: disk weights, version 0
        assert len(r.completion_ids) == 300 and r.weight_versions == [0] * 300
        assert r.completion_ids[:20] == hf_greedy(hf, PROMPTS[0], 20)
    # the sender notices the new incarnation, opens a fresh group and the sync works again
    v = next(_versions)
    push_in_process([gen], [(state["senders"][0], named(state["model"]))], v)
    assert not gen.needs_weight_sync
    assert_matches_hf(gen, state["model"], v)


def test_a_request_queued_across_an_update_is_sampled_again_under_the_new_weights(tiny_llama_dir, tmp_path, hf):
    """A request sent before an in_place update that the server had not started (queued behind another:
    --max-running-requests 1) would be prefilled after it with the old cache salt, on the prompt KV the
    old weights computed for the running request of the same prompt, while its tokens carry the new
    version. The generator aborts it when the update begins and sends it again after: its tokens are the
    new weights' greedy ones, with their logprobs."""
    new = perturbed(hf, seed=7)
    prompt = PROMPTS[1]
    with running_generator(tiny_llama_dir, tmp_path, threads=1, extra_args=["--max-running-requests", "1"]) as g:
        sender = WeightSender(0, [target_of(g)], bucket_mb=0.05)
        g.submit("long", prompt, group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 3000,
                                                          "ignore_eos": True})
        deadline = time.time() + 120
        while g.tokens_streamed == 0:  # its prefill put the prompt's KV in the radix cache
            assert time.time() < deadline
            time.sleep(0.05)
        g.submit("queued", prompt, group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 8,
                                                            "ignore_eos": True})
        time.sleep(1.0)  # in the server's waiting queue
        push_in_process([g], [(sender, named(new))], 1)
        rs = {r.group_id: r for r in g.completions(timeout=600)}
    q = rs["queued"]
    assert q.weight_versions == [1] * 8
    assert q.completion_ids == hf_greedy(new, prompt, 8)
    torch.testing.assert_close(torch.tensor(q.behaviour_logprobs), hf_logprobs(new, prompt, q.completion_ids),
                               atol=3e-3, rtol=1e-3)
    assert rs["long"].weight_versions[0] == 0 and rs["long"].weight_versions[-1] == 1  # it went on in place
