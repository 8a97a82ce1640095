"""System-prompt templates used by rollouts (Magistral's format and language instructions).

A template is a system prompt plus an optional assistant prefix that is placed after the generation
prompt (e.g. "<think>\n" to start the model inside its reasoning block). The prefix is part of the
prompt tokens, so the response that the verifier grades is `prefix + completion`.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.records import Problem


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    system: str | None
    assistant_prefix: str = ""


_FORMAT = (
    "A user will ask you to solve a task. You should first draft your thinking process (inner "
    "monologue) until you have derived the final answer. Afterwards, write a self-contained summary "
    "of your thoughts (i.e. your summary should be succinct but contain all the critical steps you "
    "needed to reach the conclusion).\n\n"
    "Your thinking process must follow the template below:\n"
    "<think>\nYour thoughts and/or draft, like working through an exercise on scratch paper. Be as "
    "casual and as long as you want until you are confident to generate a correct answer.\n</think>\n\n"
    "Here, provide a concise summary that reflects your reasoning and presents a clear final answer "
    "to the user. For a math problem, put the final answer in \\boxed{{}}. For a coding problem, give "
    "the full program in one fenced code block with its language tag (```python or ```cpp).\n\n"
    "Problem:\n\n{problem}")

_LANGUAGE = ("Write both your thinking process and your summary in the same language as the task "
             "posed by the user. ")

TEMPLATES: dict[str, PromptTemplate] = {
    # Magistral-style: format + "reason in the user's language"; the instructions live in the system
    # prompt (the report found RL sensitive to it: it raises entropy and exploration).
    "magistral": PromptTemplate("magistral", _LANGUAGE + _FORMAT.replace("Problem:\n\n{problem}", "")),
    # Same, starting the model inside its reasoning block: helps very small models find the format.
    "magistral_prefill": PromptTemplate("magistral_prefill", _LANGUAGE + _FORMAT.replace("Problem:\n\n{problem}", ""),
                                        assistant_prefix="<think>\n"),
    # Compact instructions for tiny models and the CPU demo.
    "short": PromptTemplate("short", "Think inside <think> </think>, then give the final answer in \\boxed{}.",
                            assistant_prefix="<think>\n"),
    "none": PromptTemplate("none", None),
}


def get_template(name: str) -> PromptTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown prompt template {name!r} (known: {', '.join(TEMPLATES)})") from None


def build_messages(problem: Problem, template: PromptTemplate) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": template.system}] if template.system else []
    return messages + [{"role": "user", "content": problem.prompt}]


def render_prompt_ids(tokenizer, problem: Problem, template: PromptTemplate) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the template's assistant prefix."""
    messages = build_messages(problem, template)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer(text + template.assistant_prefix, add_special_tokens=False).input_ids
