"""`gyre bench elastic`: the call and environment-turn times the simulator is calibrated with."""
import pytest

from bench.elastic import turn_times


def test_turn_times_leave_out_first_calls_and_measure_the_gaps_between_calls():
    # execution a: first call waited for a slot (0→3), then calls of 0.5 and 0.7 after turns of 1.0 and 0.5
    # execution b: one call only (no latency counted: it may include a wait), no gap
    # execution c: calls of 0.2 / 0.4 (the first left out), one turn of 0.25
    a = [(0.0, 3.0), (4.0, 4.5), (5.0, 5.7)]
    b = [(1.0, 2.0)]
    c = [(10.0, 10.2), (10.45, 10.85)]
    call_s, env_s = turn_times([a, b, c])
    assert call_s == pytest.approx((0.5 + 0.7 + 0.4) / 3)
    assert env_s == pytest.approx((1.0 + 0.5 + 0.25) / 3)


def test_others_in_flight_is_the_time_average_concurrency_beside_each_call():
    from bench.elastic import others_in_flight

    # first calls (left out of the average, as they include a wait for a slot) far away, alone
    first = [(100.0 + 10 * i, 101.0 + 10 * i) for i in range(5)]
    # x 0–4 beside y 2–4: over x 1.5 calls in flight on average (itself included), over y 2; z 10–11 alone: 1.
    # One cell: 0.5, 1 and 0 others, mean 0.5. Two cells hold 1.5 / 2 calls per cell on average over x / y:
    # fewer than a call beside them, 0 each
    x, y, z = (0.0, 4.0), (2.0, 4.0), (10.0, 11.0)
    ex = [[first[0], x, z], [first[1], y]]
    assert others_in_flight(ex, 1) == pytest.approx(0.5)
    assert others_in_flight(ex, 2) == 0.0
    # four calls at once 20–21 on 2 cells: 2 per cell, 1 other beside each
    ex = [[first[i], (20.0, 21.0)] for i in range(4)]
    assert others_in_flight(ex, 2) == pytest.approx(1.0)
    assert others_in_flight([], 2) == 0.0 and others_in_flight([[first[0]]], 2) == 0.0
