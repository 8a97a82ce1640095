"""System-prompt templates used by rollouts (Magistral's format and language instructions).

A template is a system prompt plus an optional assistant prefix that is placed after the generation
prompt (e.g. "<think>\n" to start the model inside its reasoning block). The prefix is part of the
prompt tokens, so the response that the verifier grades is `prefix + completion`. The `data` config
picks one (`data.system_prompt`: a name below or the text itself; `data.system_prompt_file`) and
adds keyword arguments for the tokenizer's chat template (`data.chat_template_kwargs`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.data import DataConfig
from megatron_rl.records import Problem


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    system: str | None
    assistant_prefix: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # for tokenizer.apply_chat_template


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
    # `short` for the python tool environment (env.name: python): the tool-call format is spelled out
    # here because small models' chat templates (SmolLM2's) do not render the `tools=` schemas.
    "short_python": PromptTemplate(
        "short_python", "Think inside <think> </think>, then give the final answer in \\boxed{}. To compute, call "
        "the Python tool: <tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(...)\"}}</tool_call>; "
        "what it prints comes back in a tool message.", assistant_prefix="<think>\n"),
    "none": PromptTemplate("none", None),
}


def get_template(spec: str | DataConfig) -> PromptTemplate:
    """A template by name, the system prompt's own text (a string holding whitespace), or what a `data`
    config asks for (its system_prompt, system_prompt_file and chat_template_kwargs)."""
    if isinstance(spec, DataConfig):
        return _configured(spec)
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if any(c.isspace() for c in spec.strip()):  # a name never holds whitespace: this is the text
        return PromptTemplate("text", spec)
    raise ValueError(f"unknown prompt template {spec!r} (known: {', '.join(TEMPLATES)}; or give the system "
                     f"prompt's text, or data.system_prompt_file)")


def _configured(cfg: DataConfig) -> PromptTemplate:
    template = get_template(cfg.system_prompt)
    if cfg.system_prompt_file:
        path = Path(cfg.system_prompt_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"data.system_prompt_file {str(path)!r}: cannot read it as UTF-8 text ({e})") from None
        if not text.strip():
            raise ValueError(f"data.system_prompt_file {str(path)!r} is empty")
        template = dataclasses.replace(template, name=f"file:{path.name}", system=text.strip())
    return dataclasses.replace(template, chat_template_kwargs=dict(cfg.chat_template_kwargs))


def build_messages(problem: Problem, template: PromptTemplate) -> list[dict[str, str]]:
    """The problem's chat messages (or its prompt as the user message), with the template's system
    prompt first unless the problem brings its own."""
    messages = [dict(m) for m in problem.messages] if problem.messages else [{"role": "user", "content": problem.prompt}]
    if template.system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": template.system})
    return messages


def render_prompt_ids(tokenizer, problem: Problem, template: PromptTemplate) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the template's assistant prefix."""
    messages = build_messages(problem, template)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **template.chat_template_kwargs)
    elif template.chat_template_kwargs:
        raise ValueError(f"data.chat_template_kwargs {template.chat_template_kwargs} given, but the tokenizer "
                         f"has no chat template to pass them to")
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer(text + template.assistant_prefix, add_special_tokens=False).input_ids
