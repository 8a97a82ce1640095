"""pass@1 / pass@k (vs exact enumeration), grading of math, stdin/stdout code and HumanEval samples
with the real verifiers, per-language breakdown, and the `megatron-rl evaluate` CLI on a samples file."""
import itertools
import json

import pytest

from megatron_rl.records import Problem
from megatron_rl.evaluation.scoring import grade_samples, pass_at_k, summarize
from megatron_rl.evaluation.sampling import Completion, FileSampler


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (4, 4, 3), (7, 1, 7)])
def test_pass_at_k_matches_enumeration_of_subsets(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


@pytest.mark.parametrize("n,c,k", [(10**9, 1, 1), (10**6, 10, 5 * 10**5), (10**7, 3, 10**6), (200, 150, 10),
                                   (1000, 999, 1), (64, 5, 64), (300, 7, 299)])
def test_pass_at_k_keeps_its_relative_precision_at_large_n(n, c, k):
    """Against exact rationals (the shorter product of 1 - C(n-c,k)/C(n,k)): small values keep their
    relative precision, and large n costs no exact binomials."""
    from fractions import Fraction

    miss = Fraction(1)
    for j in range(k if k < c else 0):
        miss *= Fraction(n - c - j, n - j)
    for i in range(n - c + 1, n + 1) if k >= c else ():
        miss *= Fraction(i - k, i)
    exact = 1 - miss
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def _humaneval(idx=2):
    from megatron_rl.data.humaneval import humaneval_problems

    return humaneval_problems(limit=idx + 1)[idx]


def _problems():
    he = _humaneval()
    return [
        Problem("m_en", "What is six times seven?", {"kind": "math", "answer": "42", "problem": "What is six times seven?"}),
        Problem("m_fr", "Combien font trois plus quatre ? Donnez le résultat.",
                {"kind": "math", "answer": "7"}, "fr"),
        Problem("c_en", "Read two integers and print their sum.",
                {"kind": "code", "language": "python", "tests": [{"input": "1 2\n", "output": "3\n"}]}, "en"),
        he,
    ]


def _responses(he):
    sol = he.task["meta"]["prompt"] + he.task["meta"]["canonical_solution"]
    return {
        "m_en": ["<think>6*7</think>\\boxed{42}", "<think>6*7</think>\\boxed{41}", "no think \\boxed{42}",
                 "<think>x</think>\\boxed{42.0}"],  # correct, wrong, format fail, correct
        "m_fr": ["<think>3+4</think>\\boxed{7}"] * 2 + ["<think>3+4</think>\\boxed{8}"] * 2,
        "c_en": ["<think>sum</think>```python\na, b = map(int, input().split())\nprint(a + b)\n```",
                 "<think>sum</think>```python\nprint(0)\n```"] * 2,
        he.problem_id: [f"<think>ok</think>```python\n{sol}```", "```python\ndef truncate_number(n):\n    return 0\n```",
                        f"```python\n{sol}```", "I do not know"],
    }


def test_grading_counts_and_metrics():
    problems = _problems()
    responses = _responses(problems[-1])
    samples = {pid: [Completion(r) for r in rs] for pid, rs in responses.items()}
    rows = grade_samples(problems, samples, workers=1)
    by_id = {r.problem_id: r for r in rows}
    assert [by_id[p].correct for p in ("m_en", "m_fr", "c_en", problems[-1].problem_id)] == [2, 2, 2, 2]
    assert by_id["m_en"].format_ok == 3
    assert by_id[problems[-1].problem_id].statuses == {"ok": 2, "wrong_answer": 1, "no_code": 1}
    assert by_id["m_fr"].language == "fr" and by_id["m_en"].language == "en"
    s = summarize(rows, [1, 2])
    assert s["pass@1"] == pytest.approx(0.5)
    assert s["pass@2"] == pytest.approx(1 - 1 / 6)  # every problem: n=4, c=2 -> 1 - C(2,2)/C(4,2)
    assert set(s["by_language"]) == {"en", "fr"}
    assert s["by_language"]["fr"]["problems"] == 1 and s["by_language"]["en"]["problems"] == 3


def test_humaneval_ships_164_problems_and_grades_them_honestly():
    from megatron_rl.data.humaneval import grade, humaneval_problems

    problems = humaneval_problems()
    assert len(problems) == 164
    p = problems[0]
    sol = p.task["meta"]["prompt"] + p.task["meta"]["canonical_solution"]
    assert grade(p.task, f"```python\n{sol}```").passed
    # printing what a fixed-output harness would expect does not pass
    assert not grade(p.task, "```python\nprint('OK')\nraise SystemExit(0)\n```").passed
    # only the body (completion style): the prompt is prepended
    assert grade(p.task, f"```python\n{p.task['meta']['canonical_solution']}```").passed


def test_evaluate_cli_on_a_samples_file(tmp_path, capsys):
    from megatron_rl.cli import main

    problems = _problems()[:2]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": p.problem_id, "prompt": p.prompt, "task": p.task,
                                        **({"lang": p.language} if p.language else {})}) + "\n" for p in problems))
    responses = _responses(_humaneval())
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"problem_id": pid, "response": r}) + "\n"
                               for pid in ("m_en", "m_fr") for r in responses[pid]))
    out = tmp_path / "results.jsonl"
    rc = main(["evaluate", "--path", str(data), "--samples", str(samples), "--n", "4", "--k", "1,4",
               "--out", str(out), "--workers", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pass@1"] == pytest.approx(0.5) and summary["pass@4"] == pytest.approx(1.0)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["correct"] for r in rows] == [2, 2]
    assert main(["evaluate", "--path", str(data), "--samples", str(samples), "--n", "5"]) == 1  # too few
    assert main(["evaluate", "--path", str(data), "--samples", str(samples), "--n", "2", "--k", "3"]) == 1


def test_file_sampler_rejects_bad_lines(tmp_path):
    bad = tmp_path / "s.jsonl"
    bad.write_text('{"problem_id": "a"}\n')
    with pytest.raises(ValueError, match="s.jsonl:1"):
        FileSampler(bad)


def _enumerated_pass_at_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_summary_per_kind_and_language_matches_enumeration_and_leaves_ungradable_samples_out():
    import random

    from megatron_rl.evaluation.scoring import Verdict, problem_result

    rng = random.Random(3)
    k, n = 3, 5
    problems, verdicts = [], {}
    for i in range(12):
        kind, lang = ("math", "code")[i % 2], ("en", "fr", "de")[i % 3]
        problems.append(Problem(f"p{i}", "q", {"kind": kind}, lang))
        vs = [Verdict(rng.random() < 0.4, True, 1.0, "ok") for _ in range(n)]
        for j in rng.sample(range(n), rng.choice([0, 0, 1, 3])):  # grading failed: a crash, not a wrong answer
            vs[j] = Verdict(False, False, None, "crash", gradable=False)
        verdicts[f"p{i}"] = vs
    rows = [problem_result(p, verdicts[p.problem_id]) for p in problems]
    summary = summarize(rows, [1, k])

    def reference(selected):
        outcomes = [[v.correct for v in verdicts[p.problem_id] if v.gradable] for p in selected]
        graded = [o for o in outcomes if o]
        enough = [o for o in graded if len(o) >= k]
        return {"pass@1": sum(_enumerated_pass_at_k(o, 1) for o in graded) / len(graded),
                f"pass@{k}": sum(_enumerated_pass_at_k(o, k) for o in enough) / len(enough),
                "samples": sum(map(len, outcomes)),
                "ungradable": sum(not v.gradable for p in selected for v in verdicts[p.problem_id])}

    groups = {"": problems}
    groups |= {f"kind/{kind}": [p for p in problems if p.task["kind"] == kind] for kind in ("math", "code")}
    groups |= {f"lang/{lang}": [p for p in problems if p.language == lang] for lang in ("en", "fr", "de")}
    for name, selected in groups.items():
        got = summary if not name else summary["by_kind" if name.startswith("kind") else "by_language"][name.split("/")[1]]
        want = reference(selected)
        assert got["samples"] + got["ungradable"] == n * len(selected)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-12), (name, key)
    assert summary["ungradable"] > 0 and any(r.n < k for r in rows)  # the case the fix is about is covered


def test_a_cpu_user_is_told_before_the_server_starts_how_to_keep_it_small(monkeypatch, caplog):
    """getting_started's old step 5 (164 HumanEval problems x 16 samples x 4096 tokens) ran on 2 cores for
    10 minutes without a word; its new settings stay below the warning."""
    import logging

    from megatron_rl.cli import evaluate

    monkeypatch.setattr("megatron_rl.platform.has_cuda", lambda: False)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.cli.evaluate"):
        evaluate._warn_if_slow_on_cpu(4, 4, 128)
        assert not caplog.records
        evaluate._warn_if_slow_on_cpu(164, 16, 4096)
    (record,) = caplog.records
    assert "10747904 new tokens" in record.getMessage() and evaluate.QUICK in record.getMessage()


def test_evaluate_refuses_an_unknown_template_in_one_line_before_sampling(tmp_path):
    """The config checks that run code (pre-flight's check_config) run for evaluate as for train."""
    import subprocess
    import sys

    problems = tmp_path / "p.jsonl"
    problems.write_text('{"id": "a", "prompt": "1+1?", "answer": "2"}\n')
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "evaluate", "--source", "jsonl", "--path",
                           str(problems), "--n", "1", "--k", "1", "data.system_prompt=no_such_template"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "data.system_prompt: unknown prompt template 'no_such_template'" in lines[0], lines


def test_the_sampling_line_shows_tokens_and_the_time_left_at_most(monkeypatch):
    """Between completions (which all end near the end) the line shows tokens streamed, tok/s and the
    time left if every unfinished completion ran to max_new_tokens at this pace."""
    from megatron_rl.records import Rollout
    from megatron_rl.evaluation import sampling

    def rollout(group_id, n):
        return Rollout(group_id, 0, [1], [7] * n, [-0.5] * n, [0] * n, "stop")

    class Generator:
        """Each tick of the sampler reads in_flight, then get(): a scripted (clock, tokens, busy, rollout)."""
        now, tokens_streamed = 0.0, 0
        script = iter([(10.0, 50, 2, None), (20.0, 60, 2, rollout("a", 30)), (30.0, 90, 1, rollout("b", 60)),
                       (31.0, 90, 0, None)])

        def submit(self, *args, **kwargs):
            pass

        @property
        def in_flight(self):
            self.now, self.tokens_streamed, busy, self.next = next(self.script)
            return busy

        def get(self, timeout):
            return self.next

    gen = Generator()
    monkeypatch.setattr(sampling.time, "monotonic", lambda: gen.now)
    monkeypatch.setattr("megatron_rl.data.prompts.render_prompt_ids", lambda tokenizer, p, template: [1])
    shown = []
    monkeypatch.setattr(sampling.Progress, "set_postfix", lambda self, text: shown.append(text))
    tokenizer = type("Tokenizer", (), {"decode": lambda self, ids, skip_special_tokens: "x" * len(ids)})()
    sampler = sampling.GeneratorSampler(gen, tokenizer, "short", {"max_new_tokens": 100}, progress=False)
    out = sampler.sample([Problem("a", "?", {}), Problem("b", "?", {})], 1)
    assert [c.num_tokens for c in (out["a"][0], out["b"][0])] == [30, 60]
    # 50 tokens in 10 s, 200 - 50 to come; then b unfinished with 30 streamed: 70 at 3 tok/s; then none
    assert shown == ["50 tokens, 5 tok/s, at most 00:30 left", "60 tokens, 3 tok/s, at most 00:23 left",
                     "90 tokens, 3 tok/s, at most 00:00 left", "90 tokens, 3 tok/s, at most 00:00 left"]
