"""Tools against a real SGLang server (CPU) serving the tiny random Llama fixture.

- translate: requests go through SGLang's OpenAI-compatible /v1/chat/completions; the random model
  answers gibberish, so every translation must be rejected as wrong-language and counted, and the
  output problems (answers included) must equal the input;
- difficulty filtering / evaluation: k completions per problem sampled through the project's
  Generator (real prompts, chat template, token ids), graded for real; nothing the random model
  writes is correct, so every problem has pass rate 0 and is dropped as too hard.
"""
import pytest

from megatron_rl.config import GeneratorConfig, RolloutConfig
from megatron_rl.records import Problem


@pytest.fixture(scope="module")
def generator(tiny_llama_dir, tmp_path_factory):
    from support.net import free_port

    from megatron_rl.evaluation.sampling import open_generator

    gen = open_generator(str(tiny_llama_dir), free_port(), RolloutConfig(group_size=2, n_async=8, n_batch=2, n_mini=1),
                         GeneratorConfig(max_total_tokens=4096), max_concurrency=8, threads=1,
                         log_path=str(tmp_path_factory.mktemp("sglang") / "server.log"))
    yield gen
    gen.close()


def _problems():
    return [Problem(f"p{i}", f"What is {i} plus {i}? Give the number.", {"kind": "math", "answer": str(2 * i)})
            for i in range(3)]


def test_translate_through_sglang_rejects_wrong_language(generator):
    from megatron_rl.data.translate import ChatClient, translate_problems

    client = ChatClient(generator.server.url, max_tokens=12, temperature=0.0)
    problems = _problems()
    report = translate_problems(problems, client, fraction=1.0, languages=["fr", "zh", "ru"], workers=3)
    assert report.selected == 3
    assert report.accepted == 0 and sum(report.rejected.values()) == 3
    assert all(r["detected"] != r["target"] for r in report.rejections)
    assert report.problems == problems


def test_difficulty_filter_samples_through_the_generator(generator, tiny_llama_dir):
    from transformers import AutoTokenizer

    from megatron_rl.evaluation.scoring import summarize
    from megatron_rl.data.filter_difficulty import difficulty_filter
    from megatron_rl.evaluation.sampling import GeneratorSampler

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sampler = GeneratorSampler(generator, tok, "short", {"temperature": 1.0, "max_new_tokens": 8},
                               progress=False)
    samples = sampler.sample(_problems(), 2)
    assert all(len(cs) == 2 and all(c.response.startswith("<think>\n") and 1 <= c.num_tokens <= 8 for c in cs)
               for cs in samples.values())
    report = difficulty_filter(_problems(), sampler, k=2, min_pass=0.25, max_pass=0.75, workers=1)
    assert report.summary() == {"problems": 3, "kept": 0, "too_easy": 0, "too_hard": 3}
    assert all(r["n_samples"] == 2 and r["pass_rate"] == 0.0 for r in report.all_rows)
