"""External agent harnesses: any agent program, run once per execution, talking to the policy through the
recording proxy.

    records = run_external(cfg, chat, stop_texts, engine, temperature, specs, make_env, on_finish=tick)

For each execution: the environment is reset to its seed and sets up an empty workspace
(`setup_workspace`); `harness.command` runs there as a subprocess with

    OPENAI_BASE_URL        the proxy (http://127.0.0.1:<port>/v1)
    OPENAI_API_KEY         this execution's key: every call made with it is recorded under this execution
    GYRE_SUBAGENT_API_KEY  the same execution, role `sub-agent` (or send `X-Gyre-Role: sub-agent`)
    GYRE_MODEL             the model name the proxy serves
    GYRE_TASK              the task text;  GYRE_WORKSPACE  the workspace (also its working directory)

and the execution ends when the process exits or hits a limit: wall clock (`harness.wall_clock_s`), model
calls (`harness.max_turns`) or tokens (`harness.max_execution_tokens`) — the proxy refuses the call that
would exceed one, and the process group is then stopped. The environment's `score_workspace` scores what
it left; an evaluator that raises is retried (`harness.score_retries`), then the execution is excluded
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

from ..envs.protocol import supports
from ..records import STATUS_DONE, STATUS_FAILED, STATUS_TIMEOUT, ExecutionRecord

POLL_S = 0.02


def resolve_command(command: list[str]) -> list[str]:
    """The argv to run in a workspace: `python` is Gyre's interpreter; a relative path that exists here, or in
    Gyre's project directory (`examples/...`), made absolute."""
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


def run_external(cfg, chat, stop_texts: dict[int, str], engine, temperature: float, specs, make_env,
                 on_finish=None, model_name: str = "gyre-policy") -> list[ExecutionRecord]:
    """Run `specs` with the external harness `cfg.harness.command`, `cfg.rollout.concurrency` at once, through a
    proxy on `engine` sampling at `temperature`; the records in the order of `specs`."""
    from ..proxy import open_proxy

    command = resolve_command(cfg.harness.command)
    with open_proxy(cfg, chat, stop_texts, [engine], temperature, model_name) as (proxy, server):
        def one(spec) -> ExecutionRecord:
            rec = run_one(cfg, proxy, server.base_url, command, spec, make_env())
            if on_finish:
                on_finish(rec)
            return rec

        with ThreadPoolExecutor(max_workers=min(cfg.rollout.concurrency, len(specs)) or 1,
                                thread_name_prefix="gyre-agent") as pool:
            return list(pool.map(one, specs))


def run_one(cfg, proxy, base_url: str, command: list[str], spec, env) -> ExecutionRecord:
    """One execution of the external harness (see the module's text)."""
    h = cfg.harness
    rec = ExecutionRecord(run_id=spec.run_id, step=spec.step, execution_id=spec.execution_id, task_id=spec.task_id,
                          seed=spec.seed, split=spec.split, env=getattr(env, "name", type(env).__name__),
                          policy_version=spec.policy_version, t_start=time.time())
    workspace = Path(tempfile.mkdtemp(prefix="gyre-ws-"))
    try:
        if not supports(env, "setup_workspace"):
            raise TypeError(f"environment {rec.env!r} has no setup_workspace/score_workspace hooks, which an "
                            "external harness (harness.command) needs")
        env.reset(spec.seed)
        task = env.setup_workspace(str(workspace))
    except Exception as exc:  # noqa: BLE001 - an environment that cannot even start
        return _failed(rec, f"{type(exc).__name__}: {exc}", workspace)
    keys = proxy.open_execution(rec)
    log_path = workspace.parent / f"{workspace.name}.log"
    child_env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": keys.main,
                 "GYRE_SUBAGENT_API_KEY": keys.sub_agent, "GYRE_MODEL": proxy.model_name, "GYRE_TASK": str(task),
                 "GYRE_WORKSPACE": str(workspace)}
    status, code = STATUS_DONE, None
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(command, cwd=workspace, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            proxy.close_execution(rec.execution_id)
            return _failed(rec, f"cannot start {command[0]!r}: {exc}", workspace, log_path)
        exe = proxy.execution(rec.execution_id)
        while (code := proc.poll()) is None:
            if exe.limit_status is not None:
                status = exe.limit_status
                break
            if h.wall_clock_s is not None and time.time() - rec.t_start > h.wall_clock_s:
                status = STATUS_TIMEOUT
                break
            time.sleep(POLL_S)
        if code is None:
            _stop_group(proc)
    closed = proxy.close_execution(rec.execution_id)
    if code not in (None, 0) and not rec.calls:
        return _failed(rec, f"the agent exited with status {code} before any model call: {_tail(log_path)}",
                       workspace, log_path)
    rec.status = status
    rec.compactions = closed.summary_contexts()
    attempts = h.score_retries + 1
    for _ in range(attempts):
        try:
            score = env.score_workspace(str(workspace))
            break
        except Exception as exc:  # noqa: BLE001 - an evaluator failure is not a zero
            last = exc
    else:
        return _failed(rec, f"score failed after {attempts} attempts: {type(last).__name__}: {last}", workspace,
                       log_path)
    if score is not None:
        rec.success, rec.partial = bool(score.success), float(score.partial)
    _cleanup(workspace, log_path)
    rec.t_end = time.time()
    return rec


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the agent's process group, SIGKILL it if still there after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log_path: Path, n: int = 800) -> str:
    try:
        return log_path.read_bytes()[-n:].decode(errors="replace").strip() or "(no output)"
    except OSError:
        return "(no output)"


def _failed(rec: ExecutionRecord, why: str, workspace: Path, log_path: Path | None = None) -> ExecutionRecord:
    rec.status, rec.error, rec.t_end = STATUS_FAILED, why[:2000], time.time()
    _cleanup(workspace, log_path)
    return rec


def _cleanup(workspace: Path, log_path: Path | None) -> None:
    shutil.rmtree(workspace, ignore_errors=True)
    if log_path is not None:
        log_path.unlink(missing_ok=True)
