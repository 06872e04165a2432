"""Tool calls in completions: parsing them, and where they sit in the generated tokens.

An environment that declares tools (`Environment.tools()`, OpenAI function schemas) gets them rendered into
the prompt by the model's chat template; the model answers with tool calls in its family's format, which
`parse_tool_calls` reads. The format of Qwen2.5/Qwen3, Hermes and SmolLM2 (whose template has no tools of
its own: Gyre then writes the same instructions into the system message) is one JSON object per call:

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

`parse_tool_calls(text)` gives the calls and a status: `none` (no tool call: a text action or a final
answer), `ok`, or `malformed` (a block that is not a JSON call object, or an unclosed block) — a malformed
call is shown to the agent as an error, never dropped silently. `token_spans` maps each call's characters
back to the completion's token ids, so the record says which tokens produced which call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)

PARSE_NONE, PARSE_OK, PARSE_MALFORMED = "none", "ok", "malformed"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict
    span: tuple[int, int]          # characters of the whole <tool_call>...</tool_call> block in the text


@dataclass(slots=True)
class ParsedCompletion:
    status: str                    # PARSE_NONE | PARSE_OK | PARSE_MALFORMED
    calls: list[ToolCall] = field(default_factory=list)
    error: str = ""                # what was wrong (malformed), shown to the agent
    content: str = ""              # the text outside the tool-call blocks


def parse_tool_calls(text: str, known: set[str] | None = None) -> ParsedCompletion:
    """The tool calls in `text`. `known`: the declared tool names (a call to another is malformed)."""
    blocks = list(_BLOCK.finditer(text))
    unclosed = text.count(OPEN) > len(blocks)
    if not blocks and not unclosed:
        return ParsedCompletion(PARSE_NONE, content=text)
    content = _BLOCK.sub("", text).strip()
    if unclosed:
        return ParsedCompletion(PARSE_MALFORMED, error=f"a {OPEN} block is not closed with {CLOSE}", content=content)
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b.group(1))
        except ValueError as e:
            return ParsedCompletion(PARSE_MALFORMED, error=f"tool call is not valid JSON ({e.msg})", content=content)
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):           # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return ParsedCompletion(PARSE_MALFORMED, content=content,
                                    error='a tool call must be {"name": <string>, "arguments": <object>}')
        if known is not None and obj["name"] not in known:
            return ParsedCompletion(PARSE_MALFORMED, content=content,
                                    error=f"unknown tool {obj['name']!r} (tools: {', '.join(sorted(known))})")
        calls.append(ToolCall(obj["name"], args, b.span()))
    return ParsedCompletion(PARSE_OK, calls, content=content)


def token_spans(tokenizer, ids: list[int], char_spans: list[tuple[int, int]]) -> list[list[int]]:
    """[first, last+1) token indices of `ids` covering each character span of `tokenizer.decode(ids)`."""
    if not char_spans:
        return []
    ends, text_len = [], 0
    for i in range(len(ids)):          # characters decoded after each token (prefix decodes: exact for BPE)
        text_len = len(tokenizer.decode(ids[:i + 1], skip_special_tokens=False))
        ends.append(text_len)
    out = []
    for lo, hi in char_spans:
        first = next(i for i, e in enumerate(ends) if e > lo)
        last = next((i for i, e in enumerate(ends) if e >= hi), len(ids) - 1)
        out.append([first, last + 1])
    return out


def system_with_tools(system: str, tools: list[dict]) -> str:
    """For a chat template that renders no tools: the system message with the tools and the call format
    written in (the Hermes convention the parser reads)."""
    lines = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return (f"{system}\n\n# Tools\n\nYou may call one or more functions. Their signatures are within "
            f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\nFor each call, answer with a JSON object within "
            f'{OPEN}{CLOSE} tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')
