"""Faults in a run's own process, each against an uninterrupted reference run of the same config.

A child process runs the steps (no Prefect) and is SIGKILLed at one point — in the warm start, in an RL
step's update, between a lake part's files and its manifest, in the middle of writing a checkpoint — or
meets a full disk; the run is then resumed here. Every fault must end with what the reference ended with:
the same final weights (bit for bit), every execution of every step exactly once in the lake with the same
tokens, the last good checkpoint untouched by the fault, and the lake answering queries throughout.
"""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gyre_core import phases
from gyre_core.config import load_config
from gyre_core.lake.sql import connect
from gyre_core.run import RunDir

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _overrides(tmp: Path) -> list[str]:
    return [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            "env.target=gyre_core.envs.scripted:ScriptedEnv", "env.kwargs={length: 4}", "env.eval_seed_start=1000",
            "warmstart.episodes=8", "warmstart.steps=3", f"rl.steps={STEPS}", "rl.lr=3e-3", "run.threads=1"]


def _run_steps(cfg) -> str:
    run_dir = phases.prepare(cfg)
    phases.warm_start(run_dir)
    for step in range(STEPS):
        for fn in (phases.rollout, phases.score, phases.process, phases.train, phases.publish):
            fn(run_dir, step)
    return run_dir


# In the child: the fault, installed by wrapping the function at the point named, then the steps.
CHILD = textwrap.dedent('''
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from tests.core.test_faults import _overrides, _run_steps
    from pathlib import Path
    from gyre_core.config import load_config

    where = {where!r}
    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "warm start":                    # at the second supervised update of the warm start
        from gyre_core.trainer.trainer import Trainer
        real, calls = Trainer.optimizer_step, []
        def optimizer_step(self, *a, **k):
            calls.append(1)
            if len(calls) == 2:
                die()
            return real(self, *a, **k)
        Trainer.optimizer_step = optimizer_step
    elif where == "RL step":                     # step 1's update applied in memory, nothing saved yet
        from gyre_core.phases import rl_step
        real = rl_step._update
        def _update(run, step, *a, **k):
            out = real(run, step, *a, **k)
            if step == 1:
                die()
            return out
        rl_step._update = _update
    elif where == "lake write":                  # step 1's Parquet files written, its manifest not
        from gyre_core.lake.store import Lake
        real = Lake._put_json
        def _put_json(self, path, body):
            if path.endswith("step=1/_MANIFEST.json"):
                die()
            return real(self, path, body)
        Lake._put_json = _put_json
    elif where == "checkpoint write":            # half of version 2's optimizer state on disk
        import torch
        real = torch.save
        def save(obj, f, *a, **k):
            if isinstance(f, (str, os.PathLike)) and "optim_states" in str(f) and "/v2/" in str(f):
                real(obj, f, *a, **k)
                size = os.path.getsize(f)
                with open(f, "r+b") as out:
                    out.truncate(size // 2)
                die()
            return real(obj, f, *a, **k)
        torch.save = save
    _run_steps(load_config("smoke", _overrides(Path({tmp!r}))))
''')


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _outcome(tmp: Path, cfg) -> dict:
    """What a finished run left: final weights' hash, the train executions and their tokens per step."""
    run = RunDir.open(RunDir.path_of(cfg))
    con = connect(f"{tmp}/lake", run_id=run.run_id)
    rows = con.execute("SELECT step, count(*), count(DISTINCT execution_id) FROM executions "
                       "WHERE split = 'train' GROUP BY step ORDER BY step").fetchall()
    tokens = con.execute("SELECT execution_id, call_index, completion_ids FROM calls WHERE step >= 0 "
                         "ORDER BY 1, 2").fetchall()
    return {"weights": _sha(Path(run.weights_uri(STEPS))), "per_step": rows, "tokens": tokens,
            "checkpoints": sorted(p.name for p in run.ckpt.iterdir() if p.is_dir())}


def _ends_as(reference: dict, got: dict, ledger) -> None:
    """Count what the resumed run lost or duplicated against the reference, then require the same outcome."""
    ledger.record(lost=sum(n for _, n, _ in reference["per_step"]) - sum(d for _, _, d in got["per_step"]),
                  duplicated=sum(n - d for _, n, d in got["per_step"]))
    assert got == reference


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    cfg = load_config("smoke", _overrides(tmp))
    _run_steps(cfg)
    out = _outcome(tmp, cfg)
    n = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    assert out["per_step"] == [(s, n, n) for s in range(STEPS)]
    run = RunDir.open(RunDir.path_of(cfg))
    assert _sha(Path(run.weights_uri(STEPS))) != _sha(Path(run.weights_uri(0)))    # the steps really trained
    return out


@pytest.mark.fault("SIGKILL of the train process", "in the warm start / in an RL step's update / between a lake "
                   "part's files and its manifest / in the middle of a checkpoint write")
@pytest.mark.parametrize("where", ["warm start", "RL step", "lake write", "checkpoint write"])
def test_sigkill_then_resume_ends_where_the_uninterrupted_run_ends(tmp_path, reference, where, fault_ledger):
    cfg = load_config("smoke", _overrides(tmp_path))
    child = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), where=where, tmp=str(tmp_path))],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    run = RunDir.open(RunDir.path_of(cfg))
    good = {p.name: {f.name: _sha(f) for f in p.iterdir() if f.is_file()}
            for p in run.ckpt.iterdir() if p.is_dir() and p.name != "v2"}     # checkpoints finished before it
    if (Path(f"{tmp_path}/lake") / "runs").exists():                        # the lake answers after the kill
        connect(f"{tmp_path}/lake", run_id=run.run_id).execute("SELECT count(*) FROM executions").fetchall()
    _run_steps(cfg)                                                         # the resume
    for tag, files in good.items():                                         # untouched by the fault or resume
        assert {f.name: _sha(f) for f in (run.ckpt / tag).iterdir() if f.is_file()} == files, tag
    _ends_as(reference, _outcome(tmp_path, cfg), fault_ledger)


@pytest.mark.fault("a full disk", "for the lake / for checkpoints: the step stops with the OS error; a rerun "
                   "resumes")
@pytest.mark.parametrize("what", ["lake", "checkpoint"])
def test_a_full_disk_stops_the_step_and_a_rerun_resumes_exactly(tmp_path, reference, what, monkeypatch, fault_ledger):
    import torch

    from gyre_core.lake.store import Lake

    cfg = load_config("smoke", _overrides(tmp_path))
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as m:
        if what == "lake":
            real = Lake._put

            def put(self, path, write):
                if "step=1/" in path:
                    raise full
                return real(self, path, write)
            m.setattr(Lake, "_put", put)
        else:
            real_save = torch.save

            def save(obj, f, *a, **k):
                if "/v2/" in str(f):
                    raise full
                return real_save(obj, f, *a, **k)
            m.setattr(torch, "save", save)
        with pytest.raises(OSError) as exc:
            _run_steps(cfg)
        assert exc.value.errno == errno.ENOSPC
    run = RunDir.open(RunDir.path_of(cfg))
    assert run.latest_version() == 1                          # step 0 finished, step 1 did not
    _run_steps(cfg)                                           # space again: the same command resumes
    _ends_as(reference, _outcome(tmp_path, cfg), fault_ledger)


@pytest.mark.fault("a full disk or a dead vLLM server, seen by `gyre train`", "one line naming the error and how "
                   "to resume, rc 1")
@pytest.mark.parametrize("what", ["full disk", "vLLM server dead"])
def test_gyre_train_says_what_stopped_it_in_one_line(tmp_path, monkeypatch, capsys, what):
    import flows.train
    from prefect.context import refresh_global_settings_context

    from gyre_cli.main import main
    from gyre_core.engine.vllm import VLLMError

    if what == "full disk":
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{tmp_path}/lake/x.parquet")
        said = f"No space left on device writing {tmp_path}/lake/x.parquet; free some space and run the same"
    else:
        said = "vLLM /v1/completions (stream): RemoteProtocolError: peer closed (server dead: x; log y); run the same"
        error = VLLMError(said.split("; run the same")[0])

    def train(**kw):
        raise error
    monkeypatch.setattr(flows.train, "train", train)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")     # no server is started for this
    refresh_global_settings_context()
    try:
        rc = main(["train", "--preset", "smoke", *[a for o in _overrides(tmp_path) for a in ("--set", o)]])
    finally:
        monkeypatch.undo()
        refresh_global_settings_context()
    assert rc == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("gyre: error: " + said) and line.endswith("resume run 'smoke-s0'"), line


def test_the_fault_table_in_the_docs_is_the_tests_markers():
    """docs/faults.md holds exactly what `gyre bench faults --table` prints from the markers, and every row's
    test exists with the marker (read from the test sources)."""
    from bench.faults import fault_rows, render, table_in

    assert table_in((ROOT / "docs" / "faults.md").read_text()) == render(), "python -m bench.faults --write"
    rows = fault_rows()
    assert len({r.fault for r in rows}) >= 20
    for r in rows:
        path, name = r.test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), r.test
