"""The recording proxy over real HTTP with the official `openai` SDK as its client: exact prompts across
turns and tool calls, streaming, stop strings, contexts and roles, refusals as OpenAI errors, limits.

The completions come from a scripted engine (each call answers the next text of a script, in the chunks
the proxy asks for), so what the model "said" is known exactly; the tokenizer and chat template are real.
References are the template's own rendering of the conversation as the model generated it, and ids
counted by hand. The engine-backed paths (a real model, cells switching mid-stream) are in
tests/integration/test_proxy_engines.py.

    .venv/bin/python -m pytest tests/core/test_proxy.py -q
"""
from __future__ import annotations

import contextlib
import json
import threading

import httpx
import openai
import pytest

from gyre_core.config import ProxyConfig
from gyre_core.engine import GenResult
from gyre_core.envs.arithmetic import ArithmeticToolEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.tools import system_with_tools
from gyre_core.model import IM_END, train_tokenizer
from gyre_core.processor.tree import build_tree
from gyre_core.proxy.pool import CellPool
from gyre_core.proxy.recorder import Limits
from gyre_core.proxy.server import ProxyServer
from gyre_core.proxy.service import Proxy
from gyre_core.records import ExecutionRecord

TOOLS = ArithmeticToolEnv().tools()
CALL = '<tool_call>\n{"name":"calculate","arguments":{"expression":"2+3"}}\n</tool_call>'   # compact JSON
SYSTEM = "You are a calculator."


@pytest.fixture(scope="module")
def tok():
    corpus = [SYSTEM, CALL, "What is 2 + 3? The answer is 5.", system_with_tools(SYSTEM, TOOLS)] * 20
    return train_tokenizer(corpus, vocab_size=320)


class ScriptedEngine:
    """Each new call answers the next text of `script` (+ the stop token); a call continued with the tokens it
    has so far gets the rest, `max_new_tokens` at a time, as a real engine would. `gate`: generate waits on it."""

    def __init__(self, tok, script: list[str], version: int = 0, gate: threading.Event | None = None):
        self.tok, self.stop = tok, tok.convert_tokens_to_ids(IM_END)
        self.stop_ids, self.version, self.gate = [self.stop], version, gate
        self.script = [tok.encode(t, add_special_tokens=False) + [self.stop] for t in script]
        self.started: list[tuple[list[int], list[int]]] = []     # (prompt, the whole answer) per call
        self.released: list[str] = []

    def generate(self, requests):
        if self.gate is not None:
            self.gate.wait(10)
        out = []
        for r in requests:
            found = next(((p, ids) for p, ids in self.started if r.prompt_ids[:len(p)] == p
                          and r.prompt_ids[len(p):] == ids[:len(r.prompt_ids) - len(p)]), None)
            if found is None:
                found = (list(r.prompt_ids), self.script[min(len(self.started), len(self.script) - 1)])
                self.started.append(found)
            p, ids = found
            done = len(r.prompt_ids) - len(p)
            new = ids[done:done + r.max_new_tokens]
            out.append(GenResult(new, [-0.5] * len(new), "stop" if new[-1] == self.stop else "length"))
        return out

    def release(self, key):
        self.released.append(key)


@contextlib.contextmanager
def serving(tok, engines, limits=None, **cfg):
    pool = CellPool(engines, chunk_tokens=cfg.pop("chunk_tokens", 3))
    stop = tok.convert_tokens_to_ids(IM_END)
    proxy = Proxy(ChatFormat(tok), {stop: IM_END}, pool, ProxyConfig(**cfg), limits or Limits(32, 100_000, 4096, 64),
                  model_name="tiny", temperature=1.0)
    server = ProxyServer(proxy, max_request_bytes=ProxyConfig(**cfg).max_request_bytes).start()
    try:
        yield proxy, server
    finally:
        server.stop()
        proxy.close()
        pool.stop()


def open_exe(proxy, name="e0"):
    rec = ExecutionRecord("r", 0, f"r/{name}", "t0", 0, "train", "arith")
    return rec, proxy.open_execution(rec)


def client(server, key, **kw):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, **kw)


def test_a_tool_call_turn_extends_the_exact_ids_and_counts_the_drift_a_rerender_would_have(tok):
    eng = ScriptedEngine(tok, [CALL, "The answer is 5."])
    with serving(tok, [eng]) as (proxy, server):
        rec, keys = open_exe(proxy)
        c = client(server, keys.main)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
        r1 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
        [tc] = r1.choices[0].message.tool_calls
        assert r1.choices[0].finish_reason == "tool_calls" and r1.choices[0].message.content is None
        assert tc.function.name == "calculate" and json.loads(tc.function.arguments) == {"expression": "2+3"}
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        r2 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
        assert r2.choices[0].message.content == "The answer is 5." and r2.choices[0].finish_reason == "stop"
        exe = proxy.close_execution(rec.execution_id)
    first, second = rec.calls
    # the first prompt: the template's rendering (the tools written into the system message: it renders none)
    sys_tools = {"role": "system", "content": system_with_tools(SYSTEM, TOOLS)}
    assert tok.decode(first.prompt_ids) == tok.apply_chat_template([sys_tools, msgs[1]], tokenize=False,
                                                                   add_generation_prompt=True)
    assert first.completion_ids == eng.script[0] and first.logprobs == [-0.5] * len(eng.script[0])
    # the second: exactly the first call's ids, then only the tool message rendered — which reads as the
    # template renders the conversation with the assistant turn as the model generated it
    base = first.prompt_ids + first.completion_ids
    assert second.prompt_ids[:len(base)] == base and (second.parent_call, second.prefix_len) == (0, len(base))
    as_generated = [sys_tools, msgs[1], {"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"}]
    assert tok.decode(second.prompt_ids) == tok.apply_chat_template(as_generated, tokenize=False, add_generation_prompt=True)
    assert second.context_index == first.context_index == 0 and {first.role, second.role} == {"main"}
    # the recorded tool call: its parse, the id the client got, the tokens that produced it
    assert first.tool_parse == "ok" and first.tool_call_ids == [tc.id]
    [[a, b]] = first.tool_spans
    assert tok.decode(first.completion_ids[a:b]) == CALL and b == len(first.completion_ids) - 1
    # re-rendering the messages would have written the tool call as the template does: other ids
    assert second.rerender_drift is True and exe.drift_prevented == 1 and exe.drift_measured == 1
    assert [c.versions for c in rec.calls] == [[0] * len(c.completion_ids) for c in rec.calls]
    assert eng.released == ["r/e0/c0"]                 # the context's cache is dropped when the execution ends


def test_streaming_gives_the_recorded_text_cut_at_a_stop_string_and_streams_tool_calls(tok):
    eng = ScriptedEngine(tok, ["Hello world. Stop here, more text", CALL])
    with serving(tok, [eng], chunk_tokens=2) as (proxy, server):
        rec, keys = open_exe(proxy)
        c = client(server, keys.main)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, stop=["Stop"], stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == "Hello world. " and [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1    # it streamed
        usage = chunks[-1].usage
        stream2 = c.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "add"}],
                                            tools=TOOLS, stream=True)
        deltas = [ch.choices[0].delta for ch in stream2 if ch.choices]
        proxy.close_execution(rec.execution_id)
    first = rec.calls[0]
    # the completion is cut after the token that completed "Stop"; the client was shown the text before it
    cut = next(k for k in range(1, len(eng.script[0])) if "Stop" in tok.decode(eng.script[0][:k]))
    assert first.completion_ids == eng.script[0][:cut] and first.finish_reason == "stop"
    assert usage.completion_tokens == cut and usage.prompt_tokens == len(first.prompt_ids)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert not any(d.content for d in deltas)          # nothing of the tool-call block leaked as text
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("calculate", {"expression": "2+3"})]
    assert rec.calls[1].tool_call_ids == [calls[0].id]


def test_contexts_roles_and_branches_form_from_what_the_harness_did(tok):
    eng = ScriptedEngine(tok, ["one", "two", "three", "four", "five", "six"])
    with serving(tok, [eng]) as (proxy, server):
        rec, keys = open_exe(proxy)
        main, sub = client(server, keys.main), client(server, keys.sub_agent)
        sys_ = {"role": "system", "content": SYSTEM}
        msgs = [sys_, {"role": "user", "content": "task"}]
        a = main.chat.completions.create(model="tiny", messages=msgs).choices[0].message.content
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": "go on"}]
        main.chat.completions.create(model="tiny", messages=msgs)                         # call 1: appends
        sub.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "helper"},
                                                            {"role": "user", "content": "sub-task"}])   # call 2
        compacted = [sys_, {"role": "user", "content": "task\nnotes: one"}]
        main.chat.completions.create(model="tiny", messages=compacted)                   # call 3: compaction
        main.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "other"},
                                                             {"role": "user", "content": "x"}],
                                     extra_headers={"X-Gyre-Role": "sub-agent"})         # call 4: declared
        # a history the harness rewrote (its first answer edited): a new context, a branch of context 0 in its role
        # (the first call's messages, then another answer than its reply), off the shared prefix
        edited = [sys_, {"role": "user", "content": "task"}, {"role": "assistant", "content": "ONE"},
                  {"role": "user", "content": "go on"}]
        main.chat.completions.create(model="tiny", messages=edited)                      # call 5
        proxy.close_execution(rec.execution_id)
    c = rec.calls
    assert [(x.context_index, x.role) for x in c] == [(0, "main"), (0, "main"), (1, "sub-agent"), (2, "main-summary"),
                                                      (3, "sub-agent"), (4, "main")]
    assert c[1].parent_call == 0 and c[1].prefix_len == len(c[0].prompt_ids) + len(c[0].completion_ids)
    # fresh contexts name the earlier call they share the most leading tokens with
    for x in (c[3], c[5]):
        p = c[x.parent_call]
        shared = p.prompt_ids + p.completion_ids
        assert x.prompt_ids[:x.prefix_len] == shared[:x.prefix_len] and x.prompt_ids[x.prefix_len] != shared[x.prefix_len]
    assert c[5].parent_call in (0, 1) and c[5].prefix_len > len(c[0].prompt_ids) - 3   # up to the rewritten answer
    tree, rejects = build_tree([rec])
    assert not rejects and len(tree.leaves) == 5     # contexts 0 (its last call), 1, 2, 3 and the edited branch


def test_completions_takes_text_or_ids_and_reuses_served_ids(tok):
    eng = ScriptedEngine(tok, ["abc", "def"])
    with serving(tok, [eng]) as (proxy, server):
        rec, keys = open_exe(proxy)
        c = client(server, keys.main)
        r1 = c.completions.create(model="tiny", prompt="What is 2 + 3?")
        assert r1.choices[0].text == "abc" and r1.usage.completion_tokens == len(eng.script[0])
        c.completions.create(model="tiny", prompt="What is 2 + 3?" + "abc" + IM_END + " more")
        ids = tok.encode("x y", add_special_tokens=False)
        c.completions.create(model="tiny", prompt=ids)
        proxy.close_execution(rec.execution_id)
    first, second, third = rec.calls
    assert first.prompt_ids == tok.encode("What is 2 + 3?", add_special_tokens=False)
    base = first.prompt_ids + first.completion_ids
    assert second.prompt_ids == base + tok.encode(" more", add_special_tokens=False)
    assert second.context_index == 0 and second.prefix_len == len(base)
    assert third.prompt_ids == ids and third.context_index == 1


@pytest.mark.bad_input("bad proxy requests")
def test_refusals_are_openai_errors_and_limits_end_the_execution(tok):
    gate = threading.Event()
    eng = ScriptedEngine(tok, ["ok"] * 8, gate=gate)
    with serving(tok, [eng], limits=Limits(3, 100_000, 200, 8), max_request_bytes=4096, max_inflight=1) as (proxy, server):
        rec, keys = open_exe(proxy)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError) as e:
            client(server, "gyre-not-a-key").chat.completions.create(model="tiny", messages=msgs)
        assert e.value.body["code"] == "invalid_api_key"
        raw = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys.main}"})
        for body, status, needle in ((b"{not json", 400, "not valid JSON"), (b"[1]", 400, "JSON object"),
                                     (b'{"messages": "x"}', 400, "messages"), (b"x" * 5000, 413, "over 4096"),
                                     (json.dumps({"messages": msgs, "n": 2}).encode(), 400, "n > 1"),
                                     (json.dumps({"messages": [{"role": "user", "content": "y" * 3000}]}).encode(), 400,
                                      "context")):
            r = raw.post("/v1/chat/completions", content=body)
            assert r.status_code == status and needle in r.json()["error"]["message"], (body[:40], r.text)
            assert "Traceback" not in r.text
        assert raw.post("/v1/chat/completions", content=b"{}", headers={"Authorization": ""}).status_code == 401
        # one request in flight per execution here: a second one at the same time is refused with 429
        first = threading.Thread(target=lambda: client(server, keys.main).chat.completions.create(model="tiny", messages=msgs))
        first.start()
        exe = proxy.execution(rec.execution_id)
        while exe.inflight == 0:
            pass
        with pytest.raises(openai.RateLimitError):
            client(server, keys.sub_agent).chat.completions.create(model="tiny", messages=msgs)
        gate.set()
        first.join()
        c = client(server, keys.main)
        c.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "2"}])
        c.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "3"}])
        with pytest.raises(openai.BadRequestError) as e:      # a 4th model call: over max_calls=3
            c.chat.completions.create(model="tiny", messages=msgs)
        assert e.value.body["code"] == "execution_limit" and exe.limit_status == "turn_limit"
        proxy.close_execution(rec.execution_id)
        with pytest.raises(openai.AuthenticationError):         # an ended execution's key is gone
            c.models.list()
    assert len(rec.calls) == 3


def test_request_sampling_refuses_top_p(tok):
    with serving(tok, [ScriptedEngine(tok, ["a"])], sampling="request") as (proxy, server):
        _, keys = open_exe(proxy)
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client(server, keys.main).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                             top_p=0.9)


def test_a_proxy_off_loopback_needs_a_token():
    with pytest.raises(ValueError, match="admin_token"):
        ProxyConfig(host="0.0.0.0")
    assert ProxyConfig(host="0.0.0.0", admin_token="t").host == "0.0.0.0"


def test_ending_an_execution_lets_go_of_its_call_in_flight(tok):
    gate = threading.Event()
    with serving(tok, [ScriptedEngine(tok, ["never recorded"], gate=gate)]) as (proxy, server):
        rec, keys = open_exe(proxy)
        errors = []

        def ask():
            try:
                client(server, keys.main).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
            except openai.APIStatusError as exc:
                errors.append(exc)

        t = threading.Thread(target=ask)
        t.start()
        exe = proxy.execution(rec.execution_id)
        while not exe.jobs:
            pass
        closer = threading.Thread(target=proxy.close_execution, args=(rec.execution_id,))
        closer.start()
        while not exe.closed:
            pass
        gate.set()                     # the engine answers; the execution has ended meanwhile
        t.join(30)
        closer.join(30)
    assert rec.calls == [] and exe.inflight == 0
    assert len(errors) == 1 and errors[0].body["code"] == "execution_ended"


class EnvProbe(ArithmeticToolEnv):
    """Its workspace check reads what the agent program saw of its environment."""

    seen: dict = {}

    def score_workspace(self, path):
        from pathlib import Path

        EnvProbe.seen = json.loads(Path(path, "env.json").read_text())
        return super().score_workspace(path)


def test_an_external_program_gets_its_endpoint_not_gyres_secrets_and_its_group_is_stopped(tok, monkeypatch, tmp_path):
    from pathlib import Path

    from gyre_core.config import load_config
    from gyre_core.harness.external import run_agent, score_agent
    from gyre_core.harness.loop import ExecutionSpec

    monkeypatch.setenv("GYRE_TEST_SECRET", "s3cret")
    monkeypatch.setenv("GYRE_TEST_PASSED", "ok")
    pidfile = tmp_path / "child.pid"
    program = ("import os, json, subprocess, sys; json.dump(dict(os.environ), open('env.json', 'w')); "
               f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
               f"open({str(pidfile)!r}, 'w').write(str(p.pid))")
    cfg = load_config("proxy-smoke", ["harness.pass_env=[GYRE_TEST_PASSED]"])
    cfg.harness.command = ["python", "-c", program]
    with serving(tok, [ScriptedEngine(tok, ["a"])]) as (proxy, server):
        env = EnvProbe()
        rec = score_agent(cfg, *run_agent(cfg, proxy, server.base_url, ["python", "-c", program],
                                          ExecutionSpec("r", 0, "r/e0", "t0", 3, "train"), env), env)
    seen = EnvProbe.seen
    assert rec.status == "done" and rec.calls == []
    assert seen["OPENAI_BASE_URL"] == server.base_url and seen["OPENAI_API_KEY"].startswith("gyre-")
    assert seen["GYRE_TASK"].startswith("What is") and seen["GYRE_TEST_PASSED"] == "ok"
    assert "GYRE_TEST_SECRET" not in seen and "PATH" in seen
    # the background child it left running was stopped with it: gone, or dead and not yet reaped (a zombie)
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
