"""The discrete-event simulator, the timeline accounting and picture, the profiles and `gyre sim`.

Every expected time below is worked out by hand from the rules in `gyre_core/elastic/sim.py`'s docstring;
the comments walk through the events.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass

import pytest

from gyre_cli.main import main
from gyre_core.elastic.profiles import get_profile, with_overrides, workload_from_trace
from gyre_core.elastic.comparison import compare, compare_results
from gyre_core.elastic.sim import _Exec, _Sim, simulate, slowdown, step_s_floor
from gyre_core.elastic.timeline import BusySpan, RoleSpan, busy_fractions, plot_timeline
from gyre_core.elastic.workload import Workload


@dataclass(frozen=True, slots=True)
class Scripted(Workload):
    """A workload whose bursts' call counts are given, not sampled."""

    script: tuple = ()

    def calls(self, step: int) -> list[int]:
        return list(self.script[step])


def scripted(bursts, **kw) -> Scripted:
    return Scripted(steps=len(bursts), executions_per_step=len(bursts[0]), script=tuple(map(tuple, bursts)), **kw)


def flat(rows) -> list[float]:
    """Tuples flattened, for pytest.approx (which does not compare nested sequences)."""
    return [float(x) for row in rows for x in row]


def check_invariants(r) -> None:
    """Role spans tile [0, wall] on every cell; busy spans lie inside spans of their own role."""
    for c in range(r.k):
        spans = [s for s in r.role_spans if s.cell == c]
        assert spans[0].t0 == 0 and spans[-1].t1 == pytest.approx(r.wall_s)
        assert all(a.t1 == pytest.approx(b.t0) for a, b in zip(spans, spans[1:]))
        for b in (b for b in r.busy_spans if b.cell == c):
            assert any(s.role == b.role and s.t0 - 1e-9 <= b.t0 and b.t1 <= s.t1 + 1e-9 for s in spans), b
    assert r.step_ends[-1] == pytest.approx(r.wall_s)


def test_colocated_two_steps_by_hand():
    # call 1 s + env 0.5 s; train 0.25 s a call; optimizer + publish 0.5 s; switches 0.1 s / 0.05 s
    w = scripted([[2, 4], [1, 1]], call_s=1.0, env_s=0.5, train_s_per_call=0.25, optimizer_s=0.3, publish_s=0.2,
                 switch_to_train_s=0.1, switch_to_rollout_s=0.05)
    r = simulate(w, k=2, capacity=10, policy="colocated", max_staleness=3, micro_step_executions=1)
    # step 0: e0 → cell 0, e1 → cell 1 (least loaded); e0 ends at 2×1.5 = 3, e1 at 4×1.5 = 6. At 6 both cells
    # switch to train (→ 6.1); micro-steps 0.5 s (core, 6.1–6.6) and 1.0 s (cell 1, 6.1–7.1); update 7.1–7.6.
    # step 1 (staleness forced to 0: dispatched at 7.6): both switch back (→ 7.65), both executions on cell 0
    # end at 9.15; switch to train (→ 9.25), 0.25 s micro-steps (→ 9.5), update → 10.0.
    assert r.max_staleness == 0
    assert r.step_ends == pytest.approx([7.6, 10.0])
    assert r.wall_s == pytest.approx(10.0) and r.step_s == pytest.approx(5.0)
    assert (r.switches_to_train, r.switches_to_rollout) == (4, 2)
    assert r.switch_s_mean == pytest.approx((4 * 0.1 + 2 * 0.05) / 6)
    rollout_busy = 2 + 4 + 1          # calls in flight: cell 0 2 s + 1 s (merged), cell 1 4 s
    train_busy = 0.5 + 1.0 + 0.5 + 0.25 + 0.25 + 0.5
    assert r.busy["busy_s_rollout"] == pytest.approx(rollout_busy)
    assert r.busy["busy_s_train"] == pytest.approx(train_busy)
    assert r.busy_frac == pytest.approx((rollout_busy + train_busy) / (2 * 10.0))
    assert r.busy["share_switching"] == pytest.approx((4 * 0.1 + 2 * 0.05) / 20)
    assert flat((d.t, d.train_before, d.train_after) for d in r.decisions) == pytest.approx(
        flat([(6.0, 0, 2), (7.6, 2, 0), (9.15, 0, 2)]))
    check_invariants(r)


def test_async_fixed_split_by_hand():
    w = scripted([[1, 1], [1, 1]], call_s=1.0, env_s=0.0, train_s_per_call=0.1, optimizer_s=0.15, publish_s=0.0,
                 switch_to_train_s=0.3, switch_to_rollout_s=0.2)
    r = simulate(w, k=2, capacity=2, policy="async", async_train_cells=1, max_staleness=1, micro_step_executions=2)
    # t=0: bursts 0 and 1 dispatched (S=1); the core goes to train (→ 0.3); cell 1 hosts burst 0, burst 1 waits.
    # t=1: burst 0 ends, burst 1 takes its slots (→ 2); the core trains burst 0 (1.0–1.2), updates (→ 1.35);
    # t=2: burst 1 ends; micro-step 2.0–2.2, update → 2.35.
    assert r.step_ends == pytest.approx([1.35, 2.35])
    assert r.step_s == pytest.approx(2.35 / 2)
    assert r.switches == 1 and r.async_train_cells == 1
    assert r.busy["busy_s_rollout"] == pytest.approx(2.0)
    assert r.busy["busy_s_train"] == pytest.approx(0.7)
    assert r.busy_frac == pytest.approx(2.7 / 4.7)
    assert r.busy["share_rollout"] == pytest.approx(0.5)
    check_invariants(r)


def test_elastic_core_leaves_and_a_moved_call_resumes_with_its_remaining_time():
    w = scripted([[1, 1], [1, 8], [1, 1]], call_s=1.0, env_s=0.0, train_s_per_call=0.1, optimizer_s=0.15,
                 publish_s=0.0, switch_to_train_s=0.3, switch_to_rollout_s=0.2)
    r = simulate(w, k=2, capacity=2, policy="elastic", max_staleness=1, micro_step_executions=2)
    # t=0: bursts 0, 1 dispatched, w=4 fills both cells: cell 0 {b0e0, b1e0}, cell 1 {b0e1, b1e1}.
    # t=1: w=2 → the core leaves (its b1e0 is in its last turn and just finishes), trains burst 0 at 1.3–1.5,
    #      updates → 1.65 = v1, which dispatches burst 2: w=3 → t=0, the core comes back (→ 1.85).
    #      b2e0 takes cell 1's free slot at 1.65, b2e1 waits for the core and starts there at 1.85.
    # t=2.65: b2e0 ends, w=2 → the core leaves again, 0.8 s into b2e1's call: b2e1 moves to cell 1 with the
    #      0.2 s left and ends at 2.85 (not 3.65).
    #      Back in train at 2.95 and idle, the core takes b1e0 (finished at t=1) alone rather than wait for
    #      a group of two: 2.95–3.05.
    # t=8: b1e1 ends, w=0 → cell 1 trains too; the core trains it (8.0–8.8), updates (→ 8.95), then
    #      burst 2, whose micro-step waited for v=2 (8.95–9.15), updates → 9.30.
    assert r.step_ends == pytest.approx([1.65, 8.95, 9.30])
    assert flat((d.t, d.train_after) for d in r.decisions) == pytest.approx(
        flat([(1.0, 1), (1.65, 0), (2.65, 1), (8.0, 2)]))
    assert r.moved_executions == 2 and r.resumed_calls == 1
    assert (r.switches_to_train, r.switches_to_rollout) == (3, 1)
    core_busy = [(b.t0, b.t1) for b in r.busy_spans if b.cell == 0 and b.role == "rollout"]
    assert flat(core_busy) == pytest.approx([0.0, 1.0, 1.85, 2.65])
    cell1 = sorted((b.t0, b.t1) for b in r.busy_spans if b.cell == 1 and b.role == "rollout")
    assert flat(cell1) == pytest.approx([0.0, 8.0])
    assert r.busy["busy_s_train"] == pytest.approx(0.2 + 0.15 + 0.1 + 0.8 + 0.15 + 0.2 + 0.15)
    assert (2.95, 3.05) in [pytest.approx((b.t0, b.t1)) for b in r.busy_spans if b.cell == 0 and b.role == "train"]
    assert r.busy_frac == pytest.approx((9.8 + 1.75) / (2 * 9.3))
    # w after each dispatch and finish: b2e1 finishes at 2.85
    assert flat(r.load) == pytest.approx(flat([(0, 2), (0, 4), (1, 3), (1, 2), (1, 1), (1.65, 3), (2.65, 2),
                                               (2.85, 1), (8, 0)]))
    check_invariants(r)


def test_a_moved_execution_between_calls_keeps_its_pace():
    w = scripted([[2, 2, 6]], call_s=1.0, env_s=0.5, train_s_per_call=0.0, optimizer_s=0.0, publish_s=0.0,
                 switch_to_train_s=0.1, switch_to_rollout_s=0.1)
    r = simulate(w, k=2, capacity=2, policy="elastic", max_staleness=0, micro_step_executions=1)
    # t=0: w=3 → t=0; e0 → cell 0, e1 → cell 1, e2 → cell 0. e0 and e1 end at 3.0 → w=1 → the core leaves at
    # 3.0, when e2 is exactly between turns (2 calls done, its 3rd starts now): it moves to cell 1 and keeps
    # its pace, ending at 6 × 1.5 = 9.0 as if nothing happened.
    assert r.decisions[0].t == pytest.approx(3.0) and r.decisions[0].train_after == 1
    assert r.moved_executions == 1 and r.resumed_calls == 0
    assert max(t for t, _ in r.load) == pytest.approx(9.0)


def test_progress_of_a_bound_execution():
    """Where an execution stands when its cell leaves: mid-turn it keeps the turn's end; mid-call it keeps
    only the call's remaining device time."""
    w = Workload(call_s=1.0, env_s=0.5, steps=1, executions_per_step=1)
    sim = _Sim(w, 2, 1, "elastic", 1, 0, 1)
    ex = _Exec(burst=0, n=3, call_rem=1.0, ready_at=0.0, cell=0, bound_at=0.0)
    assert sim._advance(ex, 1.2) is False                    # call 1 done at 1.0, in its turn until 1.5
    assert (ex.done, ex.ready_at, ex.call_rem) == (1, 1.5, 1.0)
    ex.cell, ex.bound_at = 1, 1.3                            # moved; the turn's clock ran on meanwhile
    assert sim._advance(ex, 2.1) is True                     # call 2 started at 1.5, 0.6 s in
    assert ex.done == 1 and ex.call_rem == pytest.approx(0.4) and ex.ready_at == 2.1
    assert sim.segments[-1] == pytest.approx((1, 1.5, 0.6, 0.0, 0, 2.1, 1.0, 1.5))   # on cell 1: 1.5–2.1


def _device_work(segments, call_s: float) -> float:
    """Total call work in the recorded segments at slowdown 1, interval by interval (not merged): a
    segment's call time divided by its slowdown (its call length / call_s)."""
    total = 0.0
    for _, s0, first, a1, n_more, t_end, call, period in segments:
        f = call / call_s
        total += max(0.0, min(s0 + first, t_end) - s0) / f
        total += sum(max(0.0, min(a1 + i * period + call, t_end) - (a1 + i * period)) for i in range(n_more)) / f
    return total


@pytest.mark.parametrize("policy", ["colocated", "async", "elastic", "cost-aware", "adaptive"])
def test_moves_neither_lose_nor_repeat_device_time(policy):
    """Across random small fleets and bursts, every call gets exactly call_s of device work in all (at its
    cells' slowdowns, through weight-loading pauses), however often its execution moved or its cell's load
    changed, and every execution finishes once."""
    import random

    rng = random.Random(7)
    for trial in range(25):
        k, cap = rng.randint(2, 4), rng.randint(1, 3)
        bursts = [[rng.randint(1, 6) for _ in range(rng.randint(2, 7))] for _ in range(3)]
        bursts = [b[:len(bursts[0])] + [1] * (len(bursts[0]) - len(b)) for b in bursts]
        w = scripted(bursts, call_s=rng.choice([0.3, 1.0]), env_s=rng.choice([0.0, 0.25, 0.7]),
                     train_s_per_call=0.13, optimizer_s=0.21, publish_s=0.05, switch_to_train_s=0.17,
                     switch_to_rollout_s=0.11, decode_slowdown=rng.choice([0.0, 0.0, 0.3]),
                     weight_sync_s=rng.choice([0.0, 0.4]))
        sim = _Sim(w, k, cap, policy, rng.randint(1, k - 1), rng.randint(0, 2), rng.randint(1, 3))
        r = sim.run()
        calls = sum(map(sum, bursts))
        assert _device_work(sim.segments, w.call_s) == pytest.approx(calls * w.call_s), trial
        assert sim.finished == sim.dispatched == sum(map(len, bursts))
        assert all(ex.done == ex.n for ex in sim.execs)
        check_invariants(r)


def test_a_fuller_cell_decodes_slower_by_hand():
    # one cell of 2 slots, no environment latency, β = 0.5: two calls in flight take 1 + 0.5 = 1.5× as long
    w = scripted([[1, 2]], call_s=1.0, env_s=0.0, train_s_per_call=0.0, optimizer_s=0.0, publish_s=0.0,
                 switch_to_train_s=0.0, switch_to_rollout_s=0.0, decode_slowdown=0.5)
    r = simulate(w, k=2, capacity=2, policy="async", async_train_cells=1, max_staleness=0)
    # both calls 0–1.5; e0 finishes at 1.5; e1's second call runs alone at full speed: 1.5–2.5
    assert [t for t, _ in r.load[1:]] == pytest.approx([1.5, 2.5])
    # with environment turns the others are in flight for their share of a turn: call_s = env_s = 1, β = 1
    # and 2 executions give f = 1 + f / (f + 1), f² − f − 1 = 0: the golden ratio
    sim = _Sim(dataclasses.replace(w, env_s=1.0, decode_slowdown=1.0), 2, 2, "elastic", 1, 1, 1)
    assert slowdown(sim.w, 2) == pytest.approx((1 + 5 ** 0.5) / 2) and slowdown(sim.w, 1) == 1.0


def test_a_publish_pauses_the_rollout_cells_to_load_weights_by_hand():
    # async, cell 0 trains, cell 1 rolls out both bursts (S = 1); call 1 s, no environment latency, training
    # 0.5 s a call, optimizer 0.5 s, loading a version 2 s
    w = scripted([[1], [3]], call_s=1.0, env_s=0.0, train_s_per_call=0.5, optimizer_s=0.5, publish_s=0.0,
                 switch_to_train_s=0.0, switch_to_rollout_s=0.0, weight_sync_s=2.0)
    r = simulate(w, k=2, capacity=2, policy="async", async_train_cells=1, max_staleness=1, micro_step_executions=1)
    # e0 (burst 0) 0–1; trained 1–1.5, update 1.5–2 → v1 at 2. e1 (burst 1) made calls 0–1 and 1–2; cell 1
    # loads v1 2–4, so e1's third call runs 4–5; trained 5–6.5, update 6.5–7 → v2 at 7 (3 s later than
    # without the load)
    assert r.step_ends == pytest.approx([2.0, 7.0])
    assert simulate(dataclasses.replace(w, weight_sync_s=0.0), k=2, capacity=2, policy="async",
                    async_train_cells=1, max_staleness=1, micro_step_executions=1).step_ends == pytest.approx([2.0, 5.0])
    # mid-call: training 0.25 s a call, optimizer 0.25 s → v1 at 1.5, halfway through e1's second call (1–2);
    # it stops for the load 1.5–3.5 and finishes its last 0.5 s 3.5–4; third call 4–5; trained 5–5.75,
    # update → 6
    w = dataclasses.replace(w, train_s_per_call=0.25, optimizer_s=0.25)
    r = simulate(w, k=2, capacity=2, policy="async", async_train_cells=1, max_staleness=1, micro_step_executions=1)
    assert r.step_ends == pytest.approx([1.5, 6.0])


def test_staleness_gates_dispatch():
    w = scripted([[3, 3], [3, 3]], call_s=1.0, env_s=0.0, train_s_per_call=0.1, optimizer_s=0.1, publish_s=0.0,
                 switch_to_train_s=0.0, switch_to_rollout_s=0.0)
    one = simulate(w, k=2, capacity=4, policy="elastic", max_staleness=1)
    zero = simulate(w, k=2, capacity=4, policy="elastic", max_staleness=0)
    assert one.load[:2] == [(0.0, 2), (0.0, 4)]          # burst 1 dispatched at t=0 with S=1
    assert zero.load[0] == (0.0, 2) and zero.load[1][1] == 1
    t_burst1 = next(t for t, w_ in zero.load if w_ == 2 and t > 0)
    assert t_burst1 == pytest.approx(zero.step_ends[0])  # with S=0 only after version 1 is published


def test_busy_fractions_by_hand():
    roles = [RoleSpan(0, 0, 6, "rollout"), RoleSpan(0, 6, 10, "train"), RoleSpan(1, 0, 2, "switching"),
             RoleSpan(1, 2, 12, "train")]                      # the last one runs past wall: clipped at 10
    busy = [BusySpan(0, 0, 4, "rollout"), BusySpan(0, 3, 5, "rollout"),   # overlap: 0–5 counts 5 s, not 6
            BusySpan(0, 7, 9, "train"), BusySpan(1, 2, 8, "train")]
    fr = busy_fractions(roles, busy, k=2, wall=10.0)
    assert fr["rollout"] == pytest.approx(5 / 20)
    assert fr["train"] == pytest.approx((2 + 6) / 20)
    assert fr["overall"] == pytest.approx(13 / 20)
    assert fr["share_rollout"] == pytest.approx(6 / 20) and fr["share_train"] == pytest.approx(12 / 20)
    assert fr["share_switching"] == pytest.approx(2 / 20) and fr["share_dead"] == 0
    with pytest.raises(ValueError, match="unknown role"):
        busy_fractions([RoleSpan(0, 0, 1, "napping")], [], k=1, wall=1.0)
    with pytest.raises(ValueError, match="wall > 0"):
        busy_fractions(roles, busy, k=2, wall=0.0)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_plot_timeline_writes_a_png(tmp_path):
    w = scripted([[2, 4]], call_s=1.0, env_s=0.5, train_s_per_call=0.25, optimizer_s=0.3, publish_s=0.2,
                 switch_to_train_s=0.1, switch_to_rollout_s=0.05)
    r = simulate(w, k=2, capacity=10, policy="elastic", max_staleness=0, micro_step_executions=1)
    path = plot_timeline(str(tmp_path / "sub" / "t.png"), r.role_spans, r.busy_spans, r.switch_marks, "t",
                         r.decisions, r.load)
    assert _png_size(path) == (1210, int(110 * (1.0 + 0.45 * 2 + 1.8)))   # figsize × dpi, with the w panel
    plain = plot_timeline(str(tmp_path / "plain.png"), r.role_spans, r.busy_spans, [], "no w panel")
    assert _png_size(plain)[1] < _png_size(path)[1]
    with pytest.raises(ValueError, match="no role spans"):
        plot_timeline(str(tmp_path / "x.png"), [], [], [], "empty")


def test_compare_sweeps_async_splits_and_reports_ratios():
    p = get_profile("laptop")
    c = compare_results(p.workload, p.k, p.capacity)
    assert set(c.async_sweep) == {1, 2, 3}
    assert c.results["async"].step_s == min(c.async_sweep.values())
    assert c.async_split == c.results["async"].async_train_cells
    d = compare(p.workload, p.k, p.capacity, async_split=2)
    assert d["async_split"] == 2 and list(d["async_sweep"]) == ["2"]
    with pytest.raises(ValueError, match="async needs"):
        simulate(p.workload, p.k, p.capacity, "async", async_train_cells=4)
    for r in c.results.values():
        check_invariants(r)


def test_step_s_floor_by_hand_and_no_policy_goes_below_it():
    # the by-hand fleet of test_colocated_two_steps_by_hand: bursts [2, 4] and [1, 1], call 1 s + env 0.5 s,
    # train 0.25 s a call, update 0.5 s. Work, K = 2, capacity 10: slot-seconds 9 + 3 = 12 → 1.2 rollout
    # cell-seconds; training 8 calls × 0.25 = 2; two updates 1.0 → (1.2 + 2 + 1) / 2 cells / 2 steps = 1.05.
    # Critical path: v1 = burst 0's longest execution 4 × 1.5 = 6, its micro-step 1 (the burst's 1.5 s of
    # training on 2 cells is less), the update 0.5 → 7.5. Burst 1 trains on v1 only: S = 0 dispatches it at
    # 7.5, its longest ends at 9, + 0.25 + 0.5 → 9.75 / 2 steps; S = 1 dispatches it at 0 and it is done by
    # 1.5, but its training still waits for v1: 7.5 + max(0.25, 0.5 / 2 cells) + 0.5 = 8.25 / 2.
    w = scripted([[2, 4], [1, 1]], call_s=1.0, env_s=0.5, train_s_per_call=0.25, optimizer_s=0.3, publish_s=0.2)
    assert step_s_floor(w, 2, 10, 0) == pytest.approx(9.75 / 2)
    assert step_s_floor(w, 2, 10, 1) == pytest.approx(8.25 / 2)
    assert step_s_floor(w, 2, 1, 1) == pytest.approx(8.25 / 2)            # one slot a cell: work 7.5 / 2 < path
    # one cell of one slot: the work wins, (12 + 2 + 1) / 2 steps (the path: 7.5 + max(0.25, 0.5) + 0.5 = 8.5)
    assert step_s_floor(w, 1, 1, 1) == pytest.approx((12 + 2.0 + 1.0) / 2)
    assert simulate(w, k=2, capacity=10, policy="colocated").step_s >= step_s_floor(w, 2, 10, 0)
    for name in ("laptop", "paper-122b", "paper-2.4t"):
        p = with_overrides(get_profile(name), ["steps=3"])
        c = compare_results(p.workload, p.k, p.capacity, p.max_staleness, "best", p.micro_step_executions)
        floor = step_s_floor(p.workload, p.k, p.capacity, p.max_staleness)
        assert all(r.step_s >= floor for r in c.results.values()), (name, floor)
        assert c.to_dict()["max_speedup_vs_async"] == pytest.approx(c.results["async"].step_s / floor)


def test_cli_json(tmp_path, capsys):
    rc = main(["sim", "--profile", "laptop", "--set", "steps=3", "--json", "--png", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    pol = out["policies"]
    assert set(pol) == {"colocated", "async", "elastic", "cost-aware", "adaptive"}
    assert pol["adaptive"]["async_train_cells"] == out["async_split"]       # the baseline on async's split
    assert out["speedup_vs_colocated"] == pytest.approx(pol["colocated"]["step_s"] / pol["elastic"]["step_s"])
    assert out["cost_aware_vs_async"] == pytest.approx(pol["async"]["step_s"] / pol["cost-aware"]["step_s"])
    assert out["speedup_vs_async"] == pytest.approx(pol["async"]["step_s"] / pol["elastic"]["step_s"])
    assert out["async_split"] == pol["async"]["async_train_cells"]
    assert out["workload"]["steps"] == 3 and out["profile"]["name"] == "laptop"
    for name, path in out["pngs"].items():
        assert path == str(tmp_path / f"laptop-{name}.png") and _png_size(path)[0] > 0
    assert main(["sim", "--set", "nonsense=1", "--no-png"]) == 2
    assert main(["sim", "--policy", "async", "--async-split", "4", "--no-png"]) == 2   # K=4: splits 1..3
    assert "unknown key 'nonsense'" in capsys.readouterr().err


def test_cli_trace_json(tmp_path, capsys):
    trace = tmp_path / "calls.json"
    trace.write_text(json.dumps([3, 90]))
    rc = main(["sim", "--trace-json", str(trace), "--policy", "elastic", "--json", "--no-png"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["trace"] == [3, 90] and out["workload"]["max_calls"] == 90
    assert out["speedup_vs_colocated"] is None and set(out["policies"]) == {"elastic"}


def test_profiles_reproduce_the_papers_figures():
    """The fitted profile numbers: mean execution 1.93 h and mean query (G=8) 2.96 h for 122B; 61% of
    queries at the 4 h cap for 2.4T — within sampling error."""
    g = 8
    p = get_profile("paper-122b")
    w = p.workload
    turn = w.call_s * slowdown(w, p.capacity) + w.env_s      # the paper's engines ran full cells
    assert turn == pytest.approx(40.0)
    runs = [w.calls(s) for s in range(100)]
    execs = [n for r in runs for n in r]
    queries = [max(r[i:i + g]) for r in runs for i in range(0, len(r), g)]
    assert sum(execs) / len(execs) * turn / 3600 == pytest.approx(1.93, rel=0.03)
    assert sum(queries) / len(queries) * turn / 3600 == pytest.approx(2.96, rel=0.03)
    assert w.max_calls * turn == pytest.approx(4 * 3600)
    p = get_profile("paper-2.4t")
    w = p.workload
    assert w.max_calls * (w.call_s * slowdown(w, p.capacity) + w.env_s) == pytest.approx(4 * 3600)
    runs = [w.calls(s) for s in range(100)]
    capped = [max(r[i:i + g]) >= w.max_calls for r in runs for i in range(0, len(r), g)]
    assert sum(capped) / len(capped) == pytest.approx(0.61, abs=0.03)
    assert get_profile("paper-2.4t").workload.switch_to_train_s == 8.52


def test_paper_scale_runs_quickly_and_elastic_is_fastest():
    p = get_profile("paper-2.4t")
    c = compare_results(p.workload, p.k, p.capacity, p.max_staleness, "best", p.micro_step_executions)
    el = c.results["elastic"]
    assert el.step_s < c.results["async"].step_s < c.results["colocated"].step_s
    assert el.steps == 8 and el.resumed_calls > 0   # satellites really left with calls in flight
    check_invariants(el)


def test_overrides_and_traces():
    p = with_overrides(get_profile("laptop"), ["k=6", "workload.call_s=0.5", "steps=2"])
    assert (p.k, p.workload.call_s, p.workload.steps) == (6, 0.5, 2)
    with pytest.raises(ValueError, match="not a int"):
        with_overrides(p, ["capacity=many"])
    w = workload_from_trace([5, 7], steps=1, executions_per_step=50)
    assert w.max_calls == 7 and set(w.calls(0)) <= {5, 7} and len(w.calls(0)) == 50
    with pytest.raises(ValueError):
        workload_from_trace([])


# ------------------------------------------------------------------ the cost-aware policy


def test_makespan_by_hand():
    from gyre_core.elastic.controller import makespan

    assert makespan([], 3) == 0.0 and makespan([5.0], 0) == float("inf")
    assert makespan([5.0, 3.0, 1.0], 3) == 5.0                 # every one has a slot: the longest
    # 2 slots, longest first: 5 | 4, then 3 goes after 4 (7), 2 after 5 (7), 1 after the first to free: 8
    assert makespan([5.0, 4.0, 3.0, 2.0, 1.0], 2) == 8.0


def test_cost_aware_is_the_waterlevel_until_training_is_the_critical_path():
    from gyre_core.elastic.controller import Counters, CostAware, Estimates, Waterlevel

    ca, wl = CostAware(), Waterlevel()
    # K = 4 cells × 4 slots, 8 executions unfinished, each 10 s left (tail 12 s): the waterlevel trains 2 cells
    c = Counters(4, 4, 20, 12, Estimates((10.0,) * 8, 0.0, (12.0,) * 8))
    assert wl.train_cells(c) == 2 and ca.train_cells(c) == 2
    assert ca.train_cells(Counters(4, 4, 20, 12)) == 2                  # no estimates: the waterlevel
    # training that fits in what the waterlevel leaves free (4 × 12 − 80 / 4 = 28 cell-seconds): unchanged
    assert ca.train_cells(Counters(4, 4, 20, 12, Estimates((10.0,) * 8, 28.0, (12.0,) * 8))) == 2
    # a new burst: 16 unfinished, the waterlevel sends every cell to rollout (t = 0); 100 cell-seconds of
    # training left, 16 · 10 / 4 = 40 slot-cell-seconds: free 4 · 12 − 40 = 8 < 100. Then t minimises
    # max(makespan of the tails on (4 − t) · 4 slots, 100 / t): t=1: max(24, 100); 2: max(24, 50);
    # 3: max(48, 33.3) = 48; 4: inf. → 3 cells keep training
    c = Counters(4, 4, 36, 20, Estimates((10.0,) * 16, 100.0, (12.0,) * 16))
    assert wl.train_cells(c) == 0 and ca.train_cells(c) == 3


def test_cost_aware_holds_its_planned_reserve_or_static_split():
    from gyre_core.elastic.controller import Counters, CostAware, Estimates

    # K = 8 × 8 slots, a new burst: 64 unfinished, 10 s left each (tails 12 s), 1 cell-second of training
    # left: the critical-path rule sends every cell to rollout — a reserve of 3 keeps three training
    c = Counters(8, 8, 128, 64, Estimates((10.0,) * 64, 1.0, (12.0,) * 64))
    assert CostAware().train_cells(c) == 0 and CostAware(reserve=3).train_cells(c) == 3
    assert CostAware(reserve=9).train_cells(c) == 7                   # never the whole fleet
    # 16 left: the rule trains 6 (the waterlevel's 8 − 16/8), above the reserve
    assert CostAware(reserve=3).train_cells(Counters(8, 8, 80, 64, Estimates((10.0,) * 16, 1.0, (12.0,) * 16))) == 6
    # static: exactly the split, with or without estimates
    assert CostAware(reserve=5, static=True).train_cells(c) == 5
    assert CostAware(reserve=5, static=True).train_cells(Counters(8, 8, 80, 64)) == 5


def test_the_plan_is_the_fastest_candidate_on_fresh_draws_and_beats_every_static_split():
    """`plan_reserve` simulates every candidate (the rule with reserve 0..K−1, the static splits 1..K−1) on
    the workload's distribution with other draws (seed + 1) and keeps the fastest; the plan then runs the
    real draws no slower than async at its best split — here training is 62% of the work, where the
    waterlevel alone loses to the static split by 12% (bench/experiments/sim_train_share.py's row)."""
    import dataclasses

    from bench.elastic import CAPACITY_EMULATED as CAP, K_EMULATED as K, MICRO_EMULATED as M, WORKLOAD
    from gyre_core.elastic.sim import PLAN_STEPS, plan_reserve

    w = dataclasses.replace(WORKLOAD, call_s=0.03, env_s=0.06, optimizer_s=0.05, steps=8, train_s_per_call=0.05)
    plan = plan_reserve(w, K, CAP, 1, M)
    fresh = dataclasses.replace(w, steps=min(w.steps, PLAN_STEPS), seed=w.seed + 1)
    cands = [(r, False) for r in range(K)] + [(r, True) for r in range(1, K)]
    steps = {c: simulate(fresh, K, CAP, "cost-aware", 1, 1, M, plan=c).step_s for c in cands}
    assert steps[plan] == min(steps.values()) and plan == next(c for c in cands if steps[c] == steps[plan])
    ca = simulate(w, K, CAP, "cost-aware", 1, 1, M).step_s
    best_static = min(simulate(w, K, CAP, "async", t, 1, M).step_s for t in range(1, K))
    assert ca <= best_static * (1 + 1e-9) and ca < 0.95 * simulate(w, K, CAP, "elastic", 1, 1, M).step_s


def test_cost_aware_never_slower_than_the_waterlevel_here_and_faster_when_training_dominates():
    """The simulator is deterministic: on the bench's fleet (bench/experiments/sim_train_share.py's rows) the
    cost-aware policy takes the waterlevel's decisions while rollout dominates, and wins where training is
    most of the work (the regime where the waterlevel loses to a static split)."""
    import dataclasses

    from bench.elastic import CAPACITY_EMULATED, K_EMULATED, MICRO_EMULATED, WORKLOAD

    base = dataclasses.replace(WORKLOAD, call_s=0.03, env_s=0.06, optimizer_s=0.05, steps=8)
    for t, wins in ((0.002, False), (0.1, True)):
        w = dataclasses.replace(base, train_s_per_call=t)
        el, ca = (simulate(w, K_EMULATED, CAPACITY_EMULATED, p, 1, 1, MICRO_EMULATED) for p in ("elastic", "cost-aware"))
        check_invariants(ca)
        if wins:
            assert ca.step_s < 0.95 * el.step_s, (t, ca.step_s, el.step_s)
        else:
            assert ca.step_s == el.step_s and [d.train_after for d in ca.decisions] == [d.train_after for d in el.decisions]


def test_the_verl_style_switch_lends_its_training_cells_while_the_buffer_is_short():
    from gyre_core.elastic.controller import AdaptiveSwitch, Counters

    p = AdaptiveSwitch(2)                                   # 2 training cells of 5; threshold 0.5 of a burst of 10
    c = lambda version, ready, untrained: Counters(5, 4, 20, 10, None, version, ready, untrained, 10)  # noqa: E731
    assert p.train_cells(c(0, 0, 10)) == 0 and p.lent       # a step begins with an empty buffer: lent to rollout
    assert p.train_cells(c(0, 4, 10)) == 0                  # 4 < 5 ready
    assert p.train_cells(c(0, 5, 10)) == 2 and not p.lent   # reclaimed at 5
    assert p.train_cells(c(0, 0, 3)) == 2 and p.starved     # ran dry before the burst was trained
    assert p.train_cells(c(1, 2, 10)) == 0 and p.threshold == pytest.approx(0.625)   # raised, and lent again
    assert p.train_cells(c(1, 7, 10)) == 2                  # 7 ≥ 6.25
    assert p.train_cells(c(2, 9, 10)) == 2 and p.threshold == pytest.approx(0.5625)  # not starved: lowered; 9 ≥ 5.6
    assert AdaptiveSwitch(3).train_cells(Counters(5, 4, 20, 10)) == 3                # no buffer counts: async


def test_the_planner_process_answers_what_plan_reserve_does_in_process():
    """`python -m gyre_core.elastic.plan` (what the runtime starts once a version) returns the same plan."""
    import subprocess
    import sys

    from gyre_core.elastic.sim import plan_reserve

    w = workload_from_trace([1, 2, 3, 4, 5, 6], steps=3, executions_per_step=4, call_s=0.3, env_s=0.2,
                            train_s_per_call=0.4, optimizer_s=0.2, publish_s=0.0, switch_to_train_s=0.05,
                            switch_to_rollout_s=0.05)
    ask = json.dumps({"workload": w.to_dict(), "k": 3, "capacity": 2, "max_staleness": 1, "micro": 1})
    p = subprocess.run([sys.executable, "-m", "gyre_core.elastic.plan"], input=ask, capture_output=True, text=True,
                       check=True)
    assert tuple(json.loads(p.stdout)) == plan_reserve(w, 3, 2, 1, 1)


def test_an_oracle_that_knows_lengths_starts_the_longest_first_by_hand():
    # one cell of two slots, calls of 1 s, no turns: burst [1, 1, 3]. FIFO starts the two short ones, the
    # long one at 1 → rollout ends at 4; knowing lengths starts the long one at 0 → ends at 3. Then both
    # train 5 calls × 0.1 s and update 0.2 s: 4.7 against 3.7.
    w = scripted([[1, 1, 3]], call_s=1.0, env_s=0.0, train_s_per_call=0.1, optimizer_s=0.2, publish_s=0.0,
                 switch_to_train_s=0.0, switch_to_rollout_s=0.0)
    fifo = simulate(w, k=1, capacity=2, policy="colocated", micro_step_executions=3)
    oracle = simulate(w, k=1, capacity=2, policy="colocated", micro_step_executions=3, knows_lengths=True)
    assert fifo.step_ends == pytest.approx([4.7]) and oracle.step_ends == pytest.approx([3.7])
    check_invariants(oracle)
