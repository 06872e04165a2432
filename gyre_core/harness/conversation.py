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
_T1, _T2 = "\x00TOOL1\x00", "\x00TOOL2\x00"


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

        self._tool_pieces: tuple[str, str, str] | None = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def start(self, system: str, user: str, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a fresh context: system + first user message + generation prompt. `tools` (OpenAI
        function schemas) are rendered by the template; a template that renders none gets them written
        into the system message (`tools.system_with_tools`)."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if tools:
            with_tools = self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
            if with_tools == text:
                from .tools import system_with_tools

                msgs[0]["content"] = system_with_tools(system, tools)
                with_tools = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            text = with_tools
        return self.encode(text)

    def continuation(self, user: str, stopped_on: str | None) -> list[int]:
        """Ids appended after a completion: close the assistant turn, add the user turn, prompt again.

        `stopped_on` is the decoded text of the stop token the completion ended with (None if it was cut
        by the length limit); that text is not emitted twice.
        """
        return self.encode(self._close(stopped_on) + self.user_before + user + self.user_after)

    def tool_continuation(self, results: list[str], stopped_on: str | None) -> list[int]:
        """Ids appended after a completion that called tools: close the assistant turn, one `tool` message
        per result as the template renders consecutive tool messages, prompt again."""
        if not results:
            raise ValueError("tool_continuation: no results")
        before, between, after = self.tool_pieces()
        return self.encode(self._close(stopped_on) + before + between.join(results) + after)

    def tool_pieces(self) -> tuple[str, str, str]:
        """(before the first result, between two results, after the last + generation prompt), probed once."""
        if self._tool_pieces is None:
            msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U0"},
                    {"role": "assistant", "content": _A}, {"role": "tool", "content": _T1},
                    {"role": "tool", "content": _T2}]
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            rest = text[text.index(_A) + len(_A):] if _A in text else ""
            if not (rest.startswith(self.close_assistant) and _T1 in rest and _T2 in rest):
                raise TemplateError("the chat template does not render tool messages after an assistant turn")
            rest = rest[len(self.close_assistant):]
            before, rest = rest.split(_T1)
            between, after = rest.split(_T2)
            self._tool_pieces = (before, between, after)
        return self._tool_pieces

    def _close(self, stopped_on: str | None) -> str:
        close = self.close_assistant
        if stopped_on and close.startswith(stopped_on):
            close = close[len(stopped_on):]
        return close
