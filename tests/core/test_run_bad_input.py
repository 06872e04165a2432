"""Bad input end to end through the steps (no Prefect): failing executions, bad model paths and
environment targets, corrupt checkpoints on resume."""
import pytest

from gyre_core import phases
from gyre_core.config import ConfigError, load_config
from gyre_core.lake.sql import connect
from gyre_core.run import CheckpointError

CRASH_SEED = 1   # the second training task of step 0


def _cfg(tmp, *extra):
    return load_config("smoke", [
        f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        "env.target=gyre_core.envs.scripted:ScriptedEnv", f"env.kwargs={{length: 4, crash_seeds: [{CRASH_SEED}]}}",
        "env.eval_seed_start=1000", "warmstart.episodes=8", "warmstart.steps=3", "eval.episodes=4",
        "eval.greedy_episodes=0", "rl.steps=1", *extra])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    cfg = _cfg(tmp)
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    for fn in (phases.rollout, phases.score, phases.process, phases.train, phases.publish):
        fn(run_dir, 0)
    return tmp, cfg, run_dir


def test_an_environment_exception_fails_one_execution_with_its_reason(finished_run):
    tmp, cfg, _ = finished_run
    con = connect(f"{tmp}/lake")
    rows = con.execute("SELECT seed, status, error FROM executions WHERE split='train' ORDER BY seed").fetchall()
    G = cfg.rollout.group_size
    assert [r[1] == "failed" for r in rows] == [False] * G + [True] * G
    assert {r[2] for r in rows if r[0] == CRASH_SEED} == {f"RuntimeError: sandbox of episode {CRASH_SEED} died"}
    # the failed ones are excluded from training with the reason, the others trained
    excl = con.execute("SELECT count(*), any_value(reason) FROM scores WHERE excluded").fetchall()
    assert excl == [(G, f"RuntimeError: sandbox of episode {CRASH_SEED} died")]
    assert con.execute("SELECT count(DISTINCT execution_id) FROM train_tokens").fetchall() == [(G,)]


@pytest.mark.bad_input("a missing model path")
def test_missing_model_path_is_refused_before_anything_is_written(tmp_path):
    cfg = _cfg(tmp_path, f"model.path={tmp_path}/no-such-model")
    with pytest.raises(ConfigError, match=r"^model.path: .*no-such-model"):
        phases.prepare(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.bad_input("an unknown environment target")
def test_unknown_environment_target_is_a_config_error(tmp_path):
    cfg = _cfg(tmp_path, "env.target=gyre_core.envs.scripted:NoSuchEnv")
    with pytest.raises(ConfigError, match=r"^env.target: .*NoSuchEnv"):
        phases.prepare(cfg)


@pytest.mark.fault("a corrupt checkpoint", "the resume stops before any rollout, naming the file")
def test_corrupt_checkpoint_stops_a_resume_before_any_rollout(finished_run):
    tmp, cfg, run_dir = finished_run
    run = tmp / "runs" / cfg.run_id()
    weights = run / "weights" / "v1.safetensors"
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[: len(data) // 2])
        with pytest.raises(CheckpointError, match=r"v1\.safetensors are unreadable"):
            phases.prepare(cfg)
    finally:
        weights.write_bytes(data)
    optim = next((run / "ckpt" / "v1").glob("*optim_states.pt"))
    aside = optim.with_suffix(".aside")
    optim.rename(aside)
    try:
        with pytest.raises(CheckpointError, match=r"ckpt/v1 is missing or incomplete"):
            phases.prepare(cfg)
    finally:
        aside.rename(optim)
    assert phases.prepare(cfg) == run_dir    # the intact run resumes


def test_model_path_takes_any_hf_directory(finished_run, tmp_path):
    """A new run started from an existing HF model directory uses exactly its weights and tokenizer."""
    from gyre_core.model import load_policy
    from gyre_core.run import RunDir

    tmp, cfg, run_dir = finished_run
    src = RunDir.open(run_dir).warm
    new = phases.prepare(_cfg(tmp_path, f"model.path={src}", "run.name=from-path"))
    m_src, t_src = load_policy(str(src))
    m_new, t_new = load_policy(str(RunDir.open(new).policy0))
    assert t_new.get_vocab() == t_src.get_vocab() and t_new.chat_template == t_src.chat_template
    for (k, a), b in zip(m_src.state_dict().items(), m_new.state_dict().values()):
        assert a.equal(b), k


def test_demonstrations_longer_than_a_call_stop_the_warm_start_or_are_said_out_loud(tmp_path, capfd):
    """A preset's max_new_tokens once cut 7-token expert commands silently. By default the warm start now
    stops before training, naming the limit that fits; `warmstart.longer_than_a_call=warn` trains on them
    and says how many."""
    from gyre_core import phases
    from gyre_core.run import RunDir

    base = [f"lake.root={tmp_path}/lake", f"tracking.uri=sqlite:///{tmp_path}/m.db", "harness.max_new_tokens=1",
            "env.target=gyre_core.envs.scripted:ScriptedEnv", "env.kwargs={length: 3}", "warmstart.episodes=4",
            "warmstart.steps=1"]
    run_dir = phases.prepare(load_config("smoke", [*base, f"run.out_root={tmp_path}/a"]))
    with pytest.raises(ConfigError) as err:
        phases.warm_start(run_dir)
    demos = phases.run_objects.read_records(RunDir.open(run_dir), "demos")
    lengths = [len(c.completion_ids) for r in demos for c in r.calls]
    over = sum(n > 1 for n in lengths)
    assert over > 0 and str(err.value).startswith(
        f"harness.max_new_tokens: {over} of {len(lengths)} demonstrated actions are longer than "
        f"harness.max_new_tokens=1 (up to {max(lengths)} tokens, the stop token included): the policy can only "
        f"produce them cut; set harness.max_new_tokens={max(lengths)} or more")
    assert RunDir.open(run_dir).done("warm_start") is None and not (RunDir.open(run_dir).warm).exists()

    run_dir = phases.prepare(load_config("smoke", [*base, f"run.out_root={tmp_path}/b",
                                                   "warmstart.longer_than_a_call=warn"]))
    phases.warm_start(run_dir)
    assert RunDir.open(run_dir).done("warm_start")["demo_calls_cut"] == over
    assert f"gyre: {over} of {len(lengths)} demonstrated actions are longer than harness.max_new_tokens=1" in \
        capfd.readouterr().err
