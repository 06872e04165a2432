"""`gyre train` stopped by SIGTERM (a scheduler's stop, `kill`) leaves nothing running behind it."""
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_stops_the_run_and_the_temporary_prefect_server_it_started(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)           # the run starts its own temporary server, as on a laptop
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_cli", "train", "--preset", "smoke",
         "--set", f"run.out_root={tmp_path / 'runs'}", "--set", f"lake.root={tmp_path / 'lake'}",
         "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port, seen = None, []
        for line in proc.stdout:                   # until the flow is running on the server it started
            seen.append(line)
            m = re.search(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else port
            if "Beginning flow run" in line:
                break
        assert port is not None, "".join(seen)
        socket.create_connection(("127.0.0.1", port), timeout=10).close()   # the server is up
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
        assert proc.returncode == 130, "".join(seen) + rest
        assert "run the same command again to resume run 'smoke-s0'" in rest
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        if proc.poll() is None:                # a failed check leaves no run behind
            proc.kill()
            proc.wait()
