"""Tool calls: parsing completions, their token spans, rendering tool results with real chat templates,
and the harness running an environment's tools (scripted completions, a real tokenizer).

    .venv/bin/python -m pytest tests/core/test_tools.py -q
"""
from __future__ import annotations

import copy
import json

import pytest

from gyre_core.config import HarnessConfig
from gyre_core.envs.arithmetic import ArithmeticToolEnv, evaluate_expression
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.loop import Completion, ExecutionSpec, run_executions
from gyre_core.harness.tools import PARSE_MALFORMED, PARSE_NONE, PARSE_OK, parse_tool_calls, token_spans
from gyre_core.model import IM_END, train_tokenizer

from test_chat_templates import QWEN3   # tests/core is on sys.path (pytest prepends it)

# Qwen's rendering of tool results (the tool branch its templates share), added to the Qwen3 template of
# tests/core/test_chat_templates.py
TOOL_BRANCH = (
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
)


def call_text(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    env = ArithmeticToolEnv(max_operand=20, ops="+")
    corpus = [env.instructions(), call_text("calculate", expression="3 + 4"), "What is 12 + 7? 19 is correct."] * 30
    return train_tokenizer(corpus, vocab_size=320)


# -- parsing ----------------------------------------------------------------------------------------

def test_parse_reads_calls_and_tells_none_from_malformed():
    two = "I will compute. " + call_text("calculate", expression="2 + 3") + call_text("calculate", expression="4*5")
    p = parse_tool_calls(two, {"calculate"})
    assert p.status == PARSE_OK and [c.arguments["expression"] for c in p.calls] == ["2 + 3", "4*5"]
    assert two[p.calls[1].span[0]:p.calls[1].span[1]] == call_text("calculate", expression="4*5")
    assert p.content == "I will compute."
    assert parse_tool_calls("The answer is 5", {"calculate"}).status == PARSE_NONE
    as_string = '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(as_string, {"calculate"}).calls[0].arguments == {"expression": "1+1"}
    for bad, why in (("<tool_call>{not json}</tool_call>", "not valid JSON"),
                     ("<tool_call>{\"name\": \"calculate\"", "not closed"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "must be"),
                     (call_text("search", q="x"), "unknown tool 'search'")):
        p = parse_tool_calls(bad, {"calculate"})
        assert p.status == PARSE_MALFORMED and why in p.error, bad


def test_token_spans_cover_exactly_the_call(tok):
    text = "Let me see. " + call_text("calculate", expression="13 + 8") + " done"
    ids = tok.encode(text, add_special_tokens=False)
    [call] = parse_tool_calls(text).calls
    [[a, b]] = token_spans(tok, ids, [call.span])
    got = tok.decode(ids[a:b])
    assert call_text("calculate", expression="13 + 8") in got                 # the span holds the call ...
    assert call_text("calculate", expression="13 + 8") not in tok.decode(ids[a + 1:b])   # ... and is minimal
    assert call_text("calculate", expression="13 + 8") not in tok.decode(ids[a:b - 1])


def test_expression_tool_evaluates_without_eval():
    assert evaluate_expression("(3 + 4) * 2 - -1") == 15
    for bad in ("__import__('os')", "2 ** 8", "1 / 2", "x + 1"):
        with pytest.raises(ValueError):
            evaluate_expression(bad)


# -- rendering tool results with the template ----------------------------------------------------------

def qwen_tools_template() -> str:
    """Qwen3's template (no-tools branch, as in test_chat_templates) with Qwen's tool-message branch."""
    loop_end = "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"      # the end of its messages loop
    assert QWEN3.count(loop_end) == 1
    return QWEN3.replace(loop_end, "{{- '<|im_end|>\\n' }}" + TOOL_BRANCH + "{%- endif %}{%- endfor %}")


def test_tool_results_read_as_the_official_rendering(tok):
    t = copy.deepcopy(tok)
    t.chat_template = qwen_tools_template()
    fmt = ChatFormat(t)
    stop = t.convert_tokens_to_ids(IM_END)
    answer = "Let me check. " + call_text("calculate", expression="12 + 7") + call_text("calculate", expression="1+1")
    ids = fmt.start("sys", "What is 12 + 7?")
    ids = ids + fmt.encode(answer) + [stop] + fmt.tool_continuation(["19", "2"], IM_END)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 12 + 7?"},
            {"role": "assistant", "content": answer}, {"role": "tool", "content": "19"},
            {"role": "tool", "content": "2"}]
    assert t.decode(ids) == t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_a_template_without_tools_gets_them_in_the_system_message(tok):
    fmt = ChatFormat(tok)              # Gyre's own template renders no tools
    tools = ArithmeticToolEnv().tools()
    text = tok.decode(fmt.start("You are a calculator.", "What is 1 + 1?", tools=tools))
    assert '"name": "calculate"' in text and "<tool_call>" in text and text.startswith("<|im_start|>system\nYou are")
    assert fmt.start("You are a calculator.", "What is 1 + 1?") != fmt.start("You are a calculator.", "What is 1 + 1?",
                                                                               tools=tools)


# -- the harness running tools -----------------------------------------------------------------------

class Scripted:
    """Answers each execution's calls with the next text of its script (stop token appended)."""

    version = 0

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.stop = tok, script, tok.convert_tokens_to_ids(IM_END)
        self.turn: dict[str, int] = {}

    def complete(self, calls):
        out = []
        for c in calls:
            k = self.turn.get(c.key, 0)
            self.turn[c.key] = k + 1
            ids = self.tok.encode(self.script[min(k, len(self.script) - 1)], add_special_tokens=False) + [self.stop]
            out.append(Completion(ids, [0.0] * len(ids), "stop", self.version))
        return out

    def release(self, key):
        pass


def run_script(tok, script, seed=3):
    """One execution of the tool env on `seed`; `script(env)`: the completions' texts, given the episode."""
    env = ArithmeticToolEnv(max_operand=20, ops="+")
    env.reset(seed)
    stop = tok.convert_tokens_to_ids(IM_END)
    [rec] = run_executions([ExecutionSpec("r", 0, "e0", "t", seed, "train")], Scripted(tok, script(env)),
                           HarnessConfig(max_turns=6, context_tokens=2048, max_new_tokens=64),
                           lambda: ArithmeticToolEnv(max_operand=20, ops="+"), ChatFormat(tok), {stop: IM_END}, 1)
    return rec, env


def test_harness_runs_tool_calls_and_records_their_spans(tok):
    rec, env = run_script(tok, lambda e: ["Let me compute. " + call_text("calculate", expression=e.question),
                                          str(e.answer)])
    assert rec.success and rec.status == "done" and rec.invalid_actions == 0
    first, second = rec.calls
    assert first.tool_parse == PARSE_OK and second.tool_parse == PARSE_NONE
    assert first.tool_call_ids == ["e0/0/0"]
    [[lo, hi]] = first.tool_spans
    assert f'"expression": "{env.question}"' in tok.decode(first.completion_ids[lo:hi])
    head = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[:len(head)] == head                         # an exact extension
    added = tok.decode(second.prompt_ids[len(head):])
    assert added == f"\n<|im_start|>tool\n{env.answer}<|im_end|>\n<|im_start|>assistant\n"   # Gyre's template


def test_a_malformed_call_is_shown_to_the_agent_and_counted(tok):
    rec, env = run_script(tok, lambda e: ["<tool_call>{not json}</tool_call>", str(e.answer)])
    first, second = rec.calls
    assert first.tool_parse == PARSE_MALFORMED and first.tool_spans == [] and rec.invalid_actions == 1
    added = tok.decode(second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):])
    assert "could not be run" in added and "not valid JSON" in added
    assert rec.success                                                   # the answer after it still counts


def test_tool_parse_and_spans_round_trip_through_the_lake(tok):
    from gyre_core.lake.schema import calls_table, executions_table, read_executions

    rec, _ = run_script(tok, lambda e: ["<tool_call>{not json}</tool_call>",
                                        call_text("calculate", expression=e.question), str(e.answer)])
    [back] = read_executions(executions_table([rec]), calls_table([rec]))
    assert [c.tool_parse for c in back.calls] == [PARSE_MALFORMED, PARSE_OK, PARSE_NONE]
    assert [c.tool_spans for c in back.calls] == [c.tool_spans for c in rec.calls] and back.calls[1].tool_spans


def test_the_contract_check_checks_tools():
    from gyre_core.envs import check_environment

    assert check_environment(ArithmeticToolEnv()) == []

    class Broken(ArithmeticToolEnv):
        def tools(self):
            return [{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}},
                    "junk"]

        def call_tool(self, name, arguments):
            return "ok"

    problems = check_environment(Broken())
    assert len(problems) == 3 and all(p.startswith("tools: ") for p in problems)
    assert any("repeat" in p for p in problems) and any("instead of raising" in p for p in problems)
