"""External agent harnesses: any agent program, run once per execution, talking to the policy through the
recording proxy.

    records = run_external(cfg, chat, stop_texts, CellPool([engine]), temperature, specs, make_env, on_finish=tick)

For each execution: the environment is reset to its seed and sets up an empty workspace
(`setup_workspace`); `harness.command` runs there as a subprocess with

    OPENAI_BASE_URL        the proxy (http://127.0.0.1:<port>/v1)
    OPENAI_API_KEY         this execution's key: every call made with it is recorded under this execution
    GYRE_SUBAGENT_API_KEY  the same execution, role `sub-agent` (or send `X-Gyre-Role: sub-agent`)
    GYRE_MODEL             the model name the proxy serves
    GYRE_TASK              the task text;  GYRE_WORKSPACE  the workspace (also its working directory)

and of Gyre's own environment only `BASE_ENV` (PATH, HOME, locale, ...) and the names in `harness.pass_env`
(none of Gyre's credentials reach a program the model drives)

and the execution ends when the process exits or hits a limit: wall clock (`harness.wall_clock_s`), model
calls (`harness.max_turns`) or tokens (`harness.max_execution_tokens`) — the proxy refuses the call that
would exceed one, and the process group is then stopped. The environment's `score_workspace` scores what
it left, on one of `harness.score_workers` threads while the next execution takes the agent's slot; an evaluator that raises is retried (`harness.score_retries`), then the execution is excluded
from training (a failure is not a zero). A process that exits non-zero without a single model call is a
failed execution (the harness could not start; its output's tail is the record's error); one that made
calls is scored like any other. `python`/`python3` as the command's first word is Gyre's interpreter, and
words naming an existing file (relative to where Gyre runs, or to Gyre's project) are made absolute, since the process runs in
its workspace.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..envs import close_env, reset_env
from ..envs.protocol import supports
from ..records import STATUS_DONE, STATUS_FAILED, STATUS_TIMEOUT, ExecutionRecord
from .loop import score_record

POLL_S = 0.02
# What the agent program inherits of Gyre's environment (plus `harness.pass_env`): enough to run a program,
# none of Gyre's credentials.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
            "TERM", "SSL_CERT_FILE", "SSL_CERT_DIR")


def agent_env(harness, base_url: str, keys, model_name: str, task: str, workspace: Path) -> dict[str, str]:
    """The agent program's environment: `BASE_ENV` and `harness.pass_env` from Gyre's, then its endpoint."""
    env = {k: v for k, v in os.environ.items() if k in BASE_ENV or k in harness.pass_env or k.startswith("LC_")}
    env.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": keys.main, "GYRE_SUBAGENT_API_KEY": keys.sub_agent,
                "GYRE_MODEL": model_name, "GYRE_TASK": str(task), "GYRE_WORKSPACE": str(workspace)})
    return env


def resolve_command(command: list[str]) -> list[str]:
    """The argv to run in a workspace: `python` is Gyre's interpreter; a relative path that exists here, or in
    Gyre's project directory (`examples/...`), made absolute. A command the machine's GYRE_ALLOW_COMMANDS
    does not allow is refused (`gyre_core.trust`)."""
    from ..trust import check_command

    check_command(command)              # GYRE_ALLOW_COMMANDS, before anything is started
    project = Path(__file__).resolve().parents[2]
    out = []
    for i, word in enumerate(command):
        if i == 0 and word in ("python", "python3"):
            out.append(sys.executable)
        elif not os.path.isabs(word) and os.path.exists(word):
            out.append(os.path.abspath(word))
        elif not os.path.isabs(word) and "/" in word and (project / word).exists():
            out.append(str(project / word))
        else:
            out.append(word)
    return out


def run_external(cfg, chat, stop_texts: dict[int, str], pool, temperature: float | None, specs, make_env,
                 on_finish=None, model_name: str = "gyre-policy") -> list[ExecutionRecord]:
    """Run `specs` with the external harness `cfg.harness.command`, `cfg.rollout.concurrency` at once, through a
    proxy generating on `pool` (`proxy.pool`: a `CellPool` of engines sampling at `temperature`, or an
    `ExpertPool`, whose `bind` is told each execution's environment); the records in the order of `specs`."""
    from ..proxy import open_proxy

    command = resolve_command(cfg.harness.command)
    with open_proxy(cfg, chat, stop_texts, pool, temperature, model_name) as (proxy, server), \
            ThreadPoolExecutor(max_workers=cfg.harness.score_workers, thread_name_prefix="gyre-evaluator") as evaluators, \
            ThreadPoolExecutor(max_workers=min(cfg.rollout.concurrency, len(specs)) or 1,
                               thread_name_prefix="gyre-agent") as agents:
        def scored(rec: ExecutionRecord, workspace: Path, env) -> ExecutionRecord:
            rec = score_agent(cfg, rec, workspace, env)
            if on_finish:
                on_finish(rec)
            return rec

        def one(spec):      # the agent's slot is free again while its workspace is scored
            env = make_env()
            if hasattr(pool, "bind"):
                pool.bind(spec.execution_id, env, spec.seed)
            try:
                rec, workspace = run_agent(cfg, proxy, server.base_url, command, spec, env, serving=server.alive)
            except BaseException:
                close_env(env)
                raise
            return evaluators.submit(scored, rec, workspace, env)

        return [f.result() for f in list(agents.map(one, specs))]


def run_agent(cfg, proxy, base_url: str, command: list[str], spec, env,
              serving: Callable[[], bool] | None = None) -> tuple[ExecutionRecord, Path]:
    """The agent's part of an execution: its record and the workspace it left, for `score_agent` (which
    removes it). Its process group is gone when this returns. `serving`: whether the proxy still serves —
    an agent that ended after the proxy stopped is failed with that reason (what it left is the proxy's
    doing, not the policy's, and is not scored)."""
    workspace = Path(tempfile.mkdtemp(prefix="gyre-ws-"))
    log_path = workspace.parent / f"{workspace.name}.log"
    try:
        rec = _run_agent(cfg, proxy, base_url, command, spec, env, workspace, log_path)
        if serving is not None and not serving() and rec.status != STATUS_FAILED:
            rec = _failed(rec, f"the proxy stopped serving while the agent ran: {_tail(log_path)}")
        return rec, workspace
    except BaseException:
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    finally:
        log_path.unlink(missing_ok=True)


def score_agent(cfg, rec: ExecutionRecord, workspace: Path, env) -> ExecutionRecord:
    """The environment's evaluator on what the agent left in `workspace` (not for a failed execution); the
    workspace is removed."""
    try:
        if rec.status != STATUS_FAILED:
            score_record(rec, lambda: env.score_workspace(str(workspace)), cfg.harness.score_retries)
        return rec
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        close_env(env)


def _run_agent(cfg, proxy, base_url: str, command: list[str], spec, env, workspace: Path, log_path: Path) -> ExecutionRecord:
    h = cfg.harness
    rec = ExecutionRecord(run_id=spec.run_id, step=spec.step, execution_id=spec.execution_id, task_id=spec.task_id,
                          seed=spec.seed, split=spec.split, env=getattr(env, "name", type(env).__name__),
                          policy_version=spec.policy_version, t_start=time.time())
    try:
        if not supports(env, "setup_workspace"):
            raise TypeError(f"environment {rec.env!r} has no setup_workspace/score_workspace hooks, which an "
                            "external harness (harness.command) needs")
        reset_env(env, spec.seed, spec.split)
        task = env.setup_workspace(str(workspace))
    except Exception as exc:  # noqa: BLE001 - an environment that cannot even start
        return _failed(rec, f"{type(exc).__name__}: {exc}")
    keys = proxy.open_execution(rec)
    status, code = STATUS_DONE, None
    try:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(command, cwd=workspace, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env=agent_env(h, base_url, keys, proxy.model_name, task, workspace))
            except OSError as exc:
                return _failed(rec, f"cannot start {command[0]!r}: {exc}")
            try:
                exe = proxy.execution(rec.execution_id)
                while (code := proc.poll()) is None:
                    if exe.limit_status is not None or (h.wall_clock_s is not None
                                                        and time.time() - rec.t_start > h.wall_clock_s):
                        break
                    time.sleep(POLL_S)
                # a limit it hit (also when it exited right after being refused), else the wall clock
                status = exe.limit_status or (STATUS_TIMEOUT if code is None else STATUS_DONE)
            finally:
                _stop_group(proc)         # the leader, and whatever it left running in its group
    finally:
        closed = proxy.close_execution(rec.execution_id)
    if code not in (None, 0) and not rec.calls:
        return _failed(rec, f"the agent exited with status {code} before any model call: {_tail(log_path)}")
    rec.status = status
    rec.compactions = closed.summary_contexts()
    rec.t_end = time.time()
    return rec


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the agent's process group (its leader may have exited and left children running); SIGKILL the
    group once the leader is gone or after 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:      # nobody left in the group
        proc.wait()
        return
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log_path: Path, n: int = 800) -> str:
    try:
        return log_path.read_bytes()[-n:].decode(errors="replace").strip() or "(no output)"
    except OSError:
        return "(no output)"


def _failed(rec: ExecutionRecord, why: str) -> ExecutionRecord:
    rec.status, rec.error, rec.t_end = STATUS_FAILED, why[:2000], time.time()
    return rec
