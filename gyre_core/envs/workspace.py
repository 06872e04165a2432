"""Questions about a generated workspace, answered with tools over many turns: the real-model agent task.

    gyre train --preset agent-quick      # Gyre's own harness: SmolLM2-135M-Instruct reads files with tools
    gyre train --preset agent            # the same task through an unmodified openai-SDK agent program

Each task is a directory of depot files (`depots/<site>.txt`, one `item: count` line per item) and one
question: "How many bolts are there in total at the depots oslo, lima and kyiv?". The answer depends on
files the agent has not seen, so it must gather them with tools (`read_file`, `list_files`), combine what it
read (`calculate`, or in its head) and reply with the number. The horizon is a knob:

- `sites`: depots the question names: one read each, so a task takes `sites` + 2 calls when done well;
- `lines`: items per file (how much of a read is noise, and how fast the context fills);
- `distractors`: depots in the workspace that the question does not name.

With many sites and long files the material does not fit a small context window: an execution must compact
its history (Gyre's own harness compacts into `summary()`, which keeps what was read; an agent program
compacts in its own way, or delegates reading to a helper sub-agent) to finish — the `agent-long` preset.

Why this shape (docs/experiments/agent.md has the measurements): a 135M chat model copies a path from the
question and a number from a tool result reliably once warm-started, but picking the asked item's line out
of a file, keeping several numbers across turns and adding them is where it fails, so a behaviour clone
lands well above zero and well below perfect. Partial credit — the share of the named depots read, and
how close the answer came — makes a near miss worth more than a wrong file, so RL has a gradient before it
has successes. Train and held-out tasks come from disjoint seeds (the config's seed ranges).

The expert reads every named depot, adds the counts with `calculate` and answers. It acts on the
environment's state through Gyre's own harness (`expert_action`), and on the conversation an agent program
sends through the proxy (`expert_reply`), so the same demonstrations can be recorded either way.
"""
from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path

from gyre_core.envs.arithmetic import evaluate_expression
from gyre_core.envs.protocol import Score, StepResult

SITES = ("oslo", "lima", "kyiv", "rome", "cairo", "delhi", "tokyo", "paris", "quito", "dakar", "hanoi", "miami",
         "perth", "porto", "seoul", "sofia", "tunis", "turin", "vigo", "zagreb", "accra", "aden", "baku", "bern",
         "bonn", "cork", "doha", "graz", "hue", "kiev", "kobe", "lyon", "malmo", "nice", "oran", "pisa", "riga",
         "split", "tartu", "york")
ITEMS = ("bolts", "cables", "drums", "fuses", "gears", "hinges", "lamps", "nails", "pipes", "ropes", "screws",
         "tiles", "valves", "wheels", "wires", "boxes", "brushes", "chains", "clamps", "filters", "hoses",
         "jacks", "keys", "locks", "meters", "pumps", "rods", "sensors", "springs", "tapes")
DIR = "depots"
SUMMARY_WORDS = ("summar",)           # a request to summarise the work so far (after some of it)
_NOTE = re.compile(r"\b([a-z]+) has (\d+)\b")
_INT = re.compile(r"-?\d+")


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the model writes it (the Hermes format `harness/tools.py` parses)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class WorkspaceEnv:
    """Answer a counting question about depot files with `list_files`, `read_file` and `calculate`."""

    actions: tuple[str, ...] = ()      # open-ended: answers are free text; `random_action` is the random floor

    def __init__(self, sites: int = 3, lines: int = 4, distractors: int = 2, max_count: int = 20,
                 attempts: int = 1, delegate: bool = False) -> None:
        if not 1 <= sites <= len(SITES) - distractors or distractors < 0:
            raise ValueError(f"sites={sites}, distractors={distractors}: need 1 ≤ sites and sites + distractors ≤ "
                             f"{len(SITES)}")
        if not 1 <= lines <= len(ITEMS) or max_count < 1 or attempts < 1:
            raise ValueError(f"lines must be in 1..{len(ITEMS)}; max_count and attempts ≥ 1")
        self.sites, self.lines, self.distractors = sites, lines, distractors
        self.max_count, self.attempts, self.delegate = max_count, attempts, delegate
        self.name = f"workspace-s{sites}-l{lines}-d{distractors}"
        self._state: dict = {}

    # -- the task ----------------------------------------------------------------------------------------
    def instructions(self) -> str:
        return ("You answer questions about the files in your workspace. Read the files you need with read_file, "
                "add numbers with calculate, then reply with the final number only.")

    def reset(self, seed: int) -> str:
        rng = random.Random(f"workspace:{seed}")
        names = rng.sample(SITES, self.sites + self.distractors)
        item = rng.choice(ITEMS)
        files, counts = {}, {}
        for site in names:
            others = rng.sample([i for i in ITEMS if i != item], self.lines - 1)
            rows = others + [item]
            rng.shuffle(rows)
            values = {i: rng.randint(1, self.max_count) for i in rows}
            counts[site] = values[item]
            files[f"{DIR}/{site}.txt"] = "".join(f"{i}: {values[i]}\n" for i in rows)
        targets = names[:self.sites]
        self._state = {"item": item, "targets": targets, "files": files,
                       "counts": {s: counts[s] for s in targets}, "read": [], "calculated": None, "answers": []}
        return self.mission()

    def mission(self) -> str:
        s = self._state
        return f"How many {s['item']} are there in total at the depots {_join(s['targets'])}? The depot files are in {DIR}/."

    @property
    def answer(self) -> int:
        return sum(self._state["counts"].values())

    def step(self, action: str) -> StepResult:
        found = _INT.findall(action)
        if not found:
            return StepResult("No number found in your answer. Reply with the final number only.",
                              done=self._done(), valid=False)
        if self._done():
            return StepResult("The question is already answered.", done=True)
        self._state["answers"].append(int(found[-1]))
        last = self._state["answers"][-1]
        if last == self.answer:
            return StepResult(f"{last} is correct.", done=True)
        left = self.attempts - len(self._state["answers"])
        return StepResult(f"{last} is wrong." + (f" Try again ({left} left)." if left else ""), done=self._done())

    def score(self) -> Score:
        s = self._state
        targets = s["targets"]
        found = len({t for t in s["read"] if t in targets}) / len(targets)
        details = {"found": found, "reads": float(len(s["read"])), "answers": float(len(s["answers"]))}
        if self.answer in s["answers"]:
            return Score(True, 1.0, details)
        close = 1.0 / (1.0 + abs(s["answers"][-1] - self.answer)) if s["answers"] else 0.0
        details["close"] = close
        # an agent program reads with its own tools, unseen here: only its answer can be scored
        partial = close if s.get("external") else 0.5 * found + 0.5 * close
        return Score(False, min(partial, 0.99), details)

    def progress(self) -> float:
        return self.score().partial

    def summary(self) -> str:
        """What was read so far (a lossless compaction: the counts of the asked item, nothing else)."""
        s = self._state
        notes = "; ".join(f"{t} has {s['counts'][t]} {s['item']}" for t in s["targets"] if t in s["read"])
        todo = [t for t in s["targets"] if t not in s["read"]]
        return (f"Found so far: {notes or 'nothing'}." + (f" Still to read: {_join(todo)}." if todo else "")
                + (f" calculate gave {s['calculated']}." if s["calculated"] is not None else ""))

    # -- tools (Gyre's own harness runs them here) ---------------------------------------------------------
    def tools(self) -> list[dict]:
        return [
            _tool("list_files", "List the files in the workspace.", {}),
            _tool("read_file", "Read a file of the workspace.", {"path": {"type": "string"}}, ["path"]),
            _tool("calculate", "Evaluate an integer expression with + - * and parentheses.",
                  {"expression": {"type": "string"}}, ["expression"]),
        ]

    def call_tool(self, name: str, arguments: dict) -> str:
        s = self._state
        if name == "list_files":
            return "\n".join(sorted(s["files"]))
        if name == "read_file":
            path = str(arguments.get("path", "")).strip().lstrip("./")
            if path not in s["files"]:
                raise FileNotFoundError(f"no file {path!r} (list_files shows them)")
            s["read"].append(Path(path).stem)
            return s["files"][path]
        if name == "calculate":
            s["calculated"] = evaluate_expression(str(arguments.get("expression", "")))
            return str(s["calculated"])
        raise ValueError(f"no tool {name!r}")

    # -- the expert --------------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The next step of the plan from the state: read each named depot, add, answer."""
        s = self._state
        if self._done():
            return None
        todo = [t for t in s["targets"] if t not in s["read"]]
        if todo:
            return tool_call_text("read_file", {"path": f"{DIR}/{todo[0]}.txt"})
        if s["calculated"] != self.answer:
            return tool_call_text("calculate", {"expression": self._sum_expression()})
        return str(self.answer)

    def expert_reply(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The expert's reply to an agent program's request (OpenAI chat messages and tools, as the proxy got
        them): the same plan, with what it knows taken from what the conversation shows — depots read in
        this context, the notes of an earlier compaction — so it acts on the agent's view, not on hidden
        state. A request to summarise gets notes it can read back; a helper's question about a file's text
        gets the count. With `delegate` and an `ask_helper(path, question)` tool offered, it has the helper
        read each depot instead of reading it into its own context."""
        s = self._state
        last = messages[-1] if messages else {}
        text = _content(last)
        worked = any(m.get("role") == "assistant" for m in messages[:-1])
        total = any(_content(m).strip() == str(self.answer) for m in messages if m.get("role") == "tool") or any(
            f"total is {self.answer}." in _content(m) for m in messages if m.get("role") == "user")
        if last.get("role") == "user" and worked and any(w in text.lower() for w in SUMMARY_WORDS):
            known = self._visible(messages)
            return ("Found so far: " + ("; ".join(f"{t} has {known[t]} {s['item']}" for t in known) or "nothing") + "."
                    + (f" The total is {self.answer}." if total else ""))
        if last.get("role") == "user" and len(messages) <= 2 and (m := re.search(rf"^{s['item']}: (\d+)$", text, re.M)):
            return m.group(1)           # a helper (sub-agent) asked about one file's text
        known = self._visible(messages)
        todo = [t for t in s["targets"] if t not in known]
        if todo:
            offered = {(t.get("function") or {}).get("name") for t in tools or []}
            if self.delegate and "ask_helper" in offered:
                return tool_call_text("ask_helper", {"path": f"{DIR}/{todo[0]}.txt",
                                                     "question": f"How many {s['item']}?"})
            return tool_call_text("read_file", {"path": f"{DIR}/{todo[0]}.txt"})
        if not total:
            return tool_call_text("calculate", {"expression": " + ".join(str(known[t]) for t in s["targets"])})
        return str(self.answer)

    def random_action(self, rng: random.Random) -> str:
        """What a uniformly random agent does here: list, read any depot, calculate or answer a number."""
        s = self._state
        kind = rng.randrange(4)
        if kind == 0:
            return tool_call_text("list_files", {})
        if kind == 1:
            return tool_call_text("read_file", {"path": rng.choice(sorted(s["files"]))})
        if kind == 2:
            return tool_call_text("calculate", {"expression": f"{rng.randint(1, self.max_count)} + "
                                                              f"{rng.randint(1, self.max_count)}"})
        return str(rng.randint(self.sites, self.sites * self.max_count))

    # -- as an agent program meets it ----------------------------------------------------------------------
    def setup_workspace(self, path: str) -> str:
        """The depot files under `path`; the agent writes its final answer to answer.txt."""
        for rel, text in self._state["files"].items():
            f = Path(path, rel)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        self._state["external"] = True
        return self.mission()

    def score_workspace(self, path: str) -> Score:
        answer = Path(path, "answer.txt")
        if answer.is_file():
            self.step(answer.read_text(errors="replace")[-2000:])
        return self.score()

    # -- forking and tokenizer text ------------------------------------------------------------------------
    def save_state(self) -> dict:
        return copy.deepcopy(self._state)

    def restore_state(self, state: dict) -> None:
        self._state = copy.deepcopy(state)

    def corpus(self, episodes: int, seed: int):
        env = WorkspaceEnv(self.sites, self.lines, self.distractors, self.max_count, self.attempts, self.delegate)
        yield self.instructions()
        for t in self.tools():
            yield json.dumps(t)
        for e in range(episodes):
            yield env.reset(seed * 100_003 + e)
            yield from env._state["files"].values()
            while (a := env.expert_action()) is not None:
                yield a
                if a.startswith("<tool_call>"):
                    call = json.loads(a.split("\n")[1])
                    yield env.call_tool(call["name"], call["arguments"])
                else:
                    env.step(a)
            yield env.summary()

    # -- helpers -----------------------------------------------------------------------------------------
    def _done(self) -> bool:
        s = self._state
        return self.answer in s["answers"] or len(s["answers"]) >= self.attempts

    def _sum_expression(self) -> str:
        return " + ".join(str(self._state["counts"][t]) for t in self._state["targets"])

    def _visible(self, messages: list[dict]) -> dict[str, int]:
        """The named depots whose count this conversation shows: files it read (a tool result after a
        read_file call of that depot) and counts written as notes ("oslo has 12")."""
        s = self._state
        known: dict[str, int] = {}
        pending: dict[str, str] = {}            # tool-call id -> depot it read
        for m in messages:
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}") if isinstance(fn.get("arguments"), str) else fn.get("arguments") or {}
                except ValueError:
                    args = {}
                if isinstance(args, dict) and "path" in args:       # read_file, ask_helper
                    pending[c.get("id")] = Path(str(args["path"])).stem
            if m.get("role") == "tool" and (site := pending.get(m.get("tool_call_id"))) in s["counts"]:
                n, text = s["counts"][site], _content(m)
                if f"{s['item']}: {n}" in text or text.strip() == str(n):
                    known[site] = n
            if m.get("role") == "user":
                for site, n in _NOTE.findall(_content(m)):
                    if site in s["counts"] and int(n) == s["counts"][site]:
                        known[site] = int(n)
        return known


def _tool(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required or []}}}


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _content(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return c or ""
