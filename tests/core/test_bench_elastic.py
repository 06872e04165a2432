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

    # x 0–4 and y 2–4 overlap for 2 s: beside x, 2/4 = 0.5 others on average; beside y, 1 all along;
    # z 10–11 alone: 0. Mean over the three calls: 0.5, spread over 2 cells: 0.25
    x, y, z = (0.0, 4.0), (2.0, 4.0), (10.0, 11.0)
    assert others_in_flight([[x, z], [y]], 1) == pytest.approx(0.5)
    assert others_in_flight([[x, z], [y]], 2) == pytest.approx(0.25)
    assert others_in_flight([], 2) == 0.0
