"""Token ids between the model's turns of an episode, taken from the model's chat template once.

An episode's context grows only by what the model sampled (its turn, stop token included) and by the
tokens of what the environment answered. The sampled ids are never decoded and encoded again (a BPE
round trip is not exact), and the history is never re-rendered: chat templates are not append-only
(Qwen3 renders the last assistant message with an empty <think> block, earlier ones without; other
templates strip reasoning or re-format tool calls), so a re-rendered history is not the context the
model sampled in. What is trained is exactly what was sampled and seen.

The observation's ids are the template's own rendering of what follows an assistant turn: the
conversation `[system, user, assistant(MARKER), *observation]` is rendered with the generation prompt,
and the text after the assistant turn's end-of-turn token is encoded once. That text starts right after
a special token, where BPE cannot merge across, so its ids are the ones the whole render would have.
When a turn ended without its stop token (the per-turn cap cut it), the stop token is put first: it is
an environment token (no loss), so the context reads as the template would have it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.data.prompts import PromptTemplate

# Content of the placeholder turns: text no template rewrites (no tags, no surrounding whitespace).
_MARKER = "MEGATRONRLTURNMARKER"


class TemplateError(ValueError):
    """The chat template cannot continue an episode append-only (named in the message)."""


@dataclass
class ChatTurns:
    """Observation ids for episodes of one tokenizer and prompt template.

    `stop_ids`: the token ids that end a model turn (the generator stops on them and returns them);
    default: the tokenizer's eos token."""

    tokenizer: object
    template: PromptTemplate
    stop_ids: tuple[int, ...] = ()
    _stop_text: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise TemplateError("episodes need a tokenizer with a chat template (observations are chat messages)")
        if not self.stop_ids:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if eos is None:
                raise TemplateError("the tokenizer has no eos token: give the turn stop ids")
            self.stop_ids = (eos,)
        self._stop_text = {i: self.tokenizer.decode([i]) for i in self.stop_ids}

    def ends_turn(self, ids: list[int]) -> bool:
        """A model turn of these sampled ids ended as the template ends a turn: with one of `stop_ids` (a turn
        that stopped on another token, e.g. the tokenizer's eos, or was cut by its cap did not)."""
        return bool(ids) and ids[-1] in self.stop_ids

    def observation_ids(self, messages: list[dict[str, str]], turn_stopped: bool = True) -> list[int]:
        """Ids that follow a model turn when the environment answers with `messages` (chat messages,
        e.g. one {"role": "tool", ...}): the rest of the end of the turn, the messages as the template
        renders them, the generation prompt and the template's assistant prefix. `turn_stopped`: the
        turn ended with a stop id (`ends_turn`; else the first stop id is put before them)."""
        if not messages:
            raise TemplateError("an observation needs at least one message")
        stop_id, tail = self._after_turn(messages)
        lead = [] if turn_stopped else [stop_id]
        return lead + self.tokenizer(tail + self.template.assistant_prefix, add_special_tokens=False).input_ids

    def prompt_ids_with(self, prompt_ids: list[int], messages: list[dict[str, str]]) -> list[int]:
        """`prompt_ids` (a rendered prompt, ending with the generation prompt and assistant prefix) with
        `messages` (what an environment shows before the first turn) rendered after the prompt's last
        message and before its generation prompt, as the template renders them."""
        if not messages:
            return list(prompt_ids)
        base = [{"role": "system", "content": _MARKER}, {"role": "user", "content": _MARKER}]
        closed = self._render(base, False)
        opened = self._render(base, True)
        extended = self._render(base + [dict(m) for m in messages], True)
        if not (opened.startswith(closed) and extended.startswith(closed)):
            raise TemplateError("the chat template renders a conversation's earlier messages differently once "
                                "more follow: the environment's first messages cannot be appended to the prompt")
        generation = self.tokenizer(opened[len(closed):] + self.template.assistant_prefix,
                                    add_special_tokens=False).input_ids
        if list(prompt_ids[len(prompt_ids) - len(generation):]) != generation:
            raise TemplateError("the prompt does not end with this template's generation prompt")
        tail = self.tokenizer(extended[len(closed):] + self.template.assistant_prefix, add_special_tokens=False)
        return list(prompt_ids[:len(prompt_ids) - len(generation)]) + tail.input_ids

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template.chat_template_kwargs)

    def _after_turn(self, messages: list[dict[str, str]]) -> tuple[int, str]:
        """(the stop id that ends an assistant turn in this template, the text the template renders
        after it up to and including the next generation prompt)."""
        base = [{"role": "system", "content": _MARKER}, {"role": "user", "content": _MARKER},
                {"role": "assistant", "content": _MARKER}]
        try:
            text = self._render(base + [dict(m) for m in messages], True)
        except Exception as e:  # jinja raises what the template's author chose (roles out of order, ...)
            roles = ", ".join(m.get("role", "?") for m in messages)
            raise TemplateError(f"the chat template cannot render an observation ({roles}) after an assistant "
                                f"turn: {type(e).__name__}: {e}") from None
        end = text.rfind(_MARKER) + len(_MARKER)
        if text.count(_MARKER) != 3 or any(m.get("content", "").count(_MARKER) for m in messages):
            raise TemplateError("the chat template does not render each message's content once")
        for stop_id, stop in self._stop_text.items():
            if text.startswith(stop, end):
                return stop_id, text[end + len(stop):]
        raise TemplateError(f"the chat template ends an assistant turn with {text[end:end + 20]!r}, not with a "
                            f"stop token ({', '.join(self._stop_text.values())}): the sampled turn would not be "
                            f"the rendered one")
