"""Format filtering (drop reasons, multiple-choice conversion), difficulty band filtering, CHAMP."""
import json

import pytest

from megatron_rl.records import Problem
from megatron_rl.data.filter_format import answer_verdict, classify, format_filter
from megatron_rl.evaluation.sampling import Completion

RAW = [
    ({"id": "ok", "problem": "Compute 6*7.", "answer": "42"}, None),
    ({"id": "frac", "problem": "Half of one?", "answer": "\\frac{1}{2}"}, None),
    ({"id": "proof", "problem": "Prove that there are infinitely many primes.", "answer": "infinitely many"}, "proof"),
    ({"id": "show", "problem": "Show that x^2 >= 0 for real x.", "answer": "0"}, "proof"),
    ({"id": "parts", "problem": "Let x = 2. (a) Compute x + 1. (b) Compute x^2.", "answer": "3"}, "multi_part"),
    ({"id": "roman", "problem": "(i) Find the root. (ii) Find its square.", "answer": "1"}, "multi_part"),
    ({"id": "mc_text", "problem": "What is 2 + 3? (A) 4 (B) 5 (C) 6", "answer": "B"}, None),
    ({"id": "mc_list", "problem": "What is 2 * 3?", "choices": ["5", "6"], "answer": "(B)"}, None),
    ({"id": "mc_which", "problem": "Which of the following is prime? (A) 4 (B) 7", "answer": "B"}, "multiple_choice"),
    ({"id": "mc_bad", "problem": "Pick one. (A) 1 (B) 2", "answer": "E"}, "multiple_choice"),
    # stems that select among their options have no answer without them (they would keep "9")
    ({"id": "mc_which_number", "problem": "Which number is a perfect square? (A) 7 (B) 9 (C) 11", "answer": "B"},
     "multiple_choice"),
    ({"id": "mc_these", "problem": "Is one of these a square?", "choices": ["7", "9"], "answer": "9"},
     "multiple_choice"),
    ({"id": "mc_colon", "problem": "The largest number:", "choices": ["3", "9", "5"], "answer": "B"},
     "multiple_choice"),
    ({"id": "none", "problem": "What is x?", "answer": ""}, "no_answer"),
    ({"id": "yes", "problem": "Is 7 prime?", "answer": "Yes"}, "guessable_answer"),
    ({"id": "prose", "problem": "Solve x^2 = -1 over the reals.", "answer": "There are no real solutions"},
     "answer_has_words"),
    ({"id": "junk", "problem": "Find y.", "answer": "\\frac{1}{"}, "unparseable_answer"),
]


def test_each_row_gets_the_expected_verdict():
    for row, want in RAW:
        reason, out = classify(row)
        assert reason == want, row["id"]
        assert (out is None) == (want is not None)


def test_multiple_choice_becomes_an_open_question():
    _, out = classify(RAW[6][0])
    assert out == {"id": "mc_text", "problem": "What is 2 + 3?", "answer": "5", "converted_from_multiple_choice": True}
    _, out = classify(RAW[7][0])
    assert out["answer"] == "6" and "choices" not in out


def test_report_counts_every_reason():
    report = format_filter([r for r, _ in RAW])
    want = {}
    for _, reason in RAW:
        if reason:
            want[reason] = want.get(reason, 0) + 1
    assert dict(report.dropped) == want
    assert len(report.kept) == sum(1 for _, r in RAW if r is None)
    assert report.converted_multiple_choice == 2
    s = report.summary()
    assert s["kept"] + s["dropped"] == len(RAW)


def test_answer_verdicts_follow_the_math_verifier():
    assert answer_verdict("x = \\pm 2") is None
    assert answer_verdict("\\{1, 2, 3\\}") is None
    assert answer_verdict("n(n+1)/2") is None
    assert answer_verdict("B") == "multiple_choice"
    assert answer_verdict("a" * 500) == "too_long_answer"
    assert answer_verdict(None) == "no_answer"


def test_format_cli_writes_jsonl_readable_as_problems(tmp_path, capsys):
    from megatron_rl.cli import main
    from megatron_rl.data.sources import read_jsonl

    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r, _ in RAW))
    out = tmp_path / "kept.jsonl"
    assert main(["filter", "format", str(raw), str(out), "--report", str(tmp_path / "r.json")]) == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["dropped_by_reason"]["proof"] == 2
    problems = read_jsonl(out)
    assert [p.problem_id for p in problems] == ["ok", "frac", "mc_text", "mc_list"]
    assert problems[2].task["answer"] == "5"
    assert main(["filter", "format", str(tmp_path / "missing.jsonl"), str(out)]) == 1


class FixedSampler:
    """Completions with a chosen number of correct answers per problem (graded for real)."""

    def __init__(self, n_correct: dict[str, int]):
        self.n_correct = n_correct

    def sample(self, problems, k):
        out = {}
        for p in problems:
            good = f"<think>easy</think>The answer is \\boxed{{{p.task['answer']}}}."
            bad = "<think>hmm</think>The answer is \\boxed{-1}."
            c = self.n_correct[p.problem_id]
            out[p.problem_id] = [Completion(good if i < c else bad) for i in range(k)]
        return out


def test_difficulty_filter_keeps_the_band():
    from megatron_rl.data.filter_difficulty import difficulty_filter

    problems = [Problem(f"p{c}", f"What is {c} + {c}?", {"kind": "math", "answer": str(2 * c)}, "en")
                for c in range(5)]
    n_correct = {"p0": 0, "p1": 1, "p2": 2, "p3": 3, "p4": 4}
    report = difficulty_filter(problems, FixedSampler(n_correct), k=4, min_pass=0.25, max_pass=0.75,
                               stage=2, workers=1)
    assert [r["id"] for r in report.kept] == ["p1", "p2", "p3"]
    assert [r["pass_rate"] for r in report.all_rows] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert report.summary() == {"problems": 5, "kept": 3, "too_easy": 1, "too_hard": 1}
    assert all(r["stage"] == 2 and r["n_samples"] == 4 for r in report.kept)
    with pytest.raises(ValueError):
        difficulty_filter(problems, FixedSampler(n_correct), 4, 0.8, 0.2)


def test_champ_problems_have_verifiable_answers():
    from megatron_rl.data.champ import champ_problems, clean_answer

    assert clean_answer("C(10, 5), or equivalently 252") == "252"
    problems = champ_problems()
    assert 100 < len(problems) < 270  # some free-form answers are dropped
    assert all(answer_verdict(p.task["answer"]) is None for p in problems)
    assert len({p.problem_id for p in problems}) == len(problems)
