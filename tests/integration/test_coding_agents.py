"""mini-SWE-agent (the PyPI package, unmodified, in .venv-mswea/ from `scripts/install.sh --agents`) as the
external harness of coding executions: its calls through the recording proxy, its commands in Gyre's sandbox.

The model is scripted (each call answers the next text of a script, through the real proxy and the agent's
real litellm client), so the agent's actions are known: it creates a file, tries to read what the sandbox
hides, then submits. References: the workspace the evaluator saw, and the command outputs the agent was
shown (they come back to the proxy in its next request and are recorded as exact tokens).

    .venv/bin/python -m pytest tests/integration/test_coding_agents.py -q
"""
from __future__ import annotations

from pathlib import Path

from gyre_core.config import load_config
from gyre_core.envs.coding.env import CodingEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.external import run_external
from gyre_core.harness.loop import ExecutionSpec
from gyre_core.model import IM_END, train_tokenizer

from tests.core.test_proxy import ScriptedEngine

MSWEA = Path(__file__).resolve().parents[2] / ".venv-mswea" / "bin" / "python"
PROJECT = Path(__file__).resolve().parents[2]
SCRIPT = ["THOUGHT: look around.\n\n```mswea_bash_command\ntouch made_by_agent && ls " + str(PROJECT / "README.md") + "; "
          "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\" 2>&1 | tail -1\n```",
          "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]


class SeenEnv(CodingEnv):
    seen: list = []

    def score_workspace(self, path):
        SeenEnv.seen.append(sorted(p.name for p in Path(path).iterdir()))
        return super().score_workspace(path)


def test_mini_swe_agent_runs_through_the_proxy_with_its_commands_sandboxed():
    assert MSWEA.exists(), "mini-swe-agent is not installed: bash scripts/install.sh --agents"
    tok = train_tokenizer(list(CodingEnv("inflection").corpus(4, 0)) + SCRIPT * 10, vocab_size=400)
    stop = tok.convert_tokens_to_ids(IM_END)
    cfg = load_config("coding-smoke", [f"harness.command=[{MSWEA},gyre_core/envs/coding/mini_swe.py,--step-limit,4]",
                                       "harness.context_tokens=16000", "harness.max_new_tokens=256",
                                       "eval.random_baseline=false"])
    SeenEnv.seen = []
    eng = ScriptedEngine(tok, SCRIPT)
    from gyre_core.proxy.pool import CellPool

    [rec] = run_external(cfg, ChatFormat(tok), {stop: IM_END}, CellPool([eng]), 1.0, [ExecutionSpec("r", 0, "r/e0", "t", 3, "train")],
                         lambda: SeenEnv("inflection"))
    assert rec.status == "done", rec.error
    first, second = rec.calls                               # two model calls: the commands, then the submission
    assert first.completion_ids == eng.script[0] and second.completion_ids == eng.script[1]
    assert second.context_index == first.context_index and second.prefix_len == len(first.prompt_ids) + len(first.completion_ids)
    shown = tok.decode(second.prompt_ids[second.prefix_len:])       # what the agent was shown of its commands
    assert "No such file" in shown and "Network is unreachable" in shown
    assert "made_by_agent" in SeenEnv.seen[0]                # the file it made is in the workspace that was scored
    assert rec.partial == 0.0 and not rec.success            # it fixed nothing
