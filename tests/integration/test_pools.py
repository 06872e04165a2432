"""Work pools, queues and workers against a real Prefect server (`prefect server start` on 127.0.0.1, SQLite
in a temp PREFECT_HOME), plus the deployment files of infra/ checked as data.

What is checked through the server, read back with a Prefect client:
- `ensure_pools` creates exactly the spec's pool and queues with their limits, is idempotent, and repairs
  a limit someone changed;
- `check_pool` and `gyre worker` name a missing pool or queue (exit 2) and create nothing;
- `infra/worker-gpu.sh` starts one worker per device set (each registered under a name that says its
  queues and devices, with CUDA_VISIBLE_DEVICES set) and `infra/worker-gpu-stop.sh` stops them with SIGTERM;
- `move_cell` moves one unit of concurrency limit between queues, records the cell's queue, and its
  events are the retag history.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gyre_core.ports import free_port
from gyre_ops.pools import (PoolError, PoolSpec, QueueSpec, SpecError, check_pool, ensure_pools, load_spec,
                            parse_spec)

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def _wait(predicate, what: str, guard_s: float = 180.0, every_s: float = 0.3):
    """Poll until `predicate()` is truthy (the guard only stops a hung test; it is not a timing check)."""
    end = time.monotonic() + guard_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server process of our own on 127.0.0.1; yields its API URL."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_UI_ENABLED="false", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
               PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL="0.5")
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api"
    import httpx

    def healthy():
        assert proc.poll() is None, (home / "server.log").read_text()[-2000:]
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(healthy, "the Prefect server to answer")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gyre_ops.pools import connect

    with temporary_settings(updates={PREFECT_API_URL: server}), connect() as c:
        yield c


def _spec(pool: str) -> list[PoolSpec]:
    """The project's spec (infra/pools.yaml) under another pool name, so each test has its own pool."""
    return [dataclasses.replace(load_spec()[0], name=pool)]


def _queues(client, pool: str) -> dict:
    return {q.name: q for q in client.read_work_queues(work_pool_name=pool)}


# -- the spec, without a server ---------------------------------------------------------------------------
def test_spec_file_and_bad_specs_name_the_field():
    (pool,) = load_spec()
    assert pool.name == "gyre" and pool.type == "process"
    assert [q.name for q in pool.queues] == ["default", "rollout", "train", "cpu"]
    assert all(q.concurrency_limit is not None for q in pool.queues)
    good = {"pools": [{"name": "p", "queues": [{"name": "default"}, {"name": "rollout", "concurrency_limit": 2}]}]}
    assert parse_spec(good)[0].queues[1] == QueueSpec("rollout", "", 2)
    bad = {"pools": [{"name": "p", "queues": [{"name": "default"}, {"name": "r", "concurrency_limit": -1}]}]}
    with pytest.raises(SpecError, match=r"pools\[0\]\.queues\[1\]\.concurrency_limit"):
        parse_spec(bad)
    with pytest.raises(SpecError, match="listed twice"):
        parse_spec({"pools": [{"name": "p", "queues": [{"name": "default"}, {"name": "default"}]}]})
    with pytest.raises(SpecError, match="'default'"):
        parse_spec({"pools": [{"name": "p", "queues": [{"name": "rollout"}]}]})


# -- ensure / check ---------------------------------------------------------------------------------------
def test_ensure_pools_creates_exactly_the_spec_and_is_idempotent(client):
    spec = _spec("gyre-ensure")
    first = ensure_pools(client, spec)
    assert ("created", "pool gyre-ensure") in first
    # `default` comes with every pool, so it is updated rather than created
    assert {a for a, what in first if what.startswith("queue")} <= {"created", "updated"}
    pool = client.read_work_pool("gyre-ensure")
    assert pool.type == "process" and pool.base_job_template.get("job_configuration")
    assert pool.description == spec[0].description and pool.concurrency_limit is None
    have = _queues(client, "gyre-ensure")
    assert set(have) == {"default", "rollout", "train", "cpu"}
    for priority, q in enumerate(spec[0].queues, start=1):
        assert have[q.name].concurrency_limit == q.concurrency_limit, q.name
        assert have[q.name].description == q.description and have[q.name].priority == priority

    assert all(action == "unchanged" for action, _ in ensure_pools(client, spec))     # idempotent
    assert all(action == "unchanged" for action, _ in ensure_pools(spec))             # gyre up's form
    assert set(_queues(client, "gyre-ensure")) == set(have)

    client.update_work_queue(have["rollout"].id, concurrency_limit=99)                  # drift is repaired
    assert ("updated", "queue gyre-ensure/rollout") in ensure_pools(client, spec)
    assert _queues(client, "gyre-ensure")["rollout"].concurrency_limit == spec[0].queues[1].concurrency_limit


def test_check_pool_names_what_is_missing_and_creates_nothing(client):
    from prefect.exceptions import ObjectNotFound

    ensure_pools(client, _spec("gyre-check"))
    assert check_pool(client, "gyre-check", ["rollout", "train"]) is None
    msg = check_pool(client, "gyre-check", ["rollout", "no-such-queue"])
    assert "'no-such-queue'" in msg and "'gyre-check'" in msg and "\n" not in msg
    msg = check_pool(client, "no-such-pool", "rollout")
    assert "'no-such-pool'" in msg and "\n" not in msg
    with pytest.raises(ObjectNotFound):
        client.read_work_pool("no-such-pool")
    assert "no-such-queue" not in _queues(client, "gyre-check")


# -- gyre worker ------------------------------------------------------------------------------------------
def test_gyre_worker_refuses_missing_pool_or_queue(client, capsys):
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gyre_cli.main import main

    ensure_pools(client, _spec("gyre-worker"))
    assert main(["worker", "--pool", "absent-pool", "--queue", "rollout", "--devices", "0,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'absent-pool'" in err and len(err.splitlines()) == 1
    assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout", "--queue", "absent-queue"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'absent-queue'" in err and len(err.splitlines()) == 1
    with pytest.raises(ObjectNotFound):                   # and nothing was created on the way
        client.read_work_pool("absent-pool")
    assert "absent-queue" not in _queues(client, "gyre-worker")

    assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout", "--devices", "0,zero"]) == 2
    assert "'zero'" in capsys.readouterr().err

    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout"]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot reach the Prefect API" in err and len(err.splitlines()) == 1

    with temporary_settings(restore_defaults={PREFECT_API_URL}):       # never a temporary server instead
        assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout"]) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err

    assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout", "--queue", "train",
                 "--devices", "2,3", "--name", "h", "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=2,3" in line and "--work-queue rollout --work-queue train" in line
    assert "--no-create-pool-if-not-found" in line and "--name h:rollout+train:cuda2,3" in line
    assert line.split()[-2:] == ["--limit", "1"]                 # a cell worker serves one cell at a time
    assert main(["worker", "--pool", "gyre-worker", "--queue", "default", "--dry-run"]) == 0
    assert "--limit" not in capsys.readouterr().out              # flow runs: Prefect's default, no limit
    assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout", "--limit", "3", "--dry-run"]) == 0
    assert capsys.readouterr().out.split()[-2:] == ["--limit", "3"]
    assert main(["worker", "--pool", "gyre-worker", "--queue", "rollout", "--limit", "0", "--dry-run"]) == 2
    assert "--limit 0" in capsys.readouterr().err


def test_worker_scripts_start_one_worker_per_device_set_and_stop_them(client, server, tmp_path):
    """infra/worker-gpu.sh starts its workers as background jobs of a non-interactive shell (SIGINT
    ignored): `gyre worker` must still leave them stoppable by SIGTERM."""
    for script in ("worker-gpu.sh", "worker-gpu-stop.sh"):
        assert subprocess.run(["bash", "-n", str(INFRA / script)]).returncode == 0, script
    ensure_pools(client, _spec("gyre-gpu"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(GYRE_HOME=str(ROOT), GYRE_PYTHON=sys.executable, GYRE_LOG_DIR=str(tmp_path / "workers"),
               GYRE_WORKER_PREFIX="host1", PREFECT_HOME=str(tmp_path / "prefect-home"),
               GYRE_ENV_FILE=str(tmp_path / "none.env"))

    bad = subprocess.run([str(INFRA / "worker-gpu.sh"), server, "gyre-gpu", "rollout,missing-q", "0,1"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "'missing-q'" in bad.stderr
    assert not list((tmp_path / "workers").glob("*.pid"))          # nothing was started

    up = subprocess.run([str(INFRA / "worker-gpu.sh"), server, "gyre-gpu", "rollout,train", "0,1", "2,3"],
                        env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    pids = {p.stem: int(p.read_text()) for p in (tmp_path / "workers").glob("worker-*.pid")}
    assert set(pids) == {"worker-0-1", "worker-2-3"}
    try:
        names = {"host1:rollout+train:cuda0,1", "host1:rollout+train:cuda2,3"}
        _wait(lambda: names <= {w.name for w in client.read_workers_for_work_pool("gyre-gpu")
                                if w.status.value == "ONLINE"}, "both workers to be online")
        for tag, devices in (("worker-0-1", "0,1"), ("worker-2-3", "2,3")):
            pid = pids[tag]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"worker" in cmdline and b"start" in cmdline        # the pid is the Prefect worker (exec)
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            environ = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
            assert environ[b"CUDA_VISIBLE_DEVICES"] == devices.encode()
            assert environ[b"PREFECT_API_URL"] == server.encode()
    finally:
        stop = subprocess.run([str(INFRA / "worker-gpu-stop.sh")], env={**env, "GYRE_STOP_GRACE": "60"},
                              capture_output=True, text=True)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "forcing" not in stop.stdout                                 # the first SIGTERM was enough
    assert not any(Path(f"/proc/{p}").exists() for p in pids.values())


# -- moving cells -----------------------------------------------------------------------------------------
def test_move_cell_moves_limits_and_records_the_retag_history(client):
    from gyre_ops.cells import current_queue, move_cell, place_cell, retag_history, variable_name

    pool = "gyre-cells"
    spec = _spec(pool)
    ensure_pools(client, spec)
    start = {q.name: q.concurrency_limit for q in spec[0].queues}

    placed = place_cell(client, 7, "rollout", pool=pool, devices="6,7")
    assert placed.from_queue is None and current_queue(client, 7) == "rollout"
    moved = move_cell(client, 7, "train", pool=pool, reason={"unfinished": 3, "train_after": 1})
    assert (moved.from_queue, moved.to_queue) == ("rollout", "train")
    have = _queues(client, pool)
    assert have["rollout"].concurrency_limit == start["rollout"] - 1
    assert have["train"].concurrency_limit == start["train"] + 1
    assert moved.limits == {"rollout": start["rollout"] - 1, "train": start["train"] + 1}
    var = client.read_variable_by_name(variable_name(7))
    assert var.value["queue"] == "train" and var.value["devices"] == "6,7" and "queue-train" in var.tags

    assert move_cell(client, 7, "train", pool=pool) is None            # already there: nothing changes
    with pytest.raises(PoolError, match="'nowhere'"):
        move_cell(client, 7, "nowhere", pool=pool)
    with pytest.raises(ValueError, match="no recorded queue"):
        move_cell(client, 8, "train", pool=pool)
    assert _queues(client, pool)["train"].concurrency_limit == start["train"] + 1

    back = move_cell(client, 7, "rollout", pool=pool)
    assert back.limits == {"rollout": start["rollout"], "train": start["train"]}
    assert current_queue(client, 7) == "rollout"

    history = _wait(lambda: h if len(h := retag_history(client, 7)) >= 3 else None, "three events stored")
    assert [(h["event"], h["from_queue"], h["to_queue"]) for h in history] == [
        ("gyre.cell.placed", None, "rollout"),
        ("gyre.cell.retagged", "rollout", "train"),
        ("gyre.cell.retagged", "train", "rollout")]
    assert history[1]["reason"] == {"unfinished": 3, "train_after": 1}
    assert history[1]["limits"] == moved.limits and history[2]["limits"] == back.limits
    assert retag_history(client, 8) == []


def test_an_elastic_run_records_each_cells_roles_as_queue_moves(client):
    """The controller's role switches, through `RoleRecorder`, become exactly the placements and retags the
    coordinator reports (its own switch marks are the reference), and the limits end where they started."""
    from gyre_core.config import ElasticConfig
    from gyre_core.elastic.runtime import run_elastic
    from gyre_core.elastic.workload import Workload
    from gyre_ops.cells import RoleRecorder, retag_history

    pool = "gyre-elastic"
    spec = _spec(pool)
    ensure_pools(client, spec)
    start = {q.name: q.concurrency_limit for q in spec[0].queues}
    work = Workload(name="t", executions_per_step=12, steps=3, calls_median=6, calls_sigma=0.6, max_calls=14,
                    call_s=0.02, env_s=0.01, train_s_per_call=0.002, optimizer_s=0.01, publish_s=0.01,
                    switch_to_train_s=0.01, switch_to_rollout_s=0.01, seed=3)
    recorder, heard = RoleRecorder("Run.E1", pool=pool, client=client), []

    def on_role(cell, role, reason):
        heard.append((cell, role, reason))
        recorder(cell, role, reason)

    cfg = ElasticConfig(policy="elastic", cells=3, mode="emulated", capacity=3, micro_step_executions=2)
    res = run_elastic(cfg, work, on_role=on_role)
    recorder.close()
    assert recorder.errors == [] and res.switch_marks, "the controller never moved a cell"
    for i in range(cfg.cells):
        roles = [role for c, role, _ in heard if c == i]
        # placed once, then one report per switch the coordinator marked for this cell and the cell finished
        # (a mark is made when a switch starts: one still under way when the last version landed never arrived)
        marked = [to for c, _, _, to in res.switch_marks if c == i]
        last_span = max((s for s in res.role_spans if s.cell == i), key=lambda s: s.t1)
        if last_span.role == "switching":
            marked = marked[:-1]
        assert roles[1:] == marked
        expected, cur = [("gyre.cell.placed", None, roles[0])], roles[0]
        for role in roles[1:] + [roles[0]]:              # ... and home again when the run ends
            if role != cur:
                expected.append(("gyre.cell.retagged", cur, role))
                cur = role
        history = _wait(lambda: h if len(h := retag_history(client, f"run-e1-c{i}")) >= len(expected) else None,
                        f"cell {i}'s events stored")
        assert [(h["event"], h["from_queue"], h["to_queue"]) for h in history] == expected
    moves = [r for c, _, r in heard if not r.get("placed")]
    assert all("train_after" in r and r["switch_s"] >= 0 for r in moves)   # the decision rides along
    assert {q: _queues(client, pool)[q].concurrency_limit for q in start} == start

    assert all(h["flow_run"] is None for i in range(cfg.cells) for h in retag_history(client, f"run-e1-c{i}"))
    quiet = []
    off = RoleRecorder("x", pool="no-such-pool", client=client, say=quiet.append)
    off(0, "rollout", {"placed": True})
    assert off.close() == [] and len(quiet) == 1 and "'no-such-pool'" in quiet[0]


def test_a_prefect_cell_launch_that_cannot_work_is_refused_with_what_to_do(client):
    """elastic.launch=prefect checks the pool, its cell queues and the `cell-agent` deployment before anything
    starts (the limit check needs the deployment: tests/integration/test_stack.py refuses 5 cells there)."""
    from gyre_ops.cell_runs import check_launch

    with pytest.raises(PoolError, match="work pool 'no-pool' does not exist"):
        check_launch(2, "no-pool", client=client)
    ensure_pools(client, _spec("gyre-launch"))
    with pytest.raises(PoolError, match="'gyre-cell-agent/cell-agent' does not exist.*elastic.launch=process"):
        check_launch(2, "gyre-launch", client=client)


def test_cell_names_and_role_tags():
    from gyre_ops.cells import cell_run_name, role_tags

    assert cell_run_name("Smoke-s0", 3) == "smoke-s0-c3" and cell_run_name("a.b/c", 0) == "a-b-c-c0"
    assert role_tags(["gyre", "role:rollout", "x"], "train") == ["gyre", "x", "role:train"]
    assert role_tags([], "rollout") == ["role:rollout"]


# -- the compose file, as data ----------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _defaults(text: str) -> str:
    """Substitute `${VAR:-default}` with its default (and `${VAR}` / `${VAR:?msg}` with a marker)."""
    return _VAR.sub(lambda m: m.group(3) if m.group(2) in (":-", "-") else f"<{m.group(1)}>", text)


def test_compose_file_services_healthchecks_ports_and_documented_variables():
    text = (INFRA / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    services = compose["services"]
    assert {"postgres", "prefect-server", "mlflow", "minio", "s3-init"} <= set(services)
    for name, svc in services.items():
        if svc.get("restart") == "no":
            continue                                        # a one-shot job: others wait for it to complete
        assert "test" in svc.get("healthcheck", {}), f"{name} has no healthcheck"

    prefect = services["prefect-server"]["environment"]
    assert prefect["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in prefect["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert prefect["PREFECT_SERVER_API_HOST"] == "0.0.0.0"
    mlflow = " ".join(services["mlflow"]["command"])
    assert "--artifacts-destination=s3://mlflow/" in mlflow and "--backend-store-uri=postgresql://" in mlflow
    assert services["mlflow"]["depends_on"]["s3-init"]["condition"] == "service_completed_successfully"

    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            assert src.startswith(".") or src in declared, f"{name}: volume {src} is not a named volume"
        for port in svc.get("ports", []):
            parts = _defaults(str(port)).split(":")
            assert len(parts) == 3, f"{name}: port {port} is published without a host address"
            assert parts[0] == "127.0.0.1", f"{name}: port {port} binds {parts[0]} by default"
    assert "0.0.0.0:" not in _defaults(text)

    variables = {m.group(1) for m in _VAR.finditer(text)}
    assert {"GYRE_BIND_ADDRESS", "GYRE_PG_PASSWORD", "GYRE_S3_ACCESS_KEY"} <= variables
    readme, example = (ROOT / "docs" / "operations.md").read_text(), (INFRA / "env.example").read_text()
    for var in sorted(variables):
        assert f"`{var}`" in readme, f"{var} is not documented in docs/operations.md"
        assert re.search(rf"^{var}=", example, re.M), f"{var} is missing from infra/env.example"
