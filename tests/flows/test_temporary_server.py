"""The temporary Prefect server `gyre` starts on a laptop: a start that never answers is retried once and
then stops the command with one line saying what to do, leaving no server process behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.listeners import process_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.fault("the temporary Prefect server does not start", "retried once, then one line saying what to do (rc 1); no run started")
def test_a_server_that_does_not_answer_in_time_is_one_line_with_what_to_do(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")   # no server answers that fast
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "gyre_cli", "train", "--preset", "smoke",
         "--set", f"run.out_root={tmp_path / 'runs'}", "--set", f"lake.root={tmp_path / 'lake'}",
         "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, out.stderr                          # one line, no traceback
    log = tmp_path / "prefect" / "temporary-server.log"
    assert lines[0] == (
        f"gyre: the temporary Prefect server did not answer within 1 s, twice (its log: {log}). "
        "Start one that stays up with `gyre up` (or `prefect server start`) and set PREFECT_API_URL to it, "
        "or allow a slow machine more time with PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    assert log.exists()
    assert not (tmp_path / "runs").exists()                      # no run was started


def test_both_tries_are_stopped_before_the_error(tmp_path):
    from gyre_ops.temporary_server import ServerStartError, TemporaryServer

    before = set(process_tree(os.getpid()))
    server = TemporaryServer(tmp_path, timeout_s=0.05)
    try:
        server.start()
    except ServerStartError:
        pass
    else:
        raise AssertionError("a server answered within 0.05 s")
    assert server.proc is None
    assert set(process_tree(os.getpid())) == before              # both uvicorn processes reaped


def test_a_first_run_in_an_empty_directory_ends_cleanly(tmp_path):
    """`gyre train` from an empty directory on a laptop (no data/ folder, no Prefect server): the home's data
    folders are made, the run ends with rc 0, and Prefect's logs reach the temporary server before it stops
    (left queued, they were retried for about a minute after the summary, with "Error logging to API")."""
    home = tmp_path / "exp"
    home.mkdir()
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    for name in ("PREFECT_API_URL", "GYRE_HOME", "MLFLOW_TRACKING_URI"):   # (MLflow sets it in a process that
        # tracked a run: earlier tests in this one)
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-m", "gyre_cli", "train", "--preset", "smoke"],
                         cwd=home, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "temporary Prefect server" in out.stderr
    assert "Error logging to API" not in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in (home / "data").iterdir()) == ["lake", "mlflow", "runs"]
