"""The sandbox against hostile commands: each is refused or contained, the test process goes on, and nothing
outside the workspace changes. Real bubblewrap, real kernel limits.

    .venv/bin/python -m pytest tests/core/test_sandbox.py -q
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from gyre_core.sandbox import Sandbox, SandboxLimits, python_dirs

PY = sys.executable


@pytest.fixture()
def root(tmp_path):
    return tmp_path / "workspaces"


@pytest.fixture()
def boxes(root, tmp_path):
    (root / "mine").mkdir(parents=True)
    (root / "theirs").mkdir()
    (root / "theirs" / "secret.txt").write_text("their answer")
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    return Sandbox(root / "mine", SandboxLimits(wall_s=20, cpu_s=10, memory_mb=1024, processes=32)), outside


def test_a_command_runs_in_its_workspace(boxes):
    box, _ = boxes
    r = box.run(f"{PY} -c \"open('out.txt', 'w').write('42'); print('ok')\" && cat out.txt")
    assert r.ok and r.output.split() == ["ok", "42"]
    assert (box.workspace / "out.txt").read_text() == "42"


def test_writes_outside_the_workspace_are_refused(boxes):
    box, outside = boxes
    r = box.run(f"echo changed > {outside}; echo changed > /etc/gyre-sandbox-test; echo done")
    assert "Read-only file system" in r.output or "No such file" in r.output
    assert outside.read_text() == "untouched" and not os.path.exists("/etc/gyre-sandbox-test")


def test_another_workspace_the_project_and_home_are_invisible(boxes):
    box, _ = boxes
    theirs = box.workspace.parent / "theirs" / "secret.txt"
    project = Path(__file__).resolve().parents[2]
    r = box.run(f"cat {theirs}; ls {box.workspace.parent}; cat {project}/README.md; ls /home; echo end")
    assert "their answer" not in r.output and r.output.count("No such file") == 4, r.output
    seen = box.run("ls -A /root 2>/dev/null").output.split()
    # at most the way to Gyre's Python (its installation, its virtual environment) where it lives under /root
    pythons = {Path(d).relative_to("/root").parts[0] for d in python_dirs() if Path(d).is_relative_to("/root")}
    assert set(seen) <= pythons, (seen, pythons)


def test_what_is_bound_read_only_from_the_hosts_tmp_is_there_and_nothing_else_of_it(boxes, tmp_path):
    """Gyre's Python in a checkout under /tmp (its virtual environment there) is bound like any read-only
    directory; the sandbox's own /tmp is mounted first, so it no longer hides it."""
    _, outside = boxes
    tools = tmp_path / "checkout" / ".venv"
    tools.mkdir(parents=True)
    (tools / "tool.txt").write_text("found\n")
    box = Sandbox(tmp_path / "workspaces" / "mine", extra_ro=(str(tools),))
    r = box.run(f"cat {tools}/tool.txt; echo changed > {tools}/tool.txt; cat {outside}; echo end")
    assert r.output.split("\n")[0] == "found" and "Read-only file system" in r.output, r.output
    assert "untouched" not in r.output and (tools / "tool.txt").read_text() == "found\n"


def test_no_network_not_even_the_hosts_loopback(boxes):
    box, _ = boxes
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\nfor a in (('127.0.0.1', {port}), ('1.1.1.1', 80)):\n"
                "    try:\n        socket.create_connection(a, timeout=2); print('CONNECTED', a)\n"
                "    except OSError as e:\n        print('refused', e.errno)")
        r = box.run([PY, "-c", code])
    finally:
        server.close()
    assert "CONNECTED" not in r.output and r.output.count("refused") == 2


def test_a_fork_bomb_is_contained_and_leaves_nothing_running(boxes):
    box, _ = boxes
    t0 = time.monotonic()
    r = box.run([PY, "-c", "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                 "            time.sleep(60); os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                 "    print('stopped at', n, e.errno)"])
    assert "stopped at" in r.output and int(r.output.split()[2]) < 40
    assert time.monotonic() - t0 < 20      # the children died with the sandbox: nobody waited for them
    assert not _processes_running("time.sleep(60)")


def test_ten_gigabytes_are_refused(boxes):
    box, _ = boxes
    r = box.run([PY, "-c", "x = bytearray(10 * 1024 ** 3)"])
    assert r.exit_code != 0 and "MemoryError" in r.output


@pytest.mark.fault("an agent's command that never ends", "killed at the sandbox's wall clock")
def test_sleeping_forever_is_killed_at_the_wall_clock(boxes, root):
    box = Sandbox(root / "mine", SandboxLimits(wall_s=2))
    t0 = time.monotonic()
    r = box.run("sleep 1000 & sleep 1000")
    assert r.timed_out and time.monotonic() - t0 < 10
    time.sleep(0.5)
    assert not _processes_running("sleep 1000")


def test_killing_the_parent_is_impossible(boxes):
    box, _ = boxes
    r = box.run(f"kill -9 {os.getpid()}; kill -9 {os.getppid()}; kill -9 -1; echo tried")
    assert "tried" in r.output or r.exit_code != 0
    os.kill(os.getpid(), 0)                 # still here


def test_a_huge_file_is_cut_off(boxes):
    box, _ = boxes
    r = box.run(f"head -c {200 << 20} /dev/zero > big.bin")
    assert r.exit_code != 0 and (box.workspace / "big.bin").stat().st_size <= 64 << 20


def _processes_running(needle: str) -> bool:
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{d}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in cmd and state != "Z" and "pytest" not in cmd:
                return True
    return False
