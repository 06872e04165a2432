"""The proxy on real engines: a cell leaving rollout during streamed responses, and a third-party agent
(examples/openai_agent.py, the official `openai` SDK) trained through it as an external harness.

References are the engines' own outputs, logged beneath the proxy (every generate call: its prompt and the
ids it returned; `bench.proxy.LoggedEngine`), so "the record equals what the engine generated" is checked against an independent log,
and the tokens a client was streamed against the record.

    .venv/bin/python -m pytest tests/integration/test_proxy_engines.py -q
"""
from __future__ import annotations

import copy
import threading

import openai
import pytest

from gyre_core.config import load_config
from gyre_core.engine import LocalEngine
from gyre_core.envs import load_env
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.external import run_external
from gyre_core.harness.loop import ExecutionSpec
from gyre_core.model import build_tiny_model, stop_token_ids, train_tokenizer
from gyre_core.processor.tree import build_forest
from gyre_core.proxy import open_proxy
from gyre_core.proxy.pool import CellPool

from bench.proxy import LoggedEngine, engine_index, generated
from examples.openai_agent import HELPER_SYSTEM, SYSTEM, TOOLS


@pytest.fixture(scope="module")
def tiny():
    corpus = [SYSTEM, HELPER_SYSTEM, str(TOOLS), "What is 12 + 7? Write the answer, a number, to answer.txt."] * 10
    tok = train_tokenizer(corpus, vocab_size=320)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=128,
                             max_positions=4096, seed=0)
    return tok, model


def test_a_cell_leaving_rollout_mid_stream_is_invisible_to_clients(tiny):
    tok, model = tiny
    cfg = load_config("proxy-smoke", ["proxy.chunk_tokens=2", "harness.max_new_tokens=40"])
    never = len(tok) + 7          # a stop id outside the vocabulary: every stream runs its 40 tokens
    cells = [LoggedEngine(LocalEngine(copy.deepcopy(model), [never], version=v, seed=v)) for v in (0, 1)]
    n, got, errors = 6, {}, []
    first_chunk = threading.Barrier(n + 1)
    with open_proxy(cfg, ChatFormat(tok), {}, CellPool(cells, cfg.proxy.chunk_tokens), 1.0) as (proxy, server):
        from gyre_core.records import ExecutionRecord

        recs = [ExecutionRecord("r", 0, f"r/e{i}", f"t{i}", i, "train", "x") for i in range(n)]
        keys = [proxy.open_execution(r) for r in recs]

        def stream(i: int) -> None:
            try:
                c = openai.OpenAI(base_url=server.base_url, api_key=keys[i].main, max_retries=0)
                s = c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"count {i}"}],
                                              max_tokens=40, stream=True)
                text, finish, waited = "", None, False
                for ch in s:
                    if ch.choices and ch.choices[0].delta.content:
                        text += ch.choices[0].delta.content
                        if not waited:              # hold here until every stream has its first tokens
                            waited = True
                            first_chunk.wait(60)
                    if ch.choices and ch.choices[0].finish_reason:
                        finish = ch.choices[0].finish_reason
                got[i] = (text, finish)
            except Exception as exc:  # noqa: BLE001 - counted: the client must see none
                errors.append(exc)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        first_chunk.wait(60)
        on_cell0 = proxy.pool.load()[0]
        proxy.pool.close_cell(0)                 # cell 0 leaves rollout with its streams half done
        for t in threads:
            t.join(120)
        for r in recs:
            proxy.close_execution(r.execution_id)
        moves = proxy.pool.moves
    assert not errors and len(got) == n
    assert on_cell0 > 0 and moves == on_cell0    # every call that was on cell 0 moved, none failed
    for r in recs:
        [call] = r.calls
        text, finish = got[int(r.execution_id[-1])]
        assert finish == "length" and len(call.completion_ids) == 40
        assert text == tok.decode(call.completion_ids)         # the client saw exactly the recorded tokens
        assert generated(engine_index(*cells), call)
        # each token carries the version of the cell that generated it: cell 0 (v0) first, then cell 1 (v1)
        k = call.versions.count(0)
        assert call.versions == [0] * k + [1] * (40 - k)


def test_the_openai_sdk_agent_trains_through_the_proxy_with_exact_tokens(tiny):
    tok, model = tiny
    cfg = load_config("proxy-smoke", ["harness.command=[python,examples/openai_agent.py,--max-turns,3,"
                                      "--max-tokens,12,--compact-at,300]"])
    env_cfg = cfg.env
    stops = stop_token_ids(model, tok)
    eng = LoggedEngine(LocalEngine(model, stops, seed=0))
    specs = [ExecutionSpec("r", 0, f"r/s0/t{i // 2}/g{i % 2}", f"seed{i // 2}", i // 2, "train") for i in range(4)]
    records = run_external(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, CellPool([eng]), 1.0, specs,
                           lambda: load_env(env_cfg.target, **env_cfg.kwargs))
    assert [r.status for r in records] == ["done"] * 4, [r.error for r in records]
    index = engine_index(eng)
    for r in records:
        calls = r.calls
        # fidelity: every recorded completion is what the engine generated, log-probs included
        assert all(generated(index, c) for c in calls)
        # where the harness only appended, the prompt is the previous call's exact ids + the new messages
        for c in calls:
            prev = [p for p in calls[:c.call_index] if p.context_index == c.context_index]
            if prev:
                base = prev[-1].prompt_ids + prev[-1].completion_ids
                assert c.parent_call == prev[-1].call_index and c.prompt_ids[:len(base)] == base
        # the sub-agent asked first, then the main agent, its compaction and the fresh context after it
        roles = [c.role for c in calls]
        assert roles[0] == "sub-agent" and roles[1] == "main" and "main-summary" in roles, roles
        assert r.compactions == 1
        summary = next(c for c in calls if c.role == "main-summary")
        assert summary.parent_call >= 0 and summary.prefix_len > 0      # it shares the system prompt
        assert r.success in (True, False) and 0.0 <= r.partial <= 1.0
    trees, rejects = build_forest(records)
    assert not rejects and len(trees) == 2
    # the tree stores the shared prefixes once: fewer tokens than the contexts' sum
    assert all(t.n_stored < sum(len(c.prompt_ids) + len(c.completion_ids) for c in t_calls(records, t))
               for t in trees)


def t_calls(records, tree):
    return [c for r in records if r.execution_id in tree.execution_ids for c in r.calls]


def test_gyre_proxy_serves_a_model_and_writes_ended_executions_to_the_lake(tiny, tmp_path):
    from gyre_core.lake.sql import connect
    from gyre_core.model import save_policy
    from gyre_core.proxy.standalone import serve

    tok, model = tiny
    save_policy(model, tok, str(tmp_path / "m"))
    cfg = load_config("default", [f"model.path={tmp_path}/m", f"lake.root={tmp_path}/lake", "harness.max_new_tokens=8",
                                  "harness.context_tokens=2048", "proxy.admin_token=sesame"])
    (tmp_path / "lake").mkdir()
    stop, up = threading.Event(), {}
    ready = threading.Event()
    t = threading.Thread(target=serve, args=(cfg, "byhand", stop, lambda s, a: (up.update(s=s), ready.set())))
    t.start()
    try:
        assert ready.wait(60)
        import httpx

        admin = httpx.Client(base_url=up["s"].url, headers={"Authorization": "Bearer sesame"})
        assert httpx.post(up["s"].url + "/gyre/executions", headers={"Authorization": "Bearer nope"}).status_code == 401
        opened = admin.post("/gyre/executions", json={"task_id": "t1"}).json()
        c = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        r = c.chat.completions.create(model=c.models.list().data[0].id, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        c.chat.completions.create(model="m", messages=msgs)
        assert admin.get(f"/gyre/executions/{opened['execution_id']}").json()["calls"] == 2
        bad = admin.post(f"/gyre/executions/{opened['execution_id']}/end", json={"reward": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"      # still open: nothing lost
        ended = admin.post(f"/gyre/executions/{opened['execution_id']}/end", json={"reward": 1.0, "success": True}).json()
        assert ended["written"] and ended["calls"] == 2 and ended["contexts"] == 1
    finally:
        stop.set()
        t.join(30)
    con = connect(str(tmp_path / "lake"), run_id="byhand")
    assert con.execute("SELECT reward, success, n_calls FROM executions").fetchall() == [(1.0, True, 2)]
    rows = con.execute("SELECT call_index, prompt_len, len(completion_ids), prefix_len FROM calls ORDER BY 1").fetchall()
    (i0, p0, c0, _), (i1, p1, _, pre1) = rows
    assert (i0, i1) == (0, 1) and pre1 == p0 + c0 and p1 > pre1                 # the second call extends the first's exact ids


@pytest.mark.fault("the recording proxy stops mid-call", "the executions in flight fail with that reason (not "
                   "scored, not trained); none hangs; run_external returns every record")
def test_a_proxy_that_stops_mid_run_fails_the_executions_in_flight(tiny, monkeypatch):
    """The proxy's server is stopped from inside its third model call (on a thread: a handler cannot wait for
    its own server). The agents then meet a closed port; every execution that ran past that point is failed
    with the reason instead of being scored on what it left."""
    import gyre_core.proxy as proxy_module

    tok, model = tiny
    cfg = load_config("proxy-smoke", ["harness.command=[python,examples/openai_agent.py,--max-turns,3,"
                                      "--max-tokens,12,--compact-at,300]", "rollout.concurrency=4"])
    stops = stop_token_ids(model, tok)
    servers, calls = [], []
    real_open = proxy_module.open_proxy

    def open_proxy(*a, **k):
        cm = real_open(*a, **k)

        class Capture:
            def __enter__(self):
                out = cm.__enter__()
                servers.append(out[1])
                return out

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Capture()
    monkeypatch.setattr(proxy_module, "open_proxy", open_proxy)

    class Stopping(LocalEngine):
        def generate(self, requests):
            calls.append(len(requests))
            if len(calls) == 3:
                threading.Thread(target=servers[0].stop, daemon=True).start()
            return super().generate(requests)

    eng = Stopping(model, stops, seed=0)
    specs = [ExecutionSpec("r", 0, f"r/s0/t{i}/g0", f"seed{i}", i, "train") for i in range(4)]
    records = run_external(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, CellPool([eng]), 1.0, specs,
                           lambda: load_env(cfg.env.target, **cfg.env.kwargs))
    assert len(records) == 4 and not servers[0].alive()
    # all four were in flight at the third call (each makes several): none is scored on what it left
    assert [r.status for r in records] == ["failed"] * 4, [(r.status, r.error) for r in records]
    reasons = [r.error.split(":")[0] for r in records]
    assert set(reasons) <= {"the proxy stopped serving while the agent ran",
                            "the agent exited with status 1 before any model call"}, reasons
    assert "the proxy stopped serving while the agent ran" in reasons
