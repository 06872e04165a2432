"""Append-only prompt building with a tokenizer's own chat template.

A turn's tokens never change once they exist: the completion ids are kept exactly as generated and the
next user message is tokenised on its own and appended. The text appended after a completion is what
the chat template puts between an assistant message and the next user message (for Qwen-style
templates `<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`), minus the stop
token when the model already generated it. The template is probed once with placeholder messages, so
any HF tokenizer with a Qwen/ChatML-like template goes through the same code.
"""
from __future__ import annotations

_U = "\x00USER\x00"
_A = "\x00ASSISTANT\x00"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used append-only."""


class ChatFormat:
    """The three pieces of text a multi-turn loop needs, probed from the chat template once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")

        def render(msgs, gen):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        sys_msg = {"role": "system", "content": "S"}
        m1 = [sys_msg, {"role": "user", "content": "U0"}]
        head = render(m1, True)
        with_a = render(m1 + [{"role": "assistant", "content": _A}], False)
        if not with_a.startswith(head) or _A not in with_a[len(head):]:
            raise TemplateError("the chat template does not render an assistant turn after the generation prompt")
        # What follows an assistant's content until the end of its message (e.g. "<|im_end|>\n").
        self.close_assistant = with_a[with_a.index(_A) + len(_A):]
        m2 = m1 + [{"role": "assistant", "content": _A}, {"role": "user", "content": _U}]
        full = render(m2, True)
        if not full.startswith(with_a):
            raise TemplateError("the chat template is not append-only over turns")
        user_turn = full[len(with_a):]
        self.user_before, self.user_after = user_turn.split(_U)

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
