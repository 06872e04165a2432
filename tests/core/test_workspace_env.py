"""The workspace task family (gyre_core/envs/workspace.py): the contract, an expert that solves every task by
its tools (checked against sums read independently from the files), disjoint splits, a long setting that
really forces compaction, and the expert as an agent program's model (`expert_reply`) on the program's view."""
import json
import random
import re
from pathlib import Path

import pytest

from gyre_core.config import HarnessConfig, load_config
from gyre_core.envs import check_environment, random_action
from gyre_core.envs.protocol import StepResult
from gyre_core.envs.workspace import WorkspaceEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.loop import ExecutionSpec, run_executions
from gyre_core.harness.policies import ExpertPolicy, RandomPolicy
from gyre_core.harness.tools import parse_tool_calls
from gyre_core.model import IM_END, train_tokenizer

LONG = {"sites": 12, "lines": 30, "distractors": 4}


def _truth(env: WorkspaceEnv) -> int:
    """The answer read from the files' text alone: the asked item's count in each named depot, summed."""
    item, sites = re.match(r"How many (\w+) are there in total at the depots (.*)\?", env.mission()).groups()[:2]
    names = re.split(r", | and ", sites.split("?")[0])
    files = env.save_state()["files"]
    return sum(int(re.search(rf"^{item}: (\d+)$", files[f"depots/{n}.txt"], re.M).group(1)) for n in names)


def _play_expert(env: WorkspaceEnv, seed: int) -> int:
    """The expert through the tools as Gyre's harness runs them; the number of calls it made."""
    env.reset(seed)
    calls = 0
    while (action := env.expert_action()) is not None:
        calls += 1
        parsed = parse_tool_calls(action, {t["function"]["name"] for t in env.tools()})
        if parsed.status == "ok":
            for c in parsed.calls:
                env.call_tool(c.name, c.arguments)
        else:
            assert env.step(action).valid
    return calls


@pytest.mark.parametrize("kwargs", [{}, {"sites": 1, "lines": 1, "distractors": 0}, LONG, {"delegate": True}])
def test_the_contract_check_passes(kwargs):
    assert check_environment(WorkspaceEnv(**kwargs)) == []


@pytest.mark.parametrize("kwargs", [{}, LONG])
def test_the_expert_solves_every_task_with_one_read_per_named_depot(kwargs):
    env = WorkspaceEnv(**kwargs)
    for seed in range(150):
        calls = _play_expert(env, seed)
        score = env.score()
        assert score.success and score.partial == 1.0 and env.save_state()["answers"] == [_truth(env)]
        assert calls == env.sites + 2 and score.details["reads"] == env.sites


def test_partial_credit_counts_depots_read_and_closeness():
    env = WorkspaceEnv(sites=2, lines=3, distractors=1)
    env.reset(3)
    state = env.save_state()
    first = state["targets"][0]
    env.call_tool("read_file", {"path": f"depots/{first}.txt"})
    env.call_tool("read_file", {"path": f"depots/{state['targets'][0]}.txt"})      # twice counts once
    assert env.score().partial == pytest.approx(0.25)                               # 1 of 2 read, no answer
    env.step(f"the total is {_truth(env) + 3}")
    assert env.score().partial == pytest.approx(0.25 + 0.5 * (1 / 4)) and not env.score().success
    assert env.step("7").observation == "The question is already answered."


def test_train_and_held_out_tasks_come_from_disjoint_seeds():
    cfg = load_config("agent")
    env = WorkspaceEnv(**cfg.env.kwargs)
    span = cfg.rl.steps * cfg.rollout.tasks_per_step
    train = {env.reset(cfg.env.train_seed_start + i) + repr(env.save_state()["files"]) for i in range(span)}
    held = {env.reset(cfg.env.eval_seed_start + i) + repr(env.save_state()["files"]) for i in range(cfg.eval.episodes)}
    assert len(train) == span and len(held) == cfg.eval.episodes and not train & held


@pytest.fixture(scope="module")
def tok():
    env = WorkspaceEnv(**LONG)
    return train_tokenizer(list(env.corpus(30, 0)), vocab_size=400)


def test_the_long_setting_forces_compaction_and_the_summary_keeps_what_was_read(tok):
    """Through Gyre's own harness with the agent-long preset's context: the expert's executions compact
    several times (the material does not fit) and still answer right from the summaries."""
    cfg = load_config("agent-long")
    fmt, stop = ChatFormat(tok), tok.convert_tokens_to_ids(IM_END)
    h = HarnessConfig(max_turns=cfg.harness.max_turns, context_tokens=cfg.harness.context_tokens,
                      max_new_tokens=64)
    specs = [ExecutionSpec("r", 0, f"e{i}", "t", 100 + i, "train") for i in range(4)]
    recs = run_executions(specs, ExpertPolicy(tok, stop), h, lambda: WorkspaceEnv(**cfg.env.kwargs), fmt,
                          {stop: IM_END}, concurrency=4)
    for r in recs:
        assert r.success, (r.status, r.error)
        assert r.compactions >= 2 and len({c.context_index for c in r.calls}) == r.compactions + 1
        assert all(len(c.prompt_ids) + len(c.completion_ids) <= h.context_tokens for c in r.calls)


def _conversation_step(env: WorkspaceEnv, root: Path, messages: list[dict], reply: str, n: int) -> str | None:
    """What an agent program does with `reply`: run its tool calls on the files (by its own means), or
    take it as the answer (returned)."""
    parsed = parse_tool_calls(reply)
    if parsed.status == "none":
        return reply
    calls = [{"id": f"call{n}_{k}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(parsed.calls)]
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    for c, tc in zip(parsed.calls, calls):
        if c.name == "read_file":
            out = (root / c.arguments["path"]).read_text()
        elif c.name == "calculate":
            out = str(sum(int(x) for x in c.arguments["expression"].split("+")))
        else:
            out = "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()))
        messages.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
    return None


def test_the_expert_answers_an_agent_program_from_what_its_conversation_shows(tmp_path):
    """`expert_reply` as the proxy would call it: reads every named depot, adds, answers — and after the
    program compacts (a summary request, then a fresh context from the notes), it goes on from the notes
    without reading again; a helper's question about a file's text gets the count."""
    env = WorkspaceEnv(sites=4)
    for seed in range(20):
        root = tmp_path / str(seed)
        root.mkdir()
        env.reset(seed)
        task = env.setup_workspace(str(root))
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": task}]
        answer, reads = None, 0
        for n in range(12):
            if n == 3:                  # the program compacts after two reads
                messages.append({"role": "user", "content": "Summarise what you know so far."})
                notes = env.expert_reply(messages)
                assert parse_tool_calls(notes).status == "none"
                messages = [messages[0], {"role": "user", "content": f"{task}\nYour notes so far: {notes}"}]
            reply = env.expert_reply(messages)
            reads += '"read_file"' in reply
            if (answer := _conversation_step(env, root, messages, reply, n)) is not None:
                break
        assert answer == str(_truth(env)) and reads == env.sites
        (root / "answer.txt").write_text(answer)
        assert env.score_workspace(str(root)).success
        item = env.save_state()["item"]
        text = (root / f"depots/{env.save_state()['targets'][0]}.txt").read_text()
        helper = [{"role": "system", "content": "H"}, {"role": "user", "content": f"{text}\nHow many {item}?"}]
        assert env.expert_reply(helper) == str(env.save_state()["counts"][env.save_state()["targets"][0]])


def test_an_external_agent_is_scored_on_its_answer_alone(tmp_path):
    env = WorkspaceEnv(sites=2)
    env.reset(1)
    env.setup_workspace(str(tmp_path))
    assert env.score_workspace(str(tmp_path)).partial == 0.0            # no answer.txt
    env.reset(1)
    env.setup_workspace(str(tmp_path))
    (tmp_path / "answer.txt").write_text(f"It is {_truth(env) + 1}.")
    assert env.score_workspace(str(tmp_path)).partial == pytest.approx(0.5)


def test_the_random_floor_draws_what_the_env_offers(tok):
    env = WorkspaceEnv()
    env.reset(0)
    drawn = {random_action(env, random.Random(i)).split('"name": "')[-1][:4] for i in range(60)}
    assert {"list", "read", "calc"} <= drawn and any(d.isdigit() for d in drawn)
    stop = tok.convert_tokens_to_ids(IM_END)
    specs = [ExecutionSpec("r", -2, f"e{i}", "t", i, "eval-random") for i in range(16)]
    recs = run_executions(specs, RandomPolicy(tok, stop, 0), HarnessConfig(max_turns=8, context_tokens=2048,
                                                                           max_new_tokens=64),
                          WorkspaceEnv, ChatFormat(tok), {stop: IM_END}, concurrency=4)
    assert all(r.status in ("done", "turn_limit") for r in recs) and sum(r.success for r in recs) <= 2


class _FreeText:
    name, free_text = "free", True

    def __init__(self, accepts_junk: bool) -> None:
        self.accepts_junk, self.said = accepts_junk, []

    def instructions(self) -> str:
        return "Say anything."

    def reset(self, seed: int) -> str:
        self.said = []
        return "Go."

    def mission(self) -> str:
        return "Talk."

    def step(self, action: str) -> StepResult:
        if not self.accepts_junk and "@" in action:
            return StepResult("no", done=False, valid=False)
        self.said.append(action)
        return StepResult(f"you said {action}", done=len(self.said) >= 3)

    def score(self):
        from gyre_core.envs.protocol import Score
        return Score(False, 0.0)

    def summary(self) -> str:
        return " ".join(self.said)

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(["hello", "a long sentence here", "42"])


def test_a_free_text_env_is_held_to_taking_every_text():
    assert check_environment(_FreeText(accepts_junk=True)) == []
    assert any("free_text env" in p for p in check_environment(_FreeText(accepts_junk=False)))


def test_an_env_without_actions_needs_something_to_act_with():
    class Mute(_FreeText):
        random_action = None

    assert any("needs random_action or expert_action" in p for p in check_environment(Mute(True)))
