"""Multi-turn prompts as exact token extensions, rendered with the model's own chat template.

A turn's tokens never change once they exist: the completion ids are kept exactly as generated and only
the new messages are rendered, tokenised on their own and appended. Official templates are not always
append-only over turns (Qwen3's drops the `<think>` block of earlier assistant turns, so re-rendering
the conversation would change tokens the model already generated and was scored on); rendering only
the new pieces sidesteps that. The pieces are probed from the template once, with placeholder messages:

- the first prompt: the template's own rendering of [system, user] with the generation prompt;
- a user turn: what [system, user] + generation prompt renders beyond [system] alone;
- the close of an assistant turn: what the template puts after an earlier assistant message's content
  before the next user turn (`<|im_end|>\n` for ChatML-style templates), minus the stop token when the
  model generated it.

Any HF tokenizer whose template renders those pieces consistently goes through the same code (Qwen2.5,
Qwen3, SmolLM2 and Gyre's tiny model are tested in tests/core/test_chat_templates.py).
"""
from __future__ import annotations

_U = "\x00USER\x00"
_A = "\x00ASSISTANT\x00"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used append-only."""


class ChatFormat:
    """The pieces of text a multi-turn loop needs, probed from the chat template once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")

        def render(msgs, gen):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        sys_msg = {"role": "system", "content": "S"}
        system = render([sys_msg], False)
        first = render([sys_msg, {"role": "user", "content": _U}], True)
        if not first.startswith(system) or _U not in first[len(system):]:
            raise TemplateError("the chat template does not render a user turn after the system message")
        user_turn = first[len(system):]           # user header + content + close + generation prompt
        self.user_before, self.user_after = user_turn.split(_U)
        later = render([sys_msg, {"role": "user", "content": "U0"}, {"role": "assistant", "content": _A},
                        {"role": "user", "content": _U}], True)
        if _A not in later or not later.endswith(user_turn):
            raise TemplateError("the chat template does not end a conversation with the user turn it renders "
                                "after the system message")
        # What follows an earlier assistant message's content until the next user turn (e.g. "<|im_end|>\n").
        self.close_assistant = later[later.index(_A) + len(_A):len(later) - len(user_turn)]
        if not (self.close_assistant + self.user_before).strip():
            raise TemplateError("the chat template marks no boundary between an assistant message and the next "
                                "user message")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, system: str, user: str) -> list[int]:
        """Token ids of a fresh context: system + first user message + generation prompt."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def continuation(self, user: str, stopped_on: str | None) -> list[int]:
        """Ids appended after a completion: close the assistant turn, add the user turn, prompt again.

        `stopped_on` is the decoded text of the stop token the completion ended with (None if it was cut
        by the length limit); that text is not emitted twice.
        """
        close = self.close_assistant
        if stopped_on and close.startswith(stopped_on):
            close = close[len(stopped_on):]
        return self.encode(close + self.user_before + user + self.user_after)
