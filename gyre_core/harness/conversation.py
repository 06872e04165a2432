"""Multi-turn prompts as exact token extensions, rendered with the model's own chat template.

A turn's tokens never change once they exist: the completion ids are kept exactly as generated and only
the new messages are rendered, tokenised on their own and appended. Official templates are not always
append-only over turns (Qwen3's drops the `<think>` block of earlier assistant turns; a template writes a
tool call's arguments with its own JSON spacing, not the model's), so re-rendering the conversation would
change tokens the model already generated and was scored on; rendering only the new pieces sidesteps that.

    fmt = ChatFormat(tokenizer)
    ids = fmt.render(messages, tools)                        # a fresh context, as the template renders it
    ids += completion_ids + fmt.after_assistant(new_messages, stopped_on, tools)   # the next turn

`after_assistant` renders the new messages after a placeholder assistant message and keeps what follows
the placeholder's content: the close of the assistant turn (minus the stop token when the model generated
it), the new messages, the generation prompt. The constructor checks once that the template renders turns
that way. Any HF tokenizer whose template does goes through the same code (Qwen2.5, Qwen3, SmolLM2 and
Gyre's tiny model are tested in tests/core/test_chat_templates.py).
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

    def start(self, system: str, user: str, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a fresh context: system + first user message + generation prompt."""
        return self.render([{"role": "system", "content": system}, {"role": "user", "content": user}], tools)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a whole conversation as the template renders it, with the generation prompt (a fresh
        context). `messages` are OpenAI chat messages; `tools` (OpenAI function schemas) are rendered by the
        template, and a template that renders none gets them written into the system message
        (`tools.system_with_tools`)."""
        msgs = template_messages(messages)
        text = self._apply(msgs, tools)
        if tools and text == self._apply(msgs, None):
            from .tools import system_with_tools

            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": system_with_tools(msgs[0]["content"], tools)}
            else:
                msgs.insert(0, {"role": "system", "content": system_with_tools("", tools).lstrip()})
            text = self._apply(msgs, None)
        return self.encode(text)

    def after_assistant(self, messages: list[dict], stopped_on: str | None, tools: list[dict] | None = None) -> list[int]:
        """Ids appended after a generated assistant turn: its close, `messages` (any roles: user, tool,
        system, an assistant message the harness wrote) as the template renders them after an assistant
        message, and the generation prompt. `stopped_on` is the decoded text of the stop token the completion
        ended with (None if it did not end on one); that text is not emitted twice."""
        head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U0"},
                {"role": "assistant", "content": _A}]
        text = self._apply(head + template_messages(messages), tools)
        if _A not in text:
            raise TemplateError("the chat template does not render an assistant message's content")
        rest = text[text.index(_A) + len(_A):]
        if stopped_on and rest.startswith(stopped_on):
            rest = rest[len(stopped_on):]
        return self.encode(rest)

    def continuation(self, user: str, stopped_on: str | None) -> list[int]:
        """Ids appended after a completion: close the assistant turn, add the user turn, prompt again."""
        return self.after_assistant([{"role": "user", "content": user}], stopped_on)

    def tool_continuation(self, results: list[str], stopped_on: str | None) -> list[int]:
        """Ids appended after a completion that called tools: one `tool` message per result."""
        if not results:
            raise ValueError("tool_continuation: no results")
        return self.after_assistant([{"role": "tool", "content": r} for r in results], stopped_on)

    def _apply(self, msgs: list[dict], tools: list[dict] | None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as HF chat templates read them: text content as one string (None as ""), and
    tool-call arguments as objects (OpenAI sends them as JSON text; templates write them with `tojson`)."""
    import json

    out = []
    for m in messages:
        t = {"role": m["role"], "content": message_text(m.get("content"))}
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                t[k] = m[k]
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass       # not JSON: the template writes the text as it is
                calls.append({"id": c.get("id"), "type": c.get("type", "function"), "function": fn})
            t["tool_calls"] = calls
        out.append(t)
    return out


def message_text(content) -> str:
    """A message's content as one string: a string as it is, None as "", a list of parts as its text parts
    joined (any other part is refused: Gyre's engines take text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part of type {kind!r}: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"message content must be a string, null or a list of text parts, not {type(content).__name__}")
