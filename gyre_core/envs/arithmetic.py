"""Arithmetic in free text: a task a small pretrained chat model can act in from the first step.

Each episode asks one question ("What is 37 + 18?"); the agent answers in any words and the env reads
the last integer in the answer ("37 + 18 = 55" answers 55). A wrong answer is told so and may be tried
again, up to `attempts` answers, so an episode can have several turns. Success: the right number; partial
credit: how close the last answer came.

    gyre train --preset real-smoke          # SmolLM2-135M-Instruct on vLLM answers these

`ArithmeticToolEnv` is the same with a `calculate` tool the agent may call before answering.
"""
from __future__ import annotations

import random
import re

from gyre_core.envs.protocol import Score, StepResult

_INT = re.compile(r"-?\d+")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnv:
    def __init__(self, max_operand: int = 50, ops: str = "+-", attempts: int = 2) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not ops or any(o not in OPS for o in ops):
            raise ValueError(f"ops {ops!r}: use characters from {''.join(OPS)}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.name = f"arithmetic-{ops}-{max_operand}"
        self.max_operand, self.ops, self.attempts = max_operand, ops, attempts
        hi = max(OPS[o](max_operand, max_operand) for o in ops)
        self.actions = tuple(str(n) for n in range(-max_operand, hi + 1))
        self.question, self.answer, self.answers = "", 0, []

    def instructions(self) -> str:
        return "You are a careful calculator. Answer each question with the number only."

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
        op = rng.choice(self.ops)
        self.question, self.answer, self.answers = f"{a} {op} {b}", OPS[op](a, b), []
        return f"What is {self.question}?"

    def mission(self) -> str:
        return f"What is {self.question}?"

    def step(self, action: str) -> StepResult:
        found = _INT.findall(action)
        if not found:
            return StepResult("No number found in your answer. Answer with the number only.", done=self._done(),
                              valid=False)
        if self._done():
            return StepResult(self._observe(), done=True)
        self.answers.append(int(found[-1]))
        return StepResult(self._observe(), done=self._done())

    def score(self) -> Score:
        success = self.answer in self.answers
        if success:
            return Score(True, 1.0, {"attempts": float(len(self.answers))})
        if not self.answers:
            return Score(False, 0.0, {"attempts": 0.0})
        miss = abs(self.answers[-1] - self.answer)
        return Score(False, 1.0 / (1.0 + miss), {"attempts": float(len(self.answers)), "miss": float(miss)})

    def summary(self) -> str:
        tried = ", ".join(map(str, self.answers)) or "nothing yet"
        return f"{self.mission()} Tried: {tried}."

    def setup_workspace(self, path: str) -> str:
        """For an external agent: the question in TASK.md; it writes its answer to answer.txt."""
        from pathlib import Path

        task = f"{self.mission()} Write the answer, a number, to answer.txt."
        Path(path, "TASK.md").write_text(f"{self.instructions()}\n\n{task}\n")
        return task

    def score_workspace(self, path: str) -> Score:
        """The last number in answer.txt is the answer (none, or no file: no answer)."""
        from pathlib import Path

        answer = Path(path, "answer.txt")
        if answer.is_file():
            self.step(answer.read_text(errors="replace")[-2000:])
        return self.score()

    def expert_action(self) -> str | None:
        return None if self._done() else str(self.answer)

    def progress(self) -> float:
        return self.score().partial

    def _done(self) -> bool:
        return self.answer in self.answers or len(self.answers) >= self.attempts

    def _observe(self) -> str:
        last = self.answers[-1]
        if last == self.answer:
            return f"{last} is correct."
        left = self.attempts - len(self.answers)
        return f"{last} is wrong." + (f" Try again ({left} left): what is {self.question}?" if left else "")


class ArithmeticToolEnv(ArithmeticEnv):
    """`ArithmeticEnv` with a `calculate` tool (the same questions; answers go to `step` as before)."""

    def __init__(self, max_operand: int = 50, ops: str = "+-", attempts: int = 2) -> None:
        super().__init__(max_operand, ops, attempts)
        self.name += "-tools"
        self.tool_calls = 0

    def instructions(self) -> str:
        return ("You are a careful calculator. You may call the calculate tool; then answer each question with "
                "the number only.")

    def tools(self) -> list[dict]:
        return [{"type": "function", "function": {
            "name": "calculate", "description": "Evaluate an expression of integers with + - * and parentheses.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}}]

    def call_tool(self, name: str, arguments: dict) -> str:
        if name != "calculate":
            raise ValueError(f"no tool {name!r}")
        self.tool_calls += 1
        return str(evaluate_expression(str(arguments.get("expression", ""))))


def evaluate_expression(expr: str) -> int:
    """An integer expression with + - * and parentheses, evaluated without `eval`."""
    import ast

    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"not an integer expression of + - * and parentheses: {expr!r}")

    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an expression: {expr!r}") from None
