"""`gyre bench prefect`: each RL step's wall time is cut from the flow run's task-run timestamps."""
import pytest

from bench.prefect_overhead import step_walls


def test_step_walls_run_from_the_end_of_the_previous_publish():
    times = {"prepare": (0.0, 1.0), "warm-start": (1.2, 9.0), "evaluate-before": (9.1, 12.0),
             "rollout-0": (12.3, 20.0), "score-0": (20.1, 20.5), "process-0": (20.6, 21.0), "train-0": (21.1, 25.0),
             "publish-0": (25.1, 26.0), "rollout-1": (26.4, 33.0), "publish-1": (38.0, 39.5)}
    # step 0: 26.0 − 12.0 (the gap after evaluate-before counts); step 1: 39.5 − 26.0
    assert step_walls(times, 2) == pytest.approx([14.0, 13.5])
    assert step_walls(times, 1) == pytest.approx([14.0])
    with pytest.raises(KeyError, match="publish-2"):
        step_walls(times, 3)
