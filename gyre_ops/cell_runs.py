"""Cell agents as Prefect flow runs: what `elastic.launch=prefect` does.

    gyre up --devices cpu --devices cpu        # (or 0,1 / 2,3 on a GPU host): one cell worker per device set
    gyre train --preset smoke --set elastic.enabled=true --set elastic.launch=prefect   # or from the UI

The coordinator (inside the `elastic-rl` task) creates one flow run of the `cell-agent` deployment per
cell, on queue `rollout` of the work pool (every cell starts rolling out), as a subflow of that task.
A cell worker picks it up (`gyre worker --queue rollout --queue train --devices 0,1 --limit 1`: one cell
per device set, with that set as CUDA_VISIBLE_DEVICES), and the flow run *is* the cell's long-lived agent
process: it runs the same plain agent command (`gyre_core.elastic.agent`) and dials back to the
coordinator at `elastic.coordinator_host`. The connection key travels in a Prefect Secret block
(`gyre-cell-key-<run id>`, deleted when the run ends), never in the parameters the UI shows.

Each cell's flow run is named like the cell (`<run id>-c<i>`) and tagged `gyre-cell`, `gyre-run:<run id>`
and `role:<role>`; `gyre_ops.cells.RoleRecorder` changes that last tag on every switch and relates each
`gyre.cell.*` event to the flow run, so the flow run's tags say the cell's role now and the events are
its retag history. A running flow run cannot change queues; the queue limits count the roles instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from prefect.client.schemas.objects import StateType

from .cells import ROLE_TAG, cell_prefix, cell_run_name
from .pools import PoolError, _client, _reachable, check_pool

DEPLOYMENT = "gyre-cell-agent/cell-agent"
QUEUE = "rollout"                    # where every cell starts (the coordinator starts them all rolling out)
_FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


def check_launch(cells: int, pool: str = "gyre", client: Any = None) -> None:
    """Refuse, before anything starts, a Prefect launch that cannot work: the `cell-agent` deployment,
    the pool and its `rollout` / `train` queues must exist, and `rollout` must have room for every cell.
    Raises `PoolError` with one line saying what to do."""
    from prefect.exceptions import ObjectNotFound

    with _client(client) as c, _reachable(c):
        url = str(getattr(getattr(c, "_client", None), "base_url", "")).rstrip("/")
        problem = check_pool(c, pool, (QUEUE, "train"))
        if problem:
            raise PoolError(f"elastic.launch=prefect: {problem}")
        try:
            c.read_deployment_by_name(DEPLOYMENT)
        except ObjectNotFound:
            raise PoolError(f"elastic.launch=prefect: the deployment {DEPLOYMENT!r} does not exist on {url}; "
                            f"`gyre up` deploys it (or `prefect deploy --name cell-agent` from the project "
                            f"root), or set elastic.launch=process") from None
        limit = c.read_work_queue_by_name(QUEUE, work_pool_name=pool).concurrency_limit
    if limit is not None and limit < cells:
        raise PoolError(f"elastic.launch=prefect: queue {QUEUE!r} of pool {pool!r} admits {limit} cell(s) at once "
                        f"but elastic.cells is {cells}; raise its concurrency_limit (infra/pools.yaml) "
                        f"or use fewer cells")


class CellRun:
    """One cell's flow run, as the coordinator's handle on it (poll / kill / wait, like a process)."""

    def __init__(self, flow_run_id, name: str, client_factory):
        self.id, self.name, self._client = flow_run_id, name, client_factory
        self.state = None
        self._read_t = 0.0

    def _refresh(self, every_s: float = 1.0):
        if self.state is None or (self.state.type not in _FINAL and time.monotonic() - self._read_t >= every_s):
            with self._client() as c:
                self.state = c.read_flow_run(self.id).state
            self._read_t = time.monotonic()
        return self.state

    def poll(self) -> int | None:
        state = self._refresh()
        if state is None or state.type not in _FINAL:
            return None
        return 0 if state.type == StateType.COMPLETED else 1

    def kill(self) -> None:
        """Cancel the flow run: its worker stops the agent's process."""
        from prefect.states import Cancelling

        with self._client() as c:
            c.set_flow_run_state(self.id, Cancelling(message="gyre elastic: the coordinator stopped this cell"),
                                 force=True)

    def wait(self, timeout: float | None = None) -> int:
        t0 = time.monotonic()
        while (rc := self.poll()) is None:
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.5)
        return rc

    def describe(self) -> str:
        s = self._refresh(0.0)
        what = s.name if s is not None else "unknown"
        msg = f": {s.message}" if s is not None and s.message else ""
        return f"flow run {self.name!r} ({self.id}) is {what}{msg}"


class PrefectCellLauncher:
    """Starts each cell agent as a flow run of the `cell-agent` deployment (see the module's docstring).
    `flow_runs` maps cell index -> flow-run id as they are created (the `RoleRecorder` retags them)."""

    name = "prefect"

    def __init__(self, run_id: str, cells: int, pool: str = "gyre", say=None):
        check_launch(cells, pool)
        self.run_id, self.pool = run_id, pool
        self.say = say or (lambda m: print(m, file=sys.stderr))
        self.key_block = f"gyre-cell-key-{cell_prefix(run_id).replace('_', '-')}"   # block names: a-z 0-9 -
        self.flow_runs: dict[int, Any] = {}
        self._key_saved = False

    @staticmethod
    def _client_factory():
        from .pools import connect

        return connect()

    def launch(self, cell: int, args: list[str], env: dict[str, str]) -> CellRun:
        from prefect.blocks.system import Secret
        from prefect.deployments import run_deployment

        if not self._key_saved:
            Secret(value=env["GYRE_CELL_KEY"]).save(self.key_block, overwrite=True)
            self._key_saved = True
        name = cell_run_name(self.run_id, cell)
        fr = run_deployment(DEPLOYMENT, parameters={"args": args, "key_block": self.key_block},
                            flow_run_name=name, timeout=0, work_queue_name=QUEUE, as_subflow=True,
                            tags=["gyre", "gyre-cell", f"gyre-run:{self.run_id}", f"{ROLE_TAG}rollout"])
        self.flow_runs[cell] = fr.id
        self.say(f"gyre elastic: cell {cell} is flow run {name!r} on queue {QUEUE!r} of pool {self.pool!r}")
        return CellRun(fr.id, name, self._client_factory)

    def describe(self, cell: int, handle: CellRun) -> str:
        return f"cell {cell}: {handle.describe()}"

    def waiting(self, pending: dict[int, CellRun]) -> str:
        """Why cells have not connected, from their flow runs' states."""
        queued = [h.name for h in pending.values() if (s := h._refresh(0.0)) is not None
                  and s.type in (StateType.SCHEDULED, StateType.PENDING)]
        running = [h.name for h in pending.values() if h.state is not None and h.state.type == StateType.RUNNING]
        out = ""
        if queued:
            out += (f"; not picked up: {', '.join(queued)} — no cell worker with room polls queue {QUEUE!r} of "
                    f"pool {self.pool!r} (start one per cell: `gyre up --devices ...` or `gyre worker --queue "
                    f"rollout --queue train --devices ... --limit 1`)")
        if running:
            out += (f"; running but never connected: {', '.join(running)} — can the cell hosts reach "
                    f"elastic.coordinator_host?")
        return out

    def close(self) -> None:
        """Delete the key's Secret block (the run is over; nothing may dial in with it any more)."""
        if self._key_saved:
            from prefect.blocks.system import Secret

            try:
                Secret.delete(self.key_block)
            except Exception as exc:  # noqa: BLE001 - the run's result matters more than the cleanup
                self.say(f"gyre elastic: could not delete Secret block {self.key_block!r}: {exc}")
            self._key_saved = False


def serve_cell(args: list[str], key: str) -> int:
    """Run the cell agent in this process (the `cell-agent` flow run's body): the plain agent command
    with its key in the environment; raises when the agent exits non-zero, so the flow run fails."""
    from gyre_core.elastic import agent

    os.environ["GYRE_CELL_KEY"] = key
    rc = agent.main(list(args))
    if rc != 0:
        raise RuntimeError(f"the cell agent exited with status {rc}")
    return rc
