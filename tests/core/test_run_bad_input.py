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


def test_demonstrations_longer_than_a_call_are_said_out_loud(tmp_path, capfd):
    """A preset's max_new_tokens once cut 7-token expert commands silently."""
    from gyre_core import phases
    from gyre_core.run import RunDir

    cfg = load_config("smoke", [f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake",
                                f"tracking.uri=sqlite:///{tmp_path}/m.db", "harness.max_new_tokens=1",
                                "env.target=gyre_core.envs.scripted:ScriptedEnv", "env.kwargs={length: 3}",
                                "warmstart.episodes=4", "warmstart.steps=1"])
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    demos = phases.run_objects.read_records(RunDir.open(run_dir), "demos")
    lengths = [len(c.completion_ids) for r in demos for c in r.calls]
    over = sum(n > 1 for n in lengths)
    assert over > 0 and RunDir.open(run_dir).done("warm_start")["demo_calls_cut"] == over
    assert (f"gyre: {over} of {len(lengths)} demonstrated actions are longer than harness.max_new_tokens=1 "
            f"(up to {max(lengths)} tokens)") in capfd.readouterr().err


@pytest.mark.fault("a lake part lost after its step finished", "the marker is withdrawn and the phase redone: the same data again")
def test_a_resume_redoes_the_phases_whose_lake_parts_were_set_aside_and_writes_the_same_data(tmp_path, capfd):
    """A step's rollout part loses its manifest (truncated) and its score part's manifest is deleted, after the
    step trained: the resume sets both parts aside (never deletes them), withdraws the rollout and score
    markers, and redoes those two phases from the same policy version and seeds — the rewritten parts hold
    exactly what the lost ones held, and the weights the step published are untouched."""
    import hashlib
    import json

    from gyre_core.lake import Lake
    from gyre_core.run import RunDir, step_marker

    cfg = _cfg(tmp_path)
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    steps = (phases.rollout, phases.score, phases.process, phases.train, phases.publish)
    for fn in steps:
        fn(run_dir, 0)
    run = RunDir.open(run_dir)
    query = ("SELECT c.execution_id, c.call_index, c.completion_ids, c.logprobs, s.advantage FROM calls c "
             "JOIN scores s USING (execution_id) ORDER BY 1, 2")
    before = connect(f"{tmp_path}/lake", run_id=run.run_id).execute(query).fetchall()
    assert len(before) >= cfg.rollout.tasks_per_step * cfg.rollout.group_size
    v1 = run.path / "weights" / "v1.safetensors"
    weights = hashlib.sha256(v1.read_bytes()).hexdigest()
    lake = Lake(f"{tmp_path}/lake")
    rollout_manifest = f"{lake.part_dir(run.run_id, 'step=0')}/_MANIFEST.json"
    text = lake.fs.cat(rollout_manifest).decode()
    lake.fs.pipe(rollout_manifest, text[: len(text) // 2].encode())         # truncated mid-write
    lake.fs.rm(f"{lake.part_dir(run.run_id, 'score=0')}/_MANIFEST.json")    # lost
    capfd.readouterr()

    assert phases.prepare(cfg) == run_dir                                   # the resume
    err = capfd.readouterr().err
    assert f"lake part step=0 is missing though {step_marker('rollout', 0)} was done" in err
    assert f"lake part score=0 is missing though {step_marker('score', 0)} was done" in err
    withdrawn = sorted(p.name.split("-")[0] for p in (run.path / "markers" / "withdrawn").iterdir())
    assert withdrawn == [step_marker("rollout", 0), step_marker("score", 0)]
    quarantined = {json.loads(lake.fs.cat(p))["source"].rsplit("/", 1)[-1]
                   for p in lake.fs.glob(f"{tmp_path}/lake/_quarantine/{run.run_id}/*/*/reason.json")}
    assert {"step=0", "score=0"} <= quarantined                             # set aside, not deleted
    assert "step=0" not in lake.parts(run.run_id)
    for fn in steps:
        fn(run_dir, 0)
    assert connect(f"{tmp_path}/lake", run_id=run.run_id).execute(query).fetchall() == before
    assert hashlib.sha256(v1.read_bytes()).hexdigest() == weights
    assert run.done(step_marker("rollout", 0)) is not None and run.done(step_marker("score", 0)) is not None
