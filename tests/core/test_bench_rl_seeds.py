"""`bench/experiments/rl_seeds.py`: RL vs control pooled over independent runs, against numbers worked by hand."""
import json
import math

import pytest
import yaml

from bench.experiments.rl_seeds import compare_runs, config_differences, load_run, main
from gyre_core.evaluation import Z95

SEEDS = [10, 11, 12, 13]


def _run(root, name, before, after, control, seeds=SEEDS, cfg=None):
    d = root / name
    (d / "markers").mkdir(parents=True)
    for label, xs in (("before", before), ("after", after), ("control", control)):
        sampled = {"seeds": seeds, "successes": xs, "partials": [x / 2 for x in xs]}
        (d / "markers" / f"eval_{label}.json").write_text(json.dumps({"sampled": sampled}))
    base = {"run": {"name": name, "seed": 0}, "env": {"train_seed_start": 0}, "rl": {"lr": 1e-4}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg or base))
    return d


def test_pooled_row_averages_each_seed_over_runs(tmp_path):
    a = _run(tmp_path, "a", [0, 0, 1, 0], [1, 0, 1, 1], [0, 1, 1, 0])
    b = _run(tmp_path, "b", [0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 0])
    out = compare_runs([load_run(a, "success"), load_run(b, "success")])
    ra, rb = out["runs"]
    assert (ra["before"], ra["after"], ra["control"]) == (0.25, 0.75, 0.5)
    assert ra["rl_vs_control"]["diff"] == pytest.approx(0.25) and rb["rl_vs_control"]["diff"] == pytest.approx(0.5)
    # per seed, averaged over the runs: before [0, .5, .5, 0], after [1, .5, 1, .5], control [0, .5, 1, 0]
    p = out["pooled"]
    assert (p["before"], p["after"], p["control"]) == (0.25, 0.75, 0.375)
    # RL − before per seed [1, 0, .5, .5]: mean .5, sample variance (.25 + .25) / 3
    se = math.sqrt((0.5 / 3) / 4)
    assert p["rl"]["diff"] == pytest.approx(0.5)
    assert p["rl"]["ci95_low"] == pytest.approx(0.5 - Z95 * se)
    # RL − control per seed [1, 0, 0, .5]: mean .375, squared deviations sum to .6875
    se = math.sqrt((0.6875 / 3) / 4)
    assert p["rl_vs_control"]["diff"] == pytest.approx(0.375)
    assert p["rl_vs_control"]["ci95_high"] == pytest.approx(0.375 + Z95 * se)
    # the runs' own RL − before are both .5; their RL − control .25 and .5
    assert out["between_run_std"]["rl"] == pytest.approx(0.0)
    assert out["between_run_std"]["rl_vs_control"] == pytest.approx(0.25 / math.sqrt(2))


def test_partial_metric_reads_the_partial_scores(tmp_path):
    a = _run(tmp_path, "a", [0, 0, 1, 0], [1, 0, 1, 1], [0, 1, 1, 0])
    out = compare_runs([load_run(a, "partial")])
    assert out["pooled"]["rl"]["diff"] == pytest.approx(0.25)      # halves of the successes' .5
    assert out["between_run_std"] == {}


def test_runs_on_other_seeds_or_the_same_run_twice_are_refused(tmp_path):
    a = _run(tmp_path, "a", [0, 0, 1, 0], [1, 0, 1, 1], [0, 1, 1, 0])
    b = _run(tmp_path, "b", [0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 0], seeds=[10, 11, 12, 14])
    with pytest.raises(SystemExit, match="different held-out seeds"):
        compare_runs([load_run(a, "success"), load_run(b, "success")])
    with pytest.raises(SystemExit, match="given twice"):
        main([str(a), str(a)])
    (a / "markers" / "eval_after.json").unlink()
    with pytest.raises(SystemExit, match="no before/after evaluation"):
        load_run(a, "success")


def test_config_differences_ignore_seeds_and_names_but_name_the_rest(tmp_path):
    a = _run(tmp_path, "a", [0] * 4, [0] * 4, [0] * 4)
    b = _run(tmp_path, "b", [0] * 4, [0] * 4, [0] * 4,
             cfg={"run": {"name": "b", "seed": 1}, "env": {"train_seed_start": 9}, "rl": {"lr": 1e-4}})
    assert config_differences([a, b]) == []
    c = _run(tmp_path, "c", [0] * 4, [0] * 4, [0] * 4,
             cfg={"run": {"name": "c", "seed": 2}, "env": {"train_seed_start": 0}, "rl": {"lr": 3e-4}})
    assert config_differences([a, b, c]) == ["rl.lr"]


def test_a_control_borrowed_from_a_run_with_the_same_warm_start(tmp_path):
    """`--control-from`: an ablation row (no control of its own) takes the control of the run that shares
    its warm start; a run with another warm start (here another run.seed) is refused."""
    shipped = _run(tmp_path, "shipped", [0, 0, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0])
    other_rl = {"run": {"name": "abl", "seed": 0}, "env": {"train_seed_start": 0}, "rl": {"lr": 3e-4}}
    abl = _run(tmp_path, "abl", [0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], cfg=other_rl)
    (abl / "markers" / "eval_control.json").unlink()
    assert load_run(abl, "success")["control"] is None
    row = compare_runs([load_run(abl, "success", control_from=shipped)])["runs"][0]
    assert row["control"] == 0.5 and row["rl_vs_control"]["diff"] == pytest.approx(0.5)   # 1.0 after − 0.5
    out = main([str(abl), "--control-from", str(shipped), "--json"])
    assert out["pooled"]["rl_vs_control"]["diff"] == pytest.approx(0.5)
    seed1 = _run(tmp_path, "seed1", [0] * 4, [0] * 4, [0] * 4,
                 cfg={"run": {"name": "seed1", "seed": 1}, "env": {"train_seed_start": 0}, "rl": {"lr": 1e-4}})
    with pytest.raises(SystemExit, match=r"another warm start \(run.seed\)"):
        load_run(abl, "success", control_from=seed1)
    with pytest.raises(SystemExit, match="1 given for 2 run directories"):
        main([str(abl), str(shipped), "--control-from", str(shipped)])
