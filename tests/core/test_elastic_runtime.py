"""The elastic coordinator with emulated cells: real agent processes, router, controller and queues;
device work replaced by waits. Executions must survive role switches and a lost cell, token for token."""
from __future__ import annotations

import dataclasses
import time

import pytest

from gyre_core.config import ConfigError, ElasticConfig, load_config
from gyre_core.elastic.controller import Counters
from gyre_core.elastic.devices import emulated_token
from gyre_core.elastic.messages import CallRequest, Gen, Release
from gyre_core.elastic.runtime import Coordinator, run_elastic
from gyre_core.elastic.work import TOKENS_PER_CALL
from gyre_core.elastic.workload import Workload

FAST = Workload(name="test", executions_per_step=12, steps=3, calls_median=6, calls_sigma=0.6, max_calls=14,
                call_s=0.02, env_s=0.01, train_s_per_call=0.002, optimizer_s=0.01, publish_s=0.01,
                switch_to_train_s=0.01, switch_to_rollout_s=0.01, seed=3)


def _check_tito(result, workload: Workload) -> None:
    """Every execution made exactly its calls, each call exactly TOKENS_PER_CALL tokens with no gap or
    repeat across a reroute, and a version per token that never goes backwards within a call."""
    expected = {f"b{s}/e{i}": n for s in range(workload.steps) for i, n in enumerate(workload.calls(s))}
    got = {log.execution_id: log for log in result.executions}
    assert set(got) == set(expected)
    for ex_id, n in expected.items():
        log = got[ex_id]
        assert len(log.calls) == n, ex_id
        for prompt_len, ids, versions in log.calls:
            assert ids == [emulated_token(prompt_len + j) for j in range(TOKENS_PER_CALL)], ex_id
            assert len(versions) == len(ids)
            assert versions == sorted(versions)
            assert 0 <= versions[0] and versions[-1] <= workload.steps


class Flapping:
    """A role policy that moves one to all-but-one cells into training and back every `period` s,
    whatever the load: switches under load, on purpose."""

    name = "flapping"

    def __init__(self, period: float) -> None:
        self.period, self.t0 = period, time.monotonic()

    def train_cells(self, c: Counters) -> int:
        phase = int((time.monotonic() - self.t0) / self.period)
        return (phase % c.k) if c.unfinished else c.k


def test_executions_survive_repeated_switches_with_exact_records():
    cfg = ElasticConfig(policy="elastic", cells=3, mode="emulated", capacity=4, micro_step_executions=3)
    res = Coordinator(cfg, FAST, policy=Flapping(0.05)).run()
    _check_tito(res, FAST)
    assert res.reroutes > 0            # calls really were cut off mid-generation and moved
    assert res.switches >= 6
    spanning = [vs for log in res.executions for _, _, vs in log.calls if len(set(vs)) > 1]
    assert res.steps == 3 and res.stale_dropped == 0
    # a rerouted call continues on another cell: some calls may carry two versions, never out of order
    assert all(vs == sorted(vs) for vs in spanning)


class _Silent:
    """A launcher whose agents start but never dial in (a process that only sleeps)."""

    name = "silent"

    def __init__(self):
        self.launched, self.closed = [], False

    def launch(self, cell, args, env):
        import subprocess
        import sys

        self.launched.append((cell, args, env))
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def describe(self, cell, handle):
        return f"cell {cell} gone"

    def waiting(self, pending):
        return f"; still waiting for {sorted(pending)}"

    def close(self):
        self.closed = True


def test_a_launcher_starts_the_agents_and_says_why_they_did_not_connect():
    cfg = ElasticConfig(policy="colocated", cells=2, mode="emulated", start_timeout_s=1.0)
    launcher = _Silent()
    with pytest.raises(RuntimeError, match=r"only 0 of 2 cells connected within 1 s.*still waiting for \[0, 1\]"):
        Coordinator(cfg, FAST, launcher=launcher).run()
    # each agent got the plain command's arguments and the key in its environment
    assert [c for c, _, _ in launcher.launched] == [0, 1]
    for cell, args, env in launcher.launched:
        assert args[:2] == ["--cell", str(cell)] and args[2] == "--coordinator" and "--mode" in args
        assert len(env["GYRE_CELL_KEY"]) == 32
    assert launcher.closed
    # a retry in the same process (a Prefect task retry) starts cleanly: the failed start's acceptor thread
    # is gone, so it cannot take the new listener's connections with the old key
    res = Coordinator(ElasticConfig(policy="colocated", cells=2, mode="emulated"), FAST).run()
    _check_tito(res, FAST)


def test_waterlevel_decisions_follow_the_rule():
    cfg = ElasticConfig(policy="elastic", cells=4, mode="emulated", capacity=3, micro_step_executions=2)
    res = run_elastic(cfg, FAST)
    _check_tito(res, FAST)
    assert res.decisions, "the waterlevel never moved a cell"
    for d in res.decisions:
        w = d.dispatched - d.finished
        # the largest t whose remaining rollout capacity still holds every unfinished execution
        # (none leaves while even the whole fleet cannot hold them: queued executions wait for slots)
        best = max([t for t in range(cfg.cells + 1) if (cfg.cells - t) * cfg.capacity >= w] or [0])
        assert d.train_after == best
        assert d.rollout_capacity == (cfg.cells - d.train_after) * cfg.capacity


def test_cost_aware_keeps_cells_training_past_the_waterlevel_once_it_has_measured_enough():
    """Emulated cells, training most of the work: until 8 executions ended and a micro-step was timed it is
    the waterlevel; afterwards, when a new burst would send every cell back to rollout, it keeps some
    training (the previous burst's training is the critical path, and the plan made from the run's own
    measurements reserves cells for it), and the run's records stay exact."""
    from gyre_core.elastic.controller import CostAware

    heavy = dataclasses.replace(FAST, steps=4, train_s_per_call=0.03)
    cfg = ElasticConfig(policy="cost-aware", cells=4, mode="emulated", capacity=3, micro_step_executions=2)
    policy = CostAware()
    res = Coordinator(cfg, heavy, policy=policy).run()
    _check_tito(res, heavy)
    assert res.steps == 4 and res.decisions
    # a plan per version once an update was timed (made on a thread: the last may land after the run)
    assert res.plans and all(0 <= r < cfg.cells for _, r, _ in res.plans)
    assert [v for v, _, _ in res.plans] == sorted({v for v, _, _ in res.plans})
    past = []
    for d in res.decisions:
        w = d.dispatched - d.finished
        level = max([t for t in range(cfg.cells + 1) if (cfg.cells - t) * cfg.capacity >= w] or [0])
        if d.train_after > level:
            past.append(d)
    assert past, "it never kept a cell training past the waterlevel"
    assert all(d.finished >= Coordinator.MEASURED_BEFORE_ESTIMATES for d in past)    # only on measurements
    # every execution trained once, in groups of at most micro_step_executions (a training cell that asks
    # while no group is full takes a short one: the estimates count executions, not micro-steps)
    assert sum(res.micro_executions) == heavy.steps * heavy.executions_per_step - res.stale_dropped
    assert 1 <= min(res.micro_executions) and max(res.micro_executions) <= cfg.micro_step_executions
    assert res.to_dict()["micro_executions"] == sum(res.micro_executions)


def test_async_takes_its_training_cell_out_before_any_execution_binds():
    # the roles are decided before a dispatched burst's executions start: none lands on the cell that
    # leaves for training, so async's one switch moves no execution (before, the first calls bound to the
    # core and were cancelled and rerouted, and a long execution among them waited for a free slot)
    cfg = ElasticConfig(policy="async", cells=3, async_train_cells=1, mode="emulated", capacity=6)
    res = run_elastic(cfg, FAST)
    _check_tito(res, FAST)
    assert (res.switches, res.reroutes) == (1, 0)
    # max_staleness 1: bursts 0 and 1 are dispatched together, before anything finished
    assert [w for _, w in res.load[:2]] == [FAST.executions_per_step, 2 * FAST.executions_per_step]


@pytest.mark.fault("a rollout cell dies (SIGKILL)", "its calls continue on the other cells token for token; the run goes on with K − 1")
def test_a_lost_cell_is_detected_and_the_run_continues():
    slow = Workload(**{**FAST.to_dict(), "steps": 2, "call_s": 0.05})
    cfg = ElasticConfig(policy="async", cells=3, async_train_cells=1, mode="emulated", capacity=6)
    res = Coordinator(cfg, slow, kill_cell_at=(2, 0.3)).run()
    assert res.dead_cells == [2]
    assert any("cell 2 lost" in n and "continuing with 2 cell(s)" in n for n in res.notes)
    _check_tito(res, slow)


def test_configs_that_cannot_work_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="elastic.async_train_cells"):
        load_config("smoke", ["elastic.policy=async", "elastic.cells=1"])


def test_more_real_cells_than_devices_is_refused():
    from gyre_core.elastic.runtime import check_fleet

    with pytest.raises(ConfigError, match="3 real cells × 2 device"):
        check_fleet(ElasticConfig(policy="elastic", cells=3, devices_per_cell=2, devices=4, mode="real"))
    check_fleet(ElasticConfig(policy="elastic", cells=2, devices_per_cell=2, devices=4, mode="real"))   # fits
    check_fleet(ElasticConfig(policy="elastic", cells=8, devices=2, mode="emulated"))   # emulated: no devices


@pytest.mark.fault("the core (training cell 0) dies", "a satellite becomes the core and the step's update is redone")
def test_losing_the_core_promotes_a_satellite_and_redoes_the_step():
    slow = Workload(**{**FAST.to_dict(), "steps": 2, "call_s": 0.05, "train_s_per_call": 0.01})
    cfg = ElasticConfig(policy="async", cells=3, async_train_cells=1, mode="emulated", capacity=6)
    res = Coordinator(cfg, slow, kill_cell_at=(0, 0.8)).run()
    assert res.dead_cells == [0]
    assert any("cell 1 is the new core" in n for n in res.notes)
    _check_tito(res, slow)
    # after the loss cell 1 trained (it holds the optimizer now) and cell 0 never came back
    assert any(s.cell == 1 and s.role == "train" for s in res.busy_spans)
    assert not any(s.cell == 0 and s.t0 > 0.8 + 0.2 for s in res.busy_spans)


def test_an_aborted_router_releases_every_waiting_execution():
    """A call waiting for a slot, one in flight on a cell, and one made afterwards all raise RouterAborted."""
    import threading

    from gyre_core.elastic.router import Router, RouterAborted

    sent = []
    router = Router(1, lambda cell, msg: sent.append((cell, msg)))
    router.open(0)
    errors: dict[str, str] = {}

    def execution(name):
        try:
            router.call(name, CallRequest(f"{name}/c0", [1, 2], 4))
        except RouterAborted as e:
            errors[name] = str(e)
    threads = [threading.Thread(target=execution, args=(n,)) for n in ("a", "b")]
    for th in threads:
        th.start()
    while len(sent) < 1:              # "a" is in flight on cell 0; "b" waits (capacity 1)
        time.sleep(0.01)
    assert [type(m) for _, m in sent] == [Gen] and router.inflight(0) == 1
    router.abort("the run failed")
    for th in threads:
        th.join(5)
    assert errors == {"a": "the run failed", "b": "the run failed"}
    with pytest.raises(RouterAborted, match="the run failed"):
        router.call("c", CallRequest("c/c0", [1], 4))
    assert len(sent) == 1             # nothing more was sent to the cell


@pytest.mark.fault("a cell hangs in one piece of work", "declared lost after elastic.stuck_timeout_s and killed; the run goes on")
def test_a_cell_busy_too_long_is_lost_although_it_still_beats():
    """Micro-steps of ~3 s against elastic.stuck_timeout_s = 1: the agents' heartbeats keep coming (their
    own thread), but each beat says how long the main loop has been busy, and the coordinator gives up."""
    slow = Workload(name="slow", executions_per_step=4, steps=1, calls_median=2, calls_sigma=0.0, max_calls=2,
                    call_s=0.01, env_s=0.0, train_s_per_call=1.5, optimizer_s=0.01, publish_s=0.0,
                    switch_to_train_s=0.0, switch_to_rollout_s=0.0, seed=1)
    cfg = ElasticConfig(policy="colocated", cells=2, mode="emulated", capacity=4, micro_step_executions=2,
                        stuck_timeout_s=1.0, cell_timeout_s=30.0)
    with pytest.raises(RuntimeError, match=r"every cell is lost .*busy in one piece of work for \d+ s"):
        Coordinator(cfg, slow).run()


def test_a_finished_context_is_released_on_the_cell_that_served_it_last():
    """A call starts on cell 0, is rerouted to cell 1 when 0 leaves rollout (0 released its copy when it
    cancelled), and completes there; forgetting the key tells cell 1 only. A key whose cell has left
    rollout (its caches went with the switch) or that was never served sends nothing."""
    import threading

    from gyre_core.elastic.router import Router

    sent = []
    router = Router(2, lambda cell, msg: sent.append((cell, msg)))
    router.open(0)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", router.call("x", CallRequest("x/c0", [1, 2], 4))))
    th.start()
    while not sent:
        time.sleep(0.01)
    (cell, gen), = sent
    assert cell == 0 and gen == Gen(gen.call_id, CallRequest("x/c0", [1, 2], 4))
    router.open(1)
    router.close(0)
    router.on_done(0, gen.call_id, [5], [-0.1], [0], "cancelled")   # 1 of 4 tokens, then rerouted
    cell, again = sent[-1]                     # the rest, with the token so far in the prompt
    assert cell == 1 and again == Gen(again.call_id, CallRequest("x/c0", [1, 2, 5], 3))
    router.on_done(1, again.call_id, [6, 7, 8], [-0.2] * 3, [1] * 3, "length")
    th.join(5)
    assert out["c"].ids == [5, 6, 7, 8] and out["c"].versions == [0, 1, 1, 1]
    n = len(sent)
    router.forget("x/c0")
    assert sent[n:] == [(1, Release("x/c0"))]
    router.forget("x/c0")                      # once only
    router.forget("never-served/c0")
    assert len(sent) == n + 1
    th = threading.Thread(target=lambda: router.call("y", CallRequest("y/c0", [3], 1)))
    th.start()
    while len(sent) < n + 2:
        time.sleep(0.01)
    router.on_done(1, sent[-1][1].call_id, [9], [-0.3], [1], "length")
    th.join(5)
    router.close(1)                            # cell 1 leaves rollout: its caches go with the switch
    router.forget("y/c0")
    assert len(sent) == n + 2


def test_gpu_slices_give_each_cell_its_own_gpus_and_share_round_robin_when_told_there_are_more(monkeypatch):
    import torch

    from gyre_core.elastic.connections import _gpu_slices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _gpu_slices(ElasticConfig(cells=2, devices_per_cell=2)) == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert _gpu_slices(ElasticConfig(cells=2)) == ["3", "5"]
    # elastic.devices above the GPU count: the cells share them (one GPU, two cells: both on it)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert _gpu_slices(ElasticConfig(cells=2, devices=2)) == ["7", "7"]
    assert _gpu_slices(ElasticConfig(cells=3, devices_per_cell=2, devices=6)) == ["7", "7", "7"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_slices(ElasticConfig(cells=2)) is None


def test_published_versions_land_in_order_off_the_main_loop_and_all_before_the_run_returns():
    """`on_version` (a step's lake part and metrics) runs on its own thread: while version 1 is still
    landing, the coordinator goes on and publishes version 2; every version has landed when run() returns."""
    landed, seen_while_landing_v1 = [], []
    holder = {}

    def on_version(v, stats):
        if v == 1:    # hold the first landing until the loop has published the next version (or give up)
            deadline = time.monotonic() + 60
            while holder["coord"].version < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen_while_landing_v1.append(holder["coord"].version)
        landed.append(v)

    coord = Coordinator(ElasticConfig(cells=2, mode="emulated", policy="elastic", capacity=4), FAST,
                        on_version=on_version)
    holder["coord"] = coord
    result = coord.run()
    assert landed == [1, 2, 3] and result.steps == 3
    assert seen_while_landing_v1[0] >= 2      # the loop published v2 while v1 was landing


def test_a_landing_that_fails_stops_the_run_with_its_message():
    def on_version(v, stats):
        if v == 2:
            raise OSError("the lake is full")

    with pytest.raises(RuntimeError, match="landing version 2 failed: OSError: the lake is full"):
        run_elastic(ElasticConfig(cells=2, mode="emulated", policy="elastic", capacity=4), FAST, on_version=on_version)


def test_every_message_crosses_a_connection_unchanged():
    """The records are pickled by multiprocessing.connection, as between the coordinator and an agent."""
    from multiprocessing import Pipe

    import numpy as np

    from gyre_core.elastic import messages as m

    req = CallRequest("e7/c0", [1, 2, 3], 5, 0.7, 0.01)
    sent = [m.Gen(4, req), m.Cancel(4), m.Role("train", 0.25), m.Micro(9, 0.5), m.Reduce(2, 3),
            m.Optim(2, 0.1, 3), m.Optim(2, 0.1), m.UseArrays(), m.Weights(3), m.Release("e7/c0"), m.BecomeCore(),
            m.Stop(), m.Hello(1, 4242, "emulated"), m.Beat(1.5e9, 0.25),
            m.Done(4, [7, 8], [-0.5, -0.25], [2, 3], "length"), m.RoleDone("rollout", 0.125), m.MicroDone(9, 0.5, None, {"tokens": 12.0}), m.OptimDone(3, 0.2, None),
            m.OptimFailed(2, "cell 1 lost")]
    a, b = Pipe()
    for msg in sent:
        a.send(msg)
        got = b.recv()
        assert type(got) is type(msg) and got == msg
    assert sent[6].t == 1                      # an update without a reduce: the core alone
    grads = m.Grads({"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    a.send(grads)
    got = b.recv()
    assert list(got.grads) == ["w"] and got.grads["w"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_an_agent_answers_each_message_with_its_record():
    """The agent's dispatch on the message classes, in-process over a pipe, with the emulated device."""
    from multiprocessing import Pipe

    from gyre_core.elastic import messages as m
    from gyre_core.elastic.agent import Agent
    from gyre_core.elastic.devices import EmulatedDevice

    here, there = Pipe()
    agent = Agent(2, there, EmulatedDevice())
    assert agent._handle(m.Gen(1, CallRequest("k", [0, 1], 3, token_s=0.0)))
    assert agent._handle(m.Role("train", 0.0))      # drains the call it holds: it goes back cancelled
    assert here.recv() == m.Done(1, [], [], [], "cancelled")
    role_done = here.recv()
    assert isinstance(role_done, m.RoleDone) and role_done.role == "train"
    assert agent._handle(m.Gen(2, CallRequest("k", [0, 1], 3)))   # raced with the switch: handed back
    assert here.recv() == m.Done(2, [], [], [], "cancelled")
    assert agent._handle(m.Micro(5, 0.0))
    done = here.recv()
    assert (type(done), done.ms_id, done.grads, done.stats) == (m.MicroDone, 5, None, {})
    assert agent._handle(m.Optim(0, 0.0))
    done = here.recv()
    assert (type(done), done.version, done.reduce_s) == (m.OptimDone, 1, None)   # it published v1
    assert agent._handle(m.Role("rollout", 0.0)) and isinstance(here.recv(), m.RoleDone)
    assert agent._handle(m.Gen(3, CallRequest("k", [0, 1], 3, token_s=0.0)))
    finished = agent.device.advance(list(agent.gens.values()), time.monotonic())
    assert [g.ids for g in finished] == [[emulated_token(2), emulated_token(3), emulated_token(4)]]
    assert [g.versions for g in finished] == [[1, 1, 1]]   # made with the weights it published
    assert not agent._handle(m.Stop())
    with pytest.raises(ValueError, match="unknown message"):
        agent._handle(("gen", 4, None))         # the old tuples are not messages any more


def test_the_emulated_device_slows_a_fuller_batch_and_pauses_to_load_weights(monkeypatch):
    """Token times by hand: β = 0.5 and 0.1 s a token; the clock is set by the test."""
    from gyre_core.elastic import devices
    from gyre_core.elastic.devices import EmulatedDevice, LiveCall

    d = EmulatedDevice(decode_slowdown=0.5, weight_sync_s=1.0)
    a, b = (LiveCall(i, CallRequest(f"k{i}", [0], 6, token_s=0.1)) for i in (1, 2))
    d.start(a, 0.0)
    d.start(b, 0.0)
    assert (a.next_t, b.next_t) == (0.1, 0.1)            # the first token's time before the cell knew its load
    d.advance([a, b], 0.1)                                # two live: each next token takes 0.1 · 1.5
    assert len(a.ids) == len(b.ids) == 1 and a.next_t == pytest.approx(0.25)
    d.advance([a], 0.25)                                  # b went elsewhere: a alone, 0.1 s a token
    assert len(a.ids) == 2 and a.next_t == pytest.approx(0.35)
    monkeypatch.setattr(devices.time, "monotonic", lambda: 0.3)
    d.set_version(1)                                      # published at 0.3 while rolling out: load 0.3–1.3
    assert d.advance([a], 0.5) == [] and a.next_t == pytest.approx(1.35)   # the token in progress waits 1 s
    c = LiveCall(3, CallRequest("k3", [0], 1, token_s=0.1))
    d.start(c, 0.6)                                       # a call started during the load begins after it
    assert c.next_t == pytest.approx(1.3 + 0.1 * 1.5)
    d.switch("train", 0.0)
    d.set_version(2)                                      # a training cell does not pause
    assert d.pause == (0.0, 0.0) and d.version == 2       # (and the switch ended the load: it loads itself)
    d.switch("rollout", 0.0)
    e = LiveCall(4, CallRequest("k4", [0], 6, token_s=0.1))
    d.start(e, 2.0)                                       # alone: a token at 2.1, 2.2, ...
    assert e.next_t == pytest.approx(2.1)
    monkeypatch.setattr(devices.time, "monotonic", lambda: 2.25)
    d.set_version(3)                                      # load 2.25–3.25; not advanced since 2.0
    d.advance([e], 2.5)
    # the tokens due at 2.1 and 2.2 came before the load, on v2; the one due at 2.3 waits it out: 3.3
    assert e.versions == [2, 2] and e.next_t == pytest.approx(3.3)


class _StrayDialers:
    """The default launcher, with strangers dialling the coordinator's port before each agent starts: one
    that connects and says nothing, one that hangs up at once, one that sends garbage, one with a wrong key."""

    name = "process"

    def __init__(self):
        from gyre_core.elastic.connections import ProcessLauncher

        self.inner, self.socks, self.bad_key_refused = ProcessLauncher(), [], 0

    def launch(self, cell, args, env):
        import socket
        import threading
        from multiprocessing import AuthenticationError
        from multiprocessing.connection import Client

        host, port = args[args.index("--coordinator") + 1].rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))
        self.socks.append(silent)                                   # held open for the whole start
        socket.create_connection((host, int(port))).close()         # hangs up at once
        noisy = socket.create_connection((host, int(port)))
        noisy.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
        self.socks.append(noisy)

        def wrong_key():
            try:
                Client((host, int(port)), authkey=b"not the key").close()
            except AuthenticationError:
                self.bad_key_refused += 1
        threading.Thread(target=wrong_key, daemon=True).start()
        return self.inner.launch(cell, args, env)

    def describe(self, cell, handle):
        return self.inner.describe(cell, handle)

    def waiting(self, pending):
        return ""

    def close(self):
        for s in self.socks:
            s.close()


@pytest.mark.fault("stray connections to the coordinator's port", "dropped; the start neither hangs nor gives a cell's slot away")
def test_stray_connections_to_the_coordinator_neither_hang_the_start_nor_take_a_cell_slot():
    launcher = _StrayDialers()
    cfg = ElasticConfig(policy="colocated", cells=2, mode="emulated")
    res = Coordinator(cfg, FAST, launcher=launcher).run()
    _check_tito(res, FAST)
    assert launcher.bad_key_refused == 2       # each wrong-key dialer was told no, not left waiting


@pytest.mark.fault("stray connections to the coordinator's port", "a failed start still gives up at elastic.start_timeout_s")
def test_a_silent_stray_does_not_keep_a_failed_start_from_giving_up():
    """Agents that never dial plus a stranger holding a connection open: the start still fails at its
    deadline with the reason (it used to hang here for ever, past elastic.start_timeout_s)."""
    import socket
    import threading

    class SilentWithStray(_Silent):
        def launch(self, cell, args, env):
            host, port = args[args.index("--coordinator") + 1].rsplit(":", 1)
            self.stray = socket.create_connection((host, int(port)))
            return super().launch(cell, args, env)

    launcher = SilentWithStray()
    cfg = ElasticConfig(policy="colocated", cells=2, mode="emulated", start_timeout_s=1.0)
    outcome = []

    def run():
        try:
            Coordinator(cfg, FAST, launcher=launcher).run()
        except RuntimeError as e:
            outcome.append(str(e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    launcher.stray.close()
    assert not t.is_alive(), "the start hung"
    assert outcome and "only 0 of 2 cells connected within 1 s" in outcome[0]
