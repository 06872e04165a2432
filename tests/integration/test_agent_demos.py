"""Demonstrations through an unmodified agent program: the proxy serves the environment's expert as the model
(`ExpertPool`), so examples/workspace_agent.py — its own system prompt, tool schemas, compaction — records the
expert's work as the exact tokens the policy will see through the same program at RL time."""
import pytest

from examples.workspace_agent import HELPER_SYSTEM, SUMMARISE, SYSTEM, TOOLS
from gyre_core.config import load_config
from gyre_core.envs import load_env
from gyre_core.envs.workspace import WorkspaceEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.external import run_external
from gyre_core.harness.loop import ExecutionSpec, strip_stop
from gyre_core.harness.tools import parse_tool_calls
from gyre_core.model import IM_END, train_tokenizer
from gyre_core.proxy.pool import ExpertPool


@pytest.fixture(scope="module")
def tok():
    env = WorkspaceEnv()
    corpus = list(env.corpus(20, 0)) + [SYSTEM, HELPER_SYSTEM, SUMMARISE, str(TOOLS)] * 5
    return train_tokenizer(corpus, vocab_size=400)


def _demos(tok, overrides, n=4, epsilon=0.0):
    cfg = load_config("agent", ["env.kwargs={sites: 3, lines: 4, distractors: 2}", *overrides])
    stop = tok.convert_tokens_to_ids(IM_END)
    specs = [ExecutionSpec("r", -1, f"r/demo/{i}", f"seed{i}", 50 + i, "demo") for i in range(n)]
    records = run_external(cfg, ChatFormat(tok), {stop: IM_END}, ExpertPool(tok, stop, epsilon, seed=0), None, specs,
                           lambda: load_env(cfg.env.target, **cfg.env.kwargs))
    return cfg, stop, records


def test_the_program_records_the_experts_work_as_the_tokens_rl_will_see(tok):
    cfg, stop, records = _demos(tok, ["harness.command=[python,examples/workspace_agent.py,--max-turns,10,"
                                      "--max-tokens,64,--compact-at,900]", "harness.max_new_tokens=64"])
    fmt = ChatFormat(tok)
    for r in records:
        assert r.status == "done" and r.success, (r.status, r.error)
        assert r.compactions >= 1                         # the program compacted its history on its own
        env = WorkspaceEnv(**cfg.env.kwargs)
        env.reset(r.seed)
        task, notes = env.mission(), None
        contexts = {}
        for c in r.calls:
            text = tok.decode(strip_stop(c.completion_ids, {stop: IM_END}), skip_special_tokens=False)
            assert c.completion_ids[-1] == stop and c.versions == [-1] * len(c.completion_ids)
            if c.context_index not in contexts:           # a fresh context: what the template renders, tools included
                user = task if notes is None else f"{task}\nYour notes so far: {notes}"
                assert c.prompt_ids == fmt.render([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": user}], TOOLS)
                contexts[c.context_index] = c
            else:                                         # a continued one: the served tokens, extended
                parent = r.calls[c.parent_call]
                assert c.prompt_ids[:c.prefix_len] == parent.prompt_ids + parent.completion_ids
            parsed = parse_tool_calls(text)
            assert c.tool_parse == (parsed.status if c.tool_parse else ""), (c.tool_parse, text)
            if "Found so far" in text:
                notes = text
        roles = [c.role for c in r.calls]
        assert roles[0] == "main" and "main-summary" in roles


def test_a_noisy_expert_takes_random_actions_and_still_lands_some_successes(tok):
    no_compaction = ["harness.command=[python,examples/workspace_agent.py,--max-tokens,64,--compact-at,4000]",
                     "harness.max_new_tokens=64"]
    _, _, records = _demos(tok, no_compaction, n=8, epsilon=0.3)
    _, _, again = _demos(tok, no_compaction, n=8, epsilon=0.3)
    calls = [[c.completion_ids for c in r.calls] for r in records]
    assert calls == [[c.completion_ids for c in r.calls] for r in again]      # drawn from seed and call number
    assert 0 < sum(r.success for r in records) < 8
