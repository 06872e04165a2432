"""An agent written with the official `openai` SDK, knowing nothing of Gyre: tools, several turns, its own
history compaction, and a sub-agent for a sub-task. Gyre trains it unmodified by pointing it at its
recording proxy (`harness.command` in a config; see the `proxy-smoke` preset):

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/openai_agent.py "What is 12 + 7?"

The task comes from the command line, else `GYRE_TASK`, else `TASK.md` in the working directory; the final
answer goes to `answer.txt` there. The agent:

- offers two tools, `calculate` (integer arithmetic, evaluated here) and `ask_helper` (a sub-agent);
- runs turns until the model answers without a tool call, asks it once to double-check that answer, and
  then takes its next answer;
- compacts its own history when the last prompt passed `--compact-at` tokens: it asks the model for a
  summary and starts a fresh conversation from the task and that summary;
- consults a helper (`--helper first`, the default: before its first turn; `tool`: only when the model
  calls `ask_helper`): a sub-agent with its own short conversation, on the sub-agent key
  (`GYRE_SUBAGENT_API_KEY`, with an `X-Gyre-Role: sub-agent` header) when there is one.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from pathlib import Path

from openai import OpenAI

SYSTEM = "You are a careful assistant who solves arithmetic. Use the tools when they help; answer with the number."
HELPER_SYSTEM = "You are a helper. Work out the arithmetic you are given and reply with the number only."
TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "ask_helper", "description": "Ask a helper to work out a sub-problem.",
        "parameters": {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}}},
]


def calculate(expression: str) -> int:
    """Integer + - * and parentheses, by walking the syntax tree (never `eval`)."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError("only integers, + - * and parentheses")
    if len(expression) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(expression, mode="eval").body)


class Agent:
    def __init__(self, client: OpenAI, helper: OpenAI, model: str, max_tokens: int, compact_at: int) -> None:
        self.client, self.helper, self.model = client, helper, model
        self.max_tokens, self.compact_at = max_tokens, compact_at
        self.compactions = self.helper_calls = 0

    def ask(self, messages: list[dict], tools: list[dict] | None = TOOLS):
        kw = {"tools": tools} if tools else {}
        return self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                                   temperature=1.0, **kw)

    def ask_helper(self, question: str) -> str:
        """A sub-agent: a fresh conversation of its own, one answer."""
        self.helper_calls += 1
        r = self.helper.chat.completions.create(
            model=self.model, max_tokens=self.max_tokens, temperature=1.0, extra_headers={"X-Gyre-Role": "sub-agent"},
            messages=[{"role": "system", "content": HELPER_SYSTEM}, {"role": "user", "content": question}])
        return r.choices[0].message.content or ""

    def run_tool(self, call) -> str:
        try:
            args = json.loads(call.function.arguments or "{}")
            if call.function.name == "calculate":
                return str(calculate(str(args.get("expression", ""))))
            if call.function.name == "ask_helper":
                return self.ask_helper(str(args.get("question", "")))
            return f"error: no tool {call.function.name!r}"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
            return f"error: {exc}"

    def compact(self, task: str, messages: list[dict]) -> list[dict]:
        """Summarise the conversation so far and start again from the task and the summary."""
        self.compactions += 1
        r = self.ask(messages + [{"role": "user", "content": "Summarise what you know so far in one sentence."}])
        notes = r.choices[0].message.content or ""
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task}\nYour notes so far: {notes}"}]

    def solve(self, task: str, max_turns: int, helper_first: bool) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
        if helper_first:
            messages[1]["content"] += f"\nA helper suggests: {self.ask_helper(task)}"
        answer, checked = "", False
        for _ in range(max_turns):
            r = self.ask(messages)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
            if msg.tool_calls:
                for call in msg.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": self.run_tool(call)})
            else:
                answer = msg.content or ""
                if checked:
                    break
                checked = True
                messages.append({"role": "user", "content": "Check that answer once more, then give the number."})
            if r.usage is not None and r.usage.prompt_tokens > self.compact_at:
                messages = self.compact(task, messages)
        return answer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", nargs="?", help="the task (default: $GYRE_TASK, else TASK.md)")
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--compact-at", type=int, default=2048, help="prompt tokens beyond which it compacts")
    ap.add_argument("--helper", choices=("first", "tool"), default="first")
    ap.add_argument("--model", default=os.environ.get("GYRE_MODEL"))
    args = ap.parse_args(argv)
    task = args.task or os.environ.get("GYRE_TASK") or (Path("TASK.md").read_text() if Path("TASK.md").exists() else "")
    if not task:
        ap.error("no task: pass one, set GYRE_TASK, or put TASK.md in the working directory")
    client = OpenAI(max_retries=1)                      # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    sub_key = os.environ.get("GYRE_SUBAGENT_API_KEY")
    helper = OpenAI(api_key=sub_key, max_retries=1) if sub_key else client
    model = args.model or client.models.list().data[0].id
    agent = Agent(client, helper, model, args.max_tokens, args.compact_at)
    answer = agent.solve(task, args.max_turns, args.helper == "first")
    Path("answer.txt").write_text(answer)
    numbers = re.findall(r"-?\d+", answer)
    print(f"answer: {numbers[-1] if numbers else answer!r} (compactions {agent.compactions}, "
          f"helper calls {agent.helper_calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
