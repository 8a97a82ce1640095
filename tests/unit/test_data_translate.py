"""Translation tool against a local OpenAI-compatible endpoint (stdlib HTTP server on 127.0.0.1)
whose answers are fixed per target language: real fastText language checks decide acceptance."""
import json

import pytest

from megatron_rl.records import Problem
from megatron_rl.data.translate import ChatClient, EndpointError, translate_problems
from support.chat_endpoint import ChatEndpoint

ANSWERS = {  # target language named in the system prompt -> what the endpoint answers
    "French": "Combien de pommes reste-t-il si l'on mange trois pommes sur un panier de dix pommes ?",
    "German": "Wie viele Äpfel bleiben übrig, wenn man drei von zehn Äpfeln im Korb isst?",
    "Spanish": "How many apples are left if you eat three apples from a basket of ten?",  # wrong language
}


def _answer_in_the_asked_language(body: dict) -> tuple[int, str]:
    system = body["messages"][0]["content"]
    return 200, next(v for k, v in ANSWERS.items() if k in system)


@pytest.fixture
def endpoint():
    server = ChatEndpoint(_answer_in_the_asked_language)
    yield server
    server.close()


def _problems(n=6):
    return [Problem(f"p{i}", f"Ten apples, eat {i}. How many are left?",
                    {"kind": "math", "answer": str(10 - i), "problem": f"Ten apples, eat {i}."}) for i in range(n)]


def test_accepts_right_language_rejects_wrong_one_and_keeps_answers(endpoint):
    client = ChatClient(endpoint.url, model="m")
    problems = _problems()
    report = translate_problems(problems, client, fraction=0.5, languages=["fr", "de", "es"], seed=1)
    assert report.selected == 3 and len(endpoint.requests) == 3
    assert all(path == "/v1/chat/completions" for path, _ in endpoint.requests)
    assert all(b["messages"][1]["content"].startswith("Ten apples") for _, b in endpoint.requests)
    assert all("answer" not in json.dumps(b) or "answer" in b["messages"][0]["content"] for _, b in endpoint.requests)
    assert report.accepted == 2 and report.rejected == {"wrong_language": 1}
    assert report.rejections[0]["target"] == "es" and report.rejections[0]["detected"] == "en"
    assert dict(report.by_language) == {"fr": 1, "de": 1}
    assert report.problems[:6] == problems  # mode add: originals first, untouched
    new = report.problems[6:]
    assert {p.language for p in new} == {"fr", "de"}
    for p in new:
        orig = next(o for o in problems if p.problem_id.startswith(o.problem_id + "-"))
        assert p.task["answer"] == orig.task["answer"] and p.task["problem"] == p.prompt != orig.prompt


def test_replace_mode_and_validation(endpoint):
    client = ChatClient(f"{endpoint.url}/v1")
    problems = _problems(4)
    report = translate_problems(problems, client, fraction=1.0, languages=["fr"], mode="replace")
    assert len(report.problems) == 4 and all(p.language == "fr" for p in report.problems)
    assert [p.task["answer"] for p in report.problems] == [p.task["answer"] for p in problems]
    with pytest.raises(ValueError):
        translate_problems(problems, client, languages=["xx"])
    with pytest.raises(ValueError):
        translate_problems(problems, client, fraction=1.5)


def test_unreachable_endpoint_is_a_clear_error(free_port):
    with pytest.raises(EndpointError):
        ChatClient(f"http://127.0.0.1:{free_port}", timeout_s=2, retries=2, backoff_s=0.01).chat(
            [{"role": "user", "content": "hi"}])


def test_a_small_fraction_of_a_small_file_still_translates_one(endpoint):
    # 10% of 4 problems rounds to 0: the run would write the input back and report success
    report = translate_problems(_problems(4), ChatClient(endpoint.url), fraction=0.1, languages=["fr"])
    assert report.selected == 1 and report.accepted == 1 and len(endpoint.requests) == 1
    assert translate_problems(_problems(4), ChatClient(endpoint.url), fraction=0.0).selected == 0
