"""The recording proxy: its overhead per call, many executions at once, token fidelity, a switch mid-stream.

    python -m bench.proxy [--quick]        # prints JSON figures
    gyre bench proxy --json

All on Gyre's tiny model and the local engine (one torch thread), the proxy on loopback.

- Overhead: one conversation of sequential chat calls (8 new tokens each, its history growing), sent by a
  client in a process of its own as raw HTTP on a kept-alive connection; per call, the client's wall time
  minus the time the engine spent generating it (measured around `generate` beneath the proxy) — what the
  proxy adds: HTTP, auth, matching the history against served contexts, rendering the new messages, handing
  the call to its cell and back, building the response. With the drift measure on (the default: a
  background thread re-renders each continued request whole, competing for the GIL) and off (`_no_drift`).
  `direct_call_ms` is the engine called directly on the same prompts.
- Concurrency: `concurrent_executions` executions, each its own key, run 3 chat turns at once through one
  proxy (AsyncOpenAI, the official SDK); `client_errors` counts every exception any of them saw.
- Fidelity: examples/openai_agent.py (the official SDK; tools, a sub-agent, compaction) run as the external
  harness of 16 executions; `fidelity` is the share of recorded calls whose completion ids and log-probs are
  exactly what the engine generated for the recorded prompt (rebuilt from the engine's own log, chunk by
  chunk); `drift_prevented` the calls whose messages, re-rendered from scratch, would have tokenised to
  other prompt ids than the exact ones recorded (of `drift_measured` continued calls). Tiny model, and, where
  it has been fetched, SmolLM2-135M-Instruct (`_smollm2`: a real chat model's text).
- Switch: 32 streamed responses on two cells; once every stream has its first tokens, cell 0 leaves
  rollout; `switch_moved` calls continue on cell 1, `switch_client_errors` counts client exceptions, and
  `switch_streams_equal_record` whether each client's text is the decoded recorded completion.
"""
from __future__ import annotations

import asyncio
import copy
import json
import statistics
import threading
import time

import torch

SYSTEM = "You are a careful assistant who solves arithmetic."
SMOLLM2 = "data/models/SmolLM2-135M-Instruct"      # `gyre model fetch smollm2-135m-instruct` (the real presets fetch it)


class LoggedEngine:
    """A real engine, each generate call logged (prompt ids, returned ids, log-probs) and timed."""

    def __init__(self, inner):
        self.inner, self.log, self.seconds, self.lock = inner, [], [], threading.Lock()

    def generate(self, requests):
        t0 = time.perf_counter()
        out = self.inner.generate(requests)
        dt = time.perf_counter() - t0
        with self.lock:
            self.log += [(tuple(r.prompt_ids), list(o.completion_ids), list(o.logprobs)) for r, o in zip(requests, out)]
            self.seconds.append(dt)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def engine_index(*engines) -> dict:
    """prompt ids -> the (ids, log-probs) each logged generate call returned for it (a prompt may recur)."""
    index: dict = {}
    for e in engines:
        for p, ids, lps in e.log:
            index.setdefault(p, []).append((ids, lps))
    return index


def generated(index: dict, call) -> bool:
    """Whether a recorded call's completion and log-probs are what the engines generated for its prompt,
    chunk by chunk (each logged chunk used once)."""
    done = 0
    while done < len(call.completion_ids):
        options = index.get(tuple(call.prompt_ids + call.completion_ids[:done]), [])
        hit = next((o for o in options if o[0] == call.completion_ids[done:done + len(o[0])]
                    and o[1] == call.logprobs[done:done + len(o[0])]), None)
        if hit is None:
            return False
        options.remove(hit)
        done += len(hit[0])
    return done == len(call.completion_ids)


def _tiny():
    from examples.openai_agent import HELPER_SYSTEM, TOOLS
    from gyre_core.model import build_tiny_model, train_tokenizer

    corpus = [SYSTEM, HELPER_SYSTEM, json.dumps(TOOLS), "What is 12 + 7? Write the answer, a number, to answer.txt."] * 10
    tok = train_tokenizer(corpus, vocab_size=320)
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=128,
                             max_positions=8192, seed=0)
    return tok, model


def _cfg(*overrides):
    from gyre_core.config import load_config

    return load_config("proxy-smoke", ["harness.context_tokens=8000", "harness.max_turns=1000", *overrides])


def _record(name: str):
    from gyre_core.records import ExecutionRecord

    return ExecutionRecord("bench", 0, f"bench/{name}", name, 0, "train", "bench")


def conversation_client(base_url: str, key: str, calls: int) -> list[float]:
    """The overhead bench's client, run in a process of its own (as a harness is): `calls` sequential chat
    calls of one growing conversation, raw HTTP on one kept-alive connection; each call's wall seconds."""
    import socket

    import httpx

    nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60, transport=nodelay)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    walls = []
    for i in range(calls):
        body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 8}).encode()
        t0 = time.perf_counter()
        r = http.post("/chat/completions", content=body, headers={"Content-Type": "application/json"})
        walls.append(time.perf_counter() - t0)
        r.raise_for_status()
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"and {i}?"}]
    return walls


def overhead(tok, model, calls: int, measure_drift: bool = True) -> dict:
    import subprocess
    import sys

    from gyre_core.engine import GenRequest, LocalEngine
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.model import stop_token_ids
    from gyre_core.proxy import open_proxy
    from gyre_core.proxy.pool import CellPool

    stops = stop_token_ids(model, tok)
    eng = LoggedEngine(LocalEngine(model, stops, seed=0))
    cfg = _cfg("harness.max_new_tokens=8", "proxy.chunk_tokens=8", f"proxy.measure_drift={str(measure_drift).lower()}")
    warm = 5
    with open_proxy(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, CellPool([eng], cfg.proxy.chunk_tokens),
                    1.0) as (proxy, server):
        rec = _record("overhead")
        keys = proxy.open_execution(rec)
        import os

        out = subprocess.run([sys.executable, "-m", "bench.proxy", "--client", server.base_url, str(calls + warm)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "OPENAI_API_KEY": keys.main})
        if out.returncode:
            raise RuntimeError(f"the overhead client failed: {out.stderr.strip()[-500:]}")
        walls = json.loads(out.stdout.strip().splitlines()[-1])
        proxy.close_execution(rec.execution_id)
    # one engine round per call (max_tokens = chunk_tokens), calls one after another: round i is call i
    assert len(eng.seconds) == len(walls) == len(rec.calls)
    lat = [w - g for w, g in zip(walls[warm:], eng.seconds[warm:])]
    direct_eng = LocalEngine(model, stops, seed=0)         # the engine called directly on the same prompts
    direct = []
    for c in rec.calls[warm:]:
        t0 = time.perf_counter()
        direct_eng.generate([GenRequest(f"r{c.context_index}", c.prompt_ids, 8, 1.0)])
        direct.append(time.perf_counter() - t0)
    q = statistics.quantiles([x * 1e3 for x in lat], n=100)
    tag = "" if measure_drift else "_no_drift"
    return {f"overhead_p50_ms{tag}": round(statistics.median(lat) * 1e3, 3), f"overhead_p99_ms{tag}": round(q[98], 3),
            f"overhead_calls{tag}": len(lat), f"engine_call_ms_p50{tag}": round(statistics.median(eng.seconds[warm:]) * 1e3, 3),
            f"direct_call_ms_p50{tag}": round(statistics.median(direct) * 1e3, 3),
            f"prompt_tokens_last{tag}": len(rec.calls[-1].prompt_ids)}


def concurrency(tok, model, n: int) -> dict:
    import openai

    from gyre_core.engine import LocalEngine
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.model import stop_token_ids
    from gyre_core.proxy import open_proxy
    from gyre_core.proxy.pool import CellPool

    stops = stop_token_ids(model, tok)
    cfg = _cfg("harness.max_new_tokens=8")
    errors: list[str] = []
    pool = CellPool([LocalEngine(model, stops, seed=0)], cfg.proxy.chunk_tokens)
    with open_proxy(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, pool, 1.0) as (proxy, server):
        recs = [_record(f"c{i}") for i in range(n)]
        keys = [proxy.open_execution(r) for r in recs]

        async def one(i: int) -> None:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key=keys[i].main, max_retries=0, timeout=300)
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {i} + 1?"}]
            try:
                for turn in range(3):
                    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
                    msgs += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"turn {turn}"}]
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                await client.close()

        async def all_of() -> None:
            await asyncio.gather(*(one(i) for i in range(n)))

        t0 = time.perf_counter()
        asyncio.run(all_of())
        wall = time.perf_counter() - t0
        for r in recs:
            proxy.close_execution(r.execution_id)
    calls = sum(len(r.calls) for r in recs)
    return {"concurrent_executions": n, "client_errors": len(errors), "concurrent_calls": calls,
            "concurrent_wall_s": round(wall, 2), "concurrent_calls_per_s": round(calls / wall, 1),
            **({"client_error_example": errors[0][:200]} if errors else {})}


def fidelity(tok, model, executions: int, tag: str = "") -> dict:
    from gyre_core.engine import LocalEngine
    from gyre_core.envs import load_env
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.harness.external import run_external
    from gyre_core.harness.loop import ExecutionSpec
    from gyre_core.model import stop_token_ids
    from gyre_core.proxy.pool import CellPool

    stops = stop_token_ids(model, tok)
    eng = LoggedEngine(LocalEngine(model, stops, seed=0))
    cfg = _cfg("harness.command=[python,examples/openai_agent.py,--max-turns,4,--max-tokens,16,--compact-at,500]",
               "harness.max_new_tokens=16", "rollout.concurrency=8")
    specs = [ExecutionSpec("bench", 0, f"bench/f{i}", f"seed{i // 4}", i // 4, "train") for i in range(executions)]
    t0 = time.perf_counter()
    records = run_external(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, CellPool([eng]), 1.0, specs,
                           lambda: load_env(cfg.env.target, **cfg.env.kwargs))
    wall = time.perf_counter() - t0
    index = engine_index(eng)
    calls = [c for r in records for c in r.calls]
    exact = sum(generated(index, c) for c in calls)
    measured = [c for c in calls if c.rerender_drift is not None]
    out = {"fidelity": round(exact / len(calls), 4) if calls else None, "fidelity_calls": len(calls),
           "drift_prevented": sum(c.rerender_drift for c in measured), "drift_measured": len(measured),
           "agent_executions": len(records), "agent_failed": sum(r.status == "failed" for r in records),
           "agent_roles": sorted({c.role for c in calls}), "agent_tool_calls": sum(len(c.tool_call_ids) for c in calls),
           "agent_wall_s": round(wall, 1)}
    return {f"{k}{tag}": v for k, v in out.items()}


def switch(tok, model, streams: int) -> dict:
    import openai

    from gyre_core.engine import LocalEngine
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.proxy import open_proxy
    from gyre_core.proxy.pool import CellPool

    cfg = _cfg("proxy.chunk_tokens=4", "harness.max_new_tokens=48")
    never = len(tok) + 7        # a stop id outside the vocabulary: every stream runs its 48 tokens
    cells = [LoggedEngine(LocalEngine(copy.deepcopy(model), [never], version=v, seed=v)) for v in (0, 1)]
    got, errors = {}, []
    barrier = threading.Barrier(streams + 1)
    with open_proxy(cfg, ChatFormat(tok), {}, CellPool(cells, cfg.proxy.chunk_tokens), 1.0) as (proxy, server):
        recs = [_record(f"s{i}") for i in range(streams)]
        keys = [proxy.open_execution(r) for r in recs]

        def stream(i: int) -> None:
            waited = False
            try:
                c = openai.OpenAI(base_url=server.base_url, api_key=keys[i].main, max_retries=0, timeout=300)
                text = ""
                for ch in c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"go {i}"}],
                                                    max_tokens=48, stream=True):
                    if ch.choices and ch.choices[0].delta.content:
                        text += ch.choices[0].delta.content
                        if not waited:
                            waited = True
                            barrier.wait(120)
                got[i] = text
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(f"{type(exc).__name__}: {exc}")
                if not waited:
                    barrier.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        barrier.wait(120)
        on_cell0 = proxy.pool.load()[0]
        proxy.pool.close_cell(0)
        for t in threads:
            t.join(300)
        for r in recs:
            proxy.close_execution(r.execution_id)
        moved = proxy.pool.moves
    index = engine_index(*cells)
    equal = all(got.get(i) == tok.decode(r.calls[0].completion_ids) and generated(index, r.calls[0])
                for i, r in enumerate(recs) if r.calls)
    return {"switch_streams": streams, "switch_on_leaving_cell": on_cell0, "switch_moved": moved,
            "switch_client_errors": len(errors), "switch_streams_equal_record": equal}


def bench_proxy(quick: bool = False) -> dict:
    torch.set_num_threads(1)
    tok, model = _tiny()
    out = {}
    out.update(overhead(tok, model, 100 if quick else 200))
    out.update(overhead(tok, model, 100 if quick else 200, measure_drift=False))
    out.update(concurrency(tok, model, 64 if quick else 256))
    out.update(fidelity(tok, model, 8 if quick else 16))
    from pathlib import Path

    if not quick and Path(SMOLLM2).is_dir():      # a real chat model, where re-tokenising is subtler
        from gyre_core.model import load_policy

        model, tok = load_policy(SMOLLM2)
        out.update(fidelity(tok, model, 16, tag="_smollm2"))
    out.update(switch(tok, model, 8 if quick else 32))
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--client"]:
        import os

        print(json.dumps(conversation_client(sys.argv[2], os.environ["OPENAI_API_KEY"], int(sys.argv[3]))))
    else:
        print(json.dumps(bench_proxy(quick="--quick" in sys.argv)))
