"""A file-reading agent written with the official `openai` SDK, knowing nothing of Gyre: it answers a question
about the files in its working directory with tools over many turns, compacts its own history, and can hand
a file to a helper sub-agent. Gyre trains it unmodified through the recording proxy (the `agent` preset):

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/workspace_agent.py "How many bolts are at oslo?"

The task comes from the command line, else `GYRE_TASK`, else `TASK.md`; the final answer goes to `answer.txt`.

- tools: `list_files`, `read_file` (run here, inside the working directory), `calculate` (integer
  arithmetic, never `eval`) and `ask_helper(path, question)`: a sub-agent reads the file in a conversation
  of its own and answers the question (on `GYRE_SUBAGENT_API_KEY` with an `X-Gyre-Role: sub-agent`
  header when there is one), so the file's text never enters the main context;
- a turn without a tool call is the answer;
- when the last prompt passed `--compact-at` tokens it asks the model to summarise what it found and starts
  a fresh conversation from the task and that summary.
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

SYSTEM = ("You answer questions about the files in your workspace. Read the files you need with read_file, "
          "add numbers with calculate, then reply with the final number only.")
HELPER_SYSTEM = "You read one file and answer a question about it with a number only."
SUMMARISE = "Summarise what you know so far: the counts you found, one per depot."


def _tool(name: str, description: str, props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


TOOLS = [
    _tool("list_files", "List the files in the workspace.", {}),
    _tool("read_file", "Read a file of the workspace.", {"path": {"type": "string"}}),
    _tool("calculate", "Evaluate an integer expression with + - * and parentheses.", {"expression": {"type": "string"}}),
    _tool("ask_helper", "Have a helper read a file and answer a question about it.",
          {"path": {"type": "string"}, "question": {"type": "string"}}),
]


def calculate(expression: str) -> int:
    """Integer + - * and parentheses, by walking the syntax tree."""
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


def read_file(path: str) -> str:
    """A file inside the working directory (nothing above it)."""
    root = Path.cwd().resolve()
    f = (root / path).resolve()
    if root not in f.parents or not f.is_file():
        raise FileNotFoundError(f"no file {path!r} (list_files shows them)")
    return f.read_text(errors="replace")[:20_000]


def list_files() -> str:
    root = Path.cwd()
    return "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "answer.txt"))


class Agent:
    def __init__(self, client: OpenAI, helper: OpenAI, model: str, max_tokens: int, compact_at: int) -> None:
        self.client, self.helper, self.model = client, helper, model
        self.max_tokens, self.compact_at = max_tokens, compact_at
        self.calls = self.compactions = self.helper_calls = 0

    def ask(self, messages: list[dict], tools: list[dict] | None = TOOLS):
        self.calls += 1
        kw = {"tools": tools} if tools else {}
        return self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                                   temperature=1.0, **kw)

    def ask_helper(self, path: str, question: str) -> str:
        """A sub-agent with a conversation of its own: the file's text and the question, one answer."""
        self.helper_calls += 1
        r = self.helper.chat.completions.create(
            model=self.model, max_tokens=self.max_tokens, temperature=1.0, extra_headers={"X-Gyre-Role": "sub-agent"},
            messages=[{"role": "system", "content": HELPER_SYSTEM},
                      {"role": "user", "content": f"{read_file(path)}\n{question}"}])
        return r.choices[0].message.content or ""

    def run_tool(self, call) -> str:
        try:
            args = json.loads(call.function.arguments or "{}")
            name = call.function.name
            if name == "list_files":
                return list_files()
            if name == "read_file":
                return read_file(str(args.get("path", "")))
            if name == "calculate":
                return str(calculate(str(args.get("expression", ""))))
            if name == "ask_helper":
                return self.ask_helper(str(args.get("path", "")), str(args.get("question", "")))
            return f"error: no tool {name!r}"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
            return f"error: {exc}"

    def compact(self, task: str, messages: list[dict]) -> list[dict]:
        """Ask for a summary of the conversation and start again from the task and the summary."""
        self.compactions += 1
        r = self.ask(messages + [{"role": "user", "content": SUMMARISE}])
        notes = r.choices[0].message.content or ""
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{task}\nYour notes so far: {notes}"}]

    def solve(self, task: str, max_turns: int) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
        for _ in range(max_turns):
            r = self.ask(messages)
            msg = r.choices[0].message
            if not msg.tool_calls:
                return msg.content or ""
            messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": self.run_tool(call)})
            if r.usage is not None and r.usage.prompt_tokens > self.compact_at:
                messages = self.compact(task, messages)
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", nargs="?", help="the task (default: $GYRE_TASK, else TASK.md)")
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--compact-at", type=int, default=1536, help="prompt tokens beyond which it compacts")
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
    answer = agent.solve(task, args.max_turns)
    Path("answer.txt").write_text(answer)
    numbers = re.findall(r"-?\d+", answer)
    print(f"answer: {numbers[-1] if numbers else answer!r} (calls {agent.calls}, compactions {agent.compactions}, "
          f"helper calls {agent.helper_calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
