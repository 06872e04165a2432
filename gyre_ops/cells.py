"""A cell's queue in Prefect: placement, role moves (retags) and their history.

    from gyre_ops.cells import place_cell, move_cell, retag_history
    place_cell(client, 3, "rollout", devices="6,7")          # the cell agent came up (no limit change)
    move_cell(client, 3, "train", reason={"waterlevel": 12})  # the controller moved it: rollout -1, train +1
    retag_history(client, 3)                                  # [{occurred, event, from_queue, to_queue, ...}]

A running Prefect worker cannot change its queues, and the role switch itself happens inside the cell
agent (at the router, in well under a second), so the cell keeps its worker and its flow run. What moves
in Prefect is *capacity*: `rollout` and `train` carry concurrency limits that count the cells in each
role (`infra/pools.yaml`), and a move takes one unit from the old queue and gives it to the new one
(source first, so the two limits never add up to more cells than exist). Each cell's GPU worker polls
both queues (`gyre worker --queue rollout --queue train --devices 0,1`), so new cell work lands where
the controller wants capacity.

What Prefect shows:
- an event per placement and per move, on the resource `gyre.cell.<name>` (`gyre.cell.placed`,
  `gyre.cell.retagged`), related to the work pool and the from/to queues, with the new limits in its
  payload: the Events page (filter `gyre.cell.*`) is the retag history; `retag_history` reads it back;
- a variable `gyre-cell-<name>` holding the cell's current queue (and devices), tagged
  `gyre`, `gyre-cell`, `queue-<queue>`: the Variables page shows where every cell is now;
- the queues' limits on the work pool page.

Names: a cell is an int or a lowercase name of letters, digits, `-` and `_`. Moves are read-modify-write
of the limits: one controller moves cells at a time (the elastic controller is one process).
An elastic run records its cells through `RoleRecorder` (the `elastic-rl` task passes one to the
controller): each cell is placed when its agent comes up, moved on every finished role switch with the
controller's decision as the reason, and moved back to where it started when the run ends, so the queue
limits are the spec's again between runs.
"""
from __future__ import annotations

import queue as _queue_mod
import re
import sys
import threading
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .pools import PoolError, _client, _reachable

PLACED = "gyre.cell.placed"
RETAGGED = "gyre.cell.retagged"
ROLE_TAG = "role:"                  # a cell's flow run (elastic.launch=prefect) carries role:<its role now>
_CELL = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(slots=True)
class Retag:
    """One placement or move, as recorded."""

    cell: str
    pool: str
    from_queue: str | None
    to_queue: str
    limits: dict[str, int | None] = field(default_factory=dict)   # queue -> its limit after the move
    event: str = RETAGGED
    event_id: str | None = None
    occurred: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def cell_name(cell: int | str) -> str:
    name = str(cell).strip().lower()
    if not _CELL.match(name) or len(name) > 200:
        raise ValueError(f"cell name {cell!r}: use an integer or lowercase letters, digits, '-' and '_'")
    return name


def cell_prefix(run_id: str) -> str:
    """A run id as the start of cell names (lowercase letters, digits, '-' and '_')."""
    return re.sub(r"[^a-z0-9_-]+", "-", run_id.lower()).strip("-_") or "cell"


def cell_run_name(run_id: str, cell: int) -> str:
    """The name of cell `cell` of run `run_id` everywhere in Prefect: its variable (`gyre-cell-<name>`),
    its event resource (`gyre.cell.<name>`) and, when it is launched through Prefect, its flow run."""
    return cell_name(f"{cell_prefix(run_id)}-c{cell}")


def role_tags(tags: list[str], role: str) -> list[str]:
    """`tags` with its `role:` tag replaced by `role:<role>`."""
    return [t for t in tags if not t.startswith(ROLE_TAG)] + [f"{ROLE_TAG}{role}"]


def resource_id(cell: int | str) -> str:
    return f"gyre.cell.{cell_name(cell)}"


def variable_name(cell: int | str) -> str:
    return f"gyre-cell-{cell_name(cell)}"


def current_queue(client: Any, cell: int | str) -> str | None:
    """The queue the cell was last placed on or moved to (None: never recorded)."""
    value = _read_state(client, cell)
    return value.get("queue") if value else None


def _read_state(client: Any, cell: int | str) -> dict | None:
    with _client(client) as c, _reachable(c):
        var = c.read_variable_by_name(variable_name(cell))
    return var.value if var is not None and isinstance(var.value, dict) else None


def _write_state(c: Any, cell: str, value: dict) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = variable_name(cell)
    tags = ["gyre", "gyre-cell", f"queue-{value['queue']}"]
    if c.read_variable_by_name(name) is None:
        c.create_variable(VariableCreate(name=name, value=value, tags=tags))
    else:
        c.update_variable(VariableUpdate(name=name, value=value, tags=tags))


def _queue(c: Any, pool: str, queue: str):
    from prefect.exceptions import ObjectNotFound

    try:
        return c.read_work_queue_by_name(queue, work_pool_name=pool)
    except ObjectNotFound:
        raise PoolError(f"work queue {queue!r} does not exist in work pool {pool!r}") from None


def _queue_resource(q: Any, role: str) -> dict[str, str]:
    return {"prefect.resource.id": f"prefect.work-queue.{q.id}", "prefect.resource.role": role,
            "prefect.resource.name": q.name}


def _retag_flow_run(c: Any, flow_run_id: Any, role: str) -> list[dict[str, str]]:
    """Set the cell's flow run's `role:` tag (elastic.launch=prefect); the event's related resource."""
    if flow_run_id is None:
        return []
    fr = c.read_flow_run(flow_run_id)
    c.update_flow_run(fr.id, tags=role_tags(list(fr.tags or []), role))
    return [{"prefect.resource.id": f"prefect.flow-run.{fr.id}", "prefect.resource.role": "flow-run",
             "prefect.resource.name": fr.name}]


def _emit(c: Any, event: str, cell: str, pool_obj: Any, related: list[dict[str, str]], payload: dict):
    """Send one event to the server `c` talks to and wait until the server has taken it (a checkpoint
    after the event), so the history is complete when the call returns."""
    from prefect.events.clients import PrefectEventsClient
    from prefect.events.schemas.events import Event
    from prefect.utilities.asyncutils import run_coro_as_sync

    ev = Event(
        event=event,
        resource={"prefect.resource.id": resource_id(cell), "prefect.resource.name": f"cell {cell}",
                  "gyre.pool": pool_obj.name, "gyre.queue": payload["to_queue"]},
        related=[{"prefect.resource.id": f"prefect.work-pool.{pool_obj.id}", "prefect.resource.role": "work-pool",
                  "prefect.resource.name": pool_obj.name}, *related],
        payload=payload)

    async def send() -> None:
        async with PrefectEventsClient(api_url=str(c.api_url), checkpoint_every=1) as events:
            await events.emit(ev)

    run_coro_as_sync(send())
    return ev


def place_cell(client: Any, cell: int | str, queue: str, *, pool: str = "gyre", devices: str | None = None,
               worker: str | None = None, flow_run_id: Any = None) -> Retag:
    """Record where a cell starts (its agent came up on `queue`): the variable and a `gyre.cell.placed`
    event. Limits are not changed: the spec's limits already count the fleet's starting roles.
    `flow_run_id`: the cell's own flow run (it gets the tag `role:<queue>`; the event is related to it)."""
    cell = cell_name(cell)
    with _client(client) as c, _reachable(c):
        pool_obj = c.read_work_pool(pool)
        q = _queue(c, pool, queue)
        now = datetime.now(timezone.utc).isoformat()
        state = {"pool": pool, "queue": queue, "devices": devices, "worker": worker, "since": now}
        _write_state(c, cell, state)
        payload = {"cell": cell, "pool": pool, "from_queue": None, "to_queue": queue, "devices": devices,
                   "worker": worker, "limits": {queue: q.concurrency_limit}}
        related = [_queue_resource(q, "to-queue"), *_retag_flow_run(c, flow_run_id, queue)]
        ev = _emit(c, PLACED, cell, pool_obj, related, payload)
    return Retag(cell, pool, None, queue, payload["limits"], PLACED, str(ev.id), ev.occurred.isoformat())


def move_cell(client: Any, cell: int | str, to_queue: str, *, pool: str = "gyre", from_queue: str | None = None,
              reason: dict | None = None, flow_run_id: Any = None) -> Retag | None:
    """The controller moved `cell` to `to_queue` (e.g. rollout -> train): move one unit of concurrency limit
    from its current queue to `to_queue` (a queue without a limit stays unlimited; a limit never goes
    below 0), record the cell's new queue, and emit a `gyre.cell.retagged` event with both queues, the new
    limits and `reason` (e.g. the controller's decision) in its payload.

    `from_queue` defaults to the cell's recorded queue (`place_cell` or an earlier move); a cell with no
    record and no `from_queue` is an error (placing it is `place_cell`). Returns None when the cell is
    already on `to_queue` (nothing changes, nothing is emitted). `flow_run_id`: as for `place_cell`."""
    cell = cell_name(cell)
    with _client(client) as c, _reachable(c):
        state = _read_state(c, cell) or {}
        src = from_queue or state.get("queue")
        if src is None:
            raise ValueError(f"cell {cell!r} has no recorded queue; give from_queue or call place_cell first")
        if src == to_queue:
            return None
        pool_obj = c.read_work_pool(pool)
        q_from, q_to = _queue(c, pool, src), _queue(c, pool, to_queue)
        limits = {src: q_from.concurrency_limit, to_queue: q_to.concurrency_limit}
        if q_from.concurrency_limit is not None:           # take the capacity away first ...
            limits[src] = max(0, q_from.concurrency_limit - 1)
            c.update_work_queue(q_from.id, concurrency_limit=limits[src])
        if q_to.concurrency_limit is not None:             # ... then give it to the new role
            limits[to_queue] = q_to.concurrency_limit + 1
            c.update_work_queue(q_to.id, concurrency_limit=limits[to_queue])
        now = datetime.now(timezone.utc).isoformat()
        _write_state(c, cell, {**state, "pool": pool, "queue": to_queue, "since": now})
        payload = {"cell": cell, "pool": pool, "from_queue": src, "to_queue": to_queue, "limits": limits,
                   "reason": dict(reason or {})}
        related = [_queue_resource(q_from, "from-queue"), _queue_resource(q_to, "to-queue"),
                   *_retag_flow_run(c, flow_run_id, to_queue)]
        ev = _emit(c, RETAGGED, cell, pool_obj, related, payload)
    return Retag(cell, pool, src, to_queue, limits, RETAGGED, str(ev.id), ev.occurred.isoformat())


def retag_history(client: Any, cell: int | str, limit: int = 500) -> list[dict]:
    """The cell's placements and moves, oldest first, as the server stored them (events; Prefect keeps
    them for PREFECT_SERVER_EVENTS_RETENTION_PERIOD, 7 days by default). `flow_run`: the id of the cell's
    own flow run when it was launched through Prefect, else None."""
    from prefect.events.filters import (EventFilter, EventNameFilter, EventOccurredFilter, EventOrder,
                                        EventResourceFilter)

    flt = EventFilter(occurred=EventOccurredFilter(since=datetime(2000, 1, 1, tzinfo=timezone.utc)),
                      event=EventNameFilter(prefix=["gyre.cell."]),
                      resource=EventResourceFilter(id=[resource_id(cell)]), order=EventOrder.ASC)
    out: list[dict] = []
    with _client(client) as c, _reachable(c):
        page = c.read_events(filter=flt, limit=50)
        while True:
            for ev in page.events:
                p = ev.payload or {}
                runs = [r.id.removeprefix("prefect.flow-run.") for r in ev.related if r.role == "flow-run"]
                out.append({"occurred": ev.occurred.isoformat(), "event": ev.event, "id": str(ev.id),
                            "pool": p.get("pool"), "from_queue": p.get("from_queue"), "to_queue": p.get("to_queue"),
                            "limits": p.get("limits"), "reason": p.get("reason"),
                            "flow_run": runs[0] if runs else None})
            if len(out) >= limit or not page.next_page:
                break
            page = c.read_events_page(page.next_page)
    return out[:limit]


class RoleRecorder:
    """`on_role(cell, role, reason)` for the elastic controller: records each cell's roles in Prefect as
    `place_cell` / `move_cell` (queue `rollout` or `train` of `pool`), off the controller's thread so a
    role switch never waits on the server. Cells are named `cell_run_name(run_id, i)`; `flow_runs`
    (cell -> flow-run id, filled as `gyre_ops.cell_runs.PrefectCellLauncher` starts them) gets each cell's
    own flow run retagged with its role.

    When the pool or its queues are missing (the embedded default runs on a temporary server with no
    pool), or the server cannot be reached, it records nothing and says so once on stderr: the run itself
    never depends on it. `close()` moves every cell back to its starting queue and waits for the writes."""

    def __init__(self, run_id: str, *, pool: str = "gyre", client: Any = None, say=None,
                 flow_runs: dict[int, Any] | None = None):
        from .pools import ApiUnreachable, check_pool

        self.run_id, self.pool, self.client = run_id, pool, client
        self.flow_runs = flow_runs if flow_runs is not None else {}
        self.say = say or (lambda m: print(m, file=sys.stderr))
        self.recorded: list[Retag] = []
        self.errors: list[str] = []
        self.start_queue: dict[int, str] = {}
        try:
            self.disabled = check_pool(client, pool, ("rollout", "train"))
        except ApiUnreachable as exc:
            self.disabled = str(exc)
        if self.disabled:
            self.say(f"gyre: cell roles are not recorded in Prefect: {self.disabled}")
            return
        self._q: _queue_mod.Queue = _queue_mod.Queue()
        self._thread = threading.Thread(target=self._drain, name="gyre-role-recorder", daemon=True)
        self._thread.start()

    def name(self, cell: int) -> str:
        return cell_run_name(self.run_id, cell)

    def __call__(self, cell: int, role: str, reason: dict) -> None:
        if not self.disabled:
            self._q.put((cell, role, dict(reason)))

    def _drain(self) -> None:
        while True:
            item = self._q.get()
            if item is None:          # the run ended: every cell back to where it started
                for cell, start in self.start_queue.items():
                    self._record(cell, start, {"run_ended": True})
                return
            self._record(*item)

    def _record(self, cell: int, role: str, reason: dict) -> None:
        name, run = self.name(cell), self.flow_runs.get(cell)
        try:
            if reason.get("placed"):
                self.start_queue[cell] = role
                self.recorded.append(place_cell(self.client, name, role, pool=self.pool, flow_run_id=run))
            elif (r := move_cell(self.client, name, role, pool=self.pool, reason=reason, flow_run_id=run)) is not None:
                self.recorded.append(r)
        except Exception as exc:  # noqa: BLE001 - a record that failed must not stop the run
            self.errors.append(f"{name} -> {role}: {type(exc).__name__}: {exc}")
            if len(self.errors) == 1:
                self.say(f"gyre: recording a cell role in Prefect failed ({self.errors[0]}); the run goes on")

    def close(self, timeout_s: float = 60.0) -> list[Retag]:
        """Every cell back to its starting queue (reason {"run_ended": True}), then wait for the writes."""
        if not self.disabled:
            self._q.put(None)
            self._thread.join(timeout_s)
        return self.recorded
