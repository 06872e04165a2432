"""Confined commands: every command an agent or an evaluator runs in a workspace goes through here.

    box = Sandbox(workspace, SandboxLimits(wall_s=30))
    r = box.run("python -m pytest -q")          # -> RunResult(exit_code, output, timed_out, seconds)

Isolation is bubblewrap's (`bwrap`, Debian's `bubblewrap`; `scripts/install.sh` installs it): each command
runs in new namespaces (user, network, PID, IPC, UTS, cgroup) with

- **no network**: its network namespace has no interface but a down loopback;
- **no writes outside the workspace, and no sight of the rest of the host**: only the system (`/usr`,
  `/etc` with its password hashes read as empty, the `/lib`s) and Gyre's Python (its installation and
  virtual environment) are mounted, read-only; the workspace is bound read-write at `/tmp/workspace` (the
  working directory); `/tmp` is a private tmpfs of `tmp_mb` (Gyre's Python bound into it read-only where a
  checkout lives under /tmp); `/dev` and `/proc` are the sandbox's own. Not
  mounted, so not there: the project, its runs and lakes, a task's hidden tests, home directories, other
  workspaces;
- **no privileges**: Gyre run as root makes the command `nobody` inside its user namespace with every
  capability dropped (outside it keeps root's uid without any capability: what is mounted read-only stays
  so, and what is not mounted cannot be reached);
- **limits**: CPU seconds, address space and the largest file it may write (set by util-linux's `prlimit`
  before it execs bwrap, inherited by everything it starts); processes and memory by a cgroup of its own when Gyre runs as root (the kernel
  exempts root's uid from RLIMIT_NPROC, and the command's uid outside its namespace is root's), else by
  RLIMIT_NPROC, raised by what the user already runs; and a wall-clock timeout after which the sandbox is
  killed — its PID namespace with it, every process it started included;
- **no way back**: a new session (no terminal to inject into), the host's processes invisible.

Nothing here is hand-rolled isolation: bwrap sets the namespaces and mounts, the kernel enforces the limits.
What it does not do: seccomp filtering of system calls; run as a user (not root), memory is bounded per
process by the address-space limit only.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
MOUNT = "/tmp/workspace"
# What a sandbox sees of the host, read-only, besides Gyre's Python.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
HIDDEN_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")   # read as empty


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (bwrap missing, or the kernel refuses its namespaces)."""


@dataclass(slots=True, frozen=True)
class SandboxLimits:
    wall_s: float = 60.0           # then the whole sandbox is killed
    cpu_s: int = 60                # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 2048          # address space of each process (RLIMIT_AS)
    file_mb: int = 64              # largest file it may write (RLIMIT_FSIZE)
    processes: int = 64            # processes and threads (RLIMIT_NPROC, beyond what the uid already runs)
    tmp_mb: int = 64               # its private /tmp
    output_bytes: int = 64 << 10   # the output kept (the tail)


@dataclass(slots=True)
class RunResult:
    exit_code: int                 # negative: killed by that signal
    output: str                    # stdout and stderr together, the last `output_bytes`
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError("bubblewrap (bwrap) is not installed: run `bash scripts/install.sh` as root, or "
                           "`sudo apt-get install bubblewrap`")
    if shutil.which("prlimit") is None:
        raise SandboxError("prlimit (util-linux) is not installed: `sudo apt-get install util-linux`")
    return path


# `python` is Gyre's (its virtual environment first), then the system's tools
SANDBOX_PATH = f"{Path(sys.prefix) / 'bin'}:{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin"


def python_dirs() -> set[str]:
    """Gyre's Python: its installation and its virtual environment (real paths), so that commands run Python
    with the packages Gyre has (pytest for a test runner)."""
    return {str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix)}


class Sandbox:
    """Runs commands confined to `workspace`; they see the system and Python read-only (and `extra_ro`),
    nothing else of the host."""

    def __init__(self, workspace: str | Path, limits: SandboxLimits = SandboxLimits(),
                 env: dict[str, str] | None = None, extra_ro: tuple[str, ...] = ()) -> None:
        self.workspace = Path(workspace).resolve()
        if not self.workspace.is_dir():
            raise SandboxError(f"workspace {self.workspace} is not a directory")
        self.limits, self.env, self.extra_ro = limits, dict(env or {}), tuple(extra_ro)
        self._bwrap = bwrap_path()
        self._as_root = os.geteuid() == 0

    def argv(self, command: str | list[str]) -> list[str]:
        """The bwrap command line around `command` (a shell string, or an argv)."""
        inner = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        args = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        if self._as_root:
            args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]
        for path in SYSTEM_DIRS:            # merged-/usr links kept as links
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in HIDDEN_FILES:
            if os.path.exists(path):
                args += ["--ro-bind", "/dev/null", path]
        # the private /tmp before what is bound read-only: Gyre's Python in a checkout under /tmp stays visible
        args += ["--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        for path in sorted(python_dirs() | {str(Path(p).resolve()) for p in self.extra_ro}):
            args += ["--ro-bind", path, path]
        args += ["--bind", str(self.workspace), MOUNT, "--dev", "/dev", "--proc", "/proc", "--chdir", MOUNT,
                 "--clearenv"]
        env = {"PATH": SANDBOX_PATH, "HOME": MOUNT, "LANG": "C.UTF-8", "TMPDIR": "/tmp",
               "PYTHONDONTWRITEBYTECODE": "1", **self.env}
        for k, v in env.items():
            args += ["--setenv", k, v]
        return args + ["--"] + inner

    def run(self, command: str | list[str], stdin: str | None = None) -> RunResult:
        """Run `command` in the sandbox and wait (at most `limits.wall_s`)."""
        lim = self.limits
        group = _Cgroup.make(lim) if self._as_root else None
        join = group.procs_files if group is not None else []
        # the limits are set by `prlimit` and the cgroup joined by a shell that then execs it: nothing runs in
        # the forked child before exec (a `preexec_fn` may deadlock there while other threads run sandboxes)
        limits = ["prlimit", f"--cpu={lim.cpu_s}", f"--fsize={lim.file_mb << 20}", "--core=0",
                  f"--as={lim.memory_mb << 20}"]
        if not join:                  # no cgroup (not root): the process count by RLIMIT_NPROC, per user
            nproc = lim.processes + _processes_of(os.geteuid())
            limits.append(f"--nproc={nproc}")
        argv = limits + ["--"] + self.argv(command)
        env = dict(os.environ)
        if join:                      # into its cgroup first: every process it starts is counted there
            env["GYRE_CGROUP_PROCS"] = " ".join(join)
            argv = ["sh", "-c", 'for f in $GYRE_CGROUP_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"',
                    "sh"] + argv

        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, env=env,
                                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                out, _ = proc.communicate(stdin.encode() if stdin is not None else None, timeout=lim.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                out, _ = proc.communicate()
        finally:
            if group is not None:
                group.remove()
        seconds = time.monotonic() - t0
        text = out[-lim.output_bytes:].decode(errors="replace")
        if proc.returncode != 0 and not timed_out and text.startswith("bwrap:"):
            raise SandboxError(f"the sandbox could not start: {text.splitlines()[0]}")
        return RunResult(proc.returncode, text, timed_out, seconds)


class _Cgroup:
    """A cgroup per run (v2, or v1's `pids` and `memory` hierarchies) capping processes and memory."""

    ROOT = Path("/sys/fs/cgroup")
    _serial = itertools.count()

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self.procs_files = [str(d / "cgroup.procs") for d in dirs]

    @classmethod
    def make(cls, lim: SandboxLimits) -> "_Cgroup":
        name = f"gyre-sandbox-{os.getpid()}-{time.monotonic_ns()}-{next(cls._serial)}"   # unique across threads and runs
        try:
            if (cls.ROOT / "cgroup.controllers").exists():          # v2
                d = cls.ROOT / name
                d.mkdir()
                group = cls([d])
                (d / "pids.max").write_text(str(lim.processes))
                (d / "memory.max").write_text(str(lim.memory_mb << 20))
                (d / "memory.swap.max").write_text("0") if (d / "memory.swap.max").exists() else None
            else:                                                    # v1
                pids, mem = cls.ROOT / "pids" / name, cls.ROOT / "memory" / name
                pids.mkdir()
                group = cls([pids])
                mem.mkdir()
                group = cls([pids, mem])
                (pids / "pids.max").write_text(str(lim.processes))
                (mem / "memory.limit_in_bytes").write_text(str(lim.memory_mb << 20))
        except OSError as exc:
            if "group" in locals():
                group.remove()
            raise SandboxError(f"run as root, the sandbox caps processes and memory with a cgroup, and none could be "
                               f"made under {cls.ROOT} ({exc}); run Gyre as a user (RLIMIT_NPROC then applies)") from None
        return group

    def remove(self) -> None:
        """Kill whatever is left in it, then remove it."""
        for _ in range(100):
            pids = [int(x) for f in self.procs_files if os.path.exists(f) for x in Path(f).read_text().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def _kill(proc: subprocess.Popen) -> None:
    """Kill bwrap (its PID namespace dies with it) and anything left in its session."""
    for target in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def _processes_of(uid: int) -> int:
    n = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                n += d.stat().st_uid == uid
            except OSError:
                pass
    return n
