"""Gyre's work pools and queues: the spec in `infra/pools.yaml`, and making a Prefect server match it.

    from gyre_ops.pools import connect, load_spec, ensure_pools, check_pool
    with connect() as client:                         # the server at PREFECT_API_URL
        actions = ensure_pools(client, load_spec())   # idempotent: [("created", "pool gyre"), ...]
        problem = check_pool(client, "gyre", ["rollout", "train"])   # None, or one line naming it

`client` is a synchronous Prefect client (`prefect.client.orchestration.get_client(sync_client=True)`);
every function also accepts `client=None` and opens one from the current settings. A client is never
opened without an explicit `PREFECT_API_URL`: without one Prefect would start a temporary server, and a
check against a temporary server says nothing about the real one.

Errors: `SpecError` (the spec file, naming the field), `ApiUnreachable` (one line naming the URL;
`ApiNotConfigured`, a subclass, when PREFECT_API_URL is not set),
`PoolError` (the server holds something that contradicts the spec, e.g. a pool of another type).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "infra" / "pools.yaml"


class SpecError(ValueError):
    """The pools spec is malformed; the message names the field."""


class ApiUnreachable(RuntimeError):
    """No Prefect API answered (or none is configured); the message is one line."""


class ApiNotConfigured(ApiUnreachable):
    """PREFECT_API_URL is not set (a configuration error, not an outage)."""


class PoolError(RuntimeError):
    """The server holds a pool or queue the spec cannot be applied to (one line, naming it)."""


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    description: str = ""
    concurrency_limit: int | None = None   # None: unlimited; 0: nothing starts


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    type: str = "process"
    description: str = ""
    concurrency_limit: int | None = None
    queues: tuple[QueueSpec, ...] = field(default_factory=tuple)   # in priority order (first = 1)


# -- the spec -----------------------------------------------------------------------------------------
def _limit(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{where}.concurrency_limit must be a non-negative integer or null, got {value!r}")
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or "/" in value or "%" in value:
        raise SpecError(f"{where}.name must be a non-empty name without '/' or '%', got {value!r}")
    return value


def parse_spec(data: Any) -> list[PoolSpec]:
    """The spec from its parsed YAML/JSON (`{"pools": [{name, type, description, concurrency_limit,
    queues: [{name, description, concurrency_limit}]}]}`), validated."""
    if not isinstance(data, dict) or not isinstance(data.get("pools"), list) or not data["pools"]:
        raise SpecError("the spec must be a mapping with a non-empty list `pools`")
    unknown = set(data) - {"pools"}
    if unknown:
        raise SpecError(f"unknown top-level key(s): {sorted(unknown)}")
    pools, seen = [], set()
    for i, p in enumerate(data["pools"]):
        where = f"pools[{i}]"
        if not isinstance(p, dict):
            raise SpecError(f"{where} must be a mapping")
        extra = set(p) - {"name", "type", "description", "concurrency_limit", "queues"}
        if extra:
            raise SpecError(f"{where}: unknown key(s) {sorted(extra)}")
        name = _name(p.get("name"), where)
        if name in seen:
            raise SpecError(f"{where}.name: pool {name!r} is listed twice")
        seen.add(name)
        queues, qseen = [], set()
        for j, q in enumerate(p.get("queues") or []):
            qwhere = f"{where}.queues[{j}]"
            if not isinstance(q, dict):
                raise SpecError(f"{qwhere} must be a mapping")
            qextra = set(q) - {"name", "description", "concurrency_limit"}
            if qextra:
                raise SpecError(f"{qwhere}: unknown key(s) {sorted(qextra)}")
            qname = _name(q.get("name"), qwhere)
            if qname in qseen:
                raise SpecError(f"{qwhere}.name: queue {qname!r} is listed twice in pool {name!r}")
            qseen.add(qname)
            queues.append(QueueSpec(qname, str(q.get("description") or ""),
                                    _limit(q.get("concurrency_limit"), qwhere)))
        if "default" not in qseen:
            raise SpecError(f"{where}: pool {name!r} needs a queue named 'default' (Prefect creates one "
                            "with every pool; list it first to describe it)")
        ptype = p.get("type", "process")
        if not isinstance(ptype, str) or not ptype:
            raise SpecError(f"{where}.type must be a worker type such as 'process', got {ptype!r}")
        pools.append(PoolSpec(name, ptype, str(p.get("description") or ""),
                              _limit(p.get("concurrency_limit"), where), tuple(queues)))
    return pools


def load_spec(path: str | Path | None = None) -> list[PoolSpec]:
    """Read and validate `infra/pools.yaml` (or another YAML/JSON file of the same shape)."""
    import yaml

    path = Path(path) if path is not None else DEFAULT_SPEC
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpecError(f"cannot read the pools spec {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    try:
        return parse_spec(data)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from exc


# -- the client ---------------------------------------------------------------------------------------
def api_url() -> str | None:
    """The Prefect API URL the current settings point at (None: none configured)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


@contextlib.contextmanager
def connect() -> Iterator[Any]:
    """A synchronous Prefect client for PREFECT_API_URL; `ApiUnreachable` when none is set."""
    url = api_url()
    if not url:
        raise ApiNotConfigured("PREFECT_API_URL is not set; point it at the Prefect server, "
                             "e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        yield client


@contextlib.contextmanager
def _client(client: Any) -> Iterator[Any]:
    if client is not None:
        yield client
    else:
        with connect() as c:
            yield c


@contextlib.contextmanager
def _reachable(client: Any) -> Iterator[None]:
    """Turn a transport error (refused, DNS, timeout) into one line naming the URL."""
    import httpx

    try:
        yield
    except httpx.RequestError as exc:
        url = str(getattr(getattr(client, "_client", None), "base_url", None) or api_url() or "?").rstrip("/")
        reason = str(exc).strip() or type(exc).__name__
        raise ApiUnreachable(f"cannot reach the Prefect API at {url}: {reason}") from None


# -- ensure / check -------------------------------------------------------------------------------------
def _default_job_template(pool_type: str) -> dict | None:
    """What `prefect work-pool create --type T` would store (the worker type's default template)."""
    if pool_type == "process":
        from prefect.workers.process import ProcessWorker

        return ProcessWorker.get_default_base_job_template()
    from prefect.workers.base import BaseWorker

    cls = BaseWorker.get_worker_class_from_type(pool_type)
    return cls.get_default_base_job_template() if cls is not None else None


def ensure_pools(client: Any = None, spec: list[PoolSpec] | None = None) -> list[tuple[str, str]]:
    """Make the server match `spec` (default: `load_spec()`), idempotently.

    Creates missing pools and queues; updates the description and concurrency limit of existing ones
    when they differ (this resets limits that `move_cell` changed: run it at bring-up, not mid-run);
    leaves queues that are not in the spec alone. Queue priorities follow the spec's order.
    Returns what it did, e.g. [("created", "pool gyre"), ("updated", "queue gyre/rollout"),
    ("unchanged", "queue gyre/cpu")]. Raises `PoolError` for a pool of another type,
    `ApiUnreachable` when no server answers. `ensure_pools(load_spec())` (the spec as the only
    argument, with the client from PREFECT_API_URL) works too.
    """
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    if spec is None and isinstance(client, (list, tuple)):
        client, spec = None, client
    spec = load_spec() if spec is None else spec
    actions: list[tuple[str, str]] = []
    with _client(client) as c, _reachable(c):
        for pool in spec:
            try:
                existing = c.read_work_pool(pool.name)
            except ObjectNotFound:
                existing = None
            if existing is None:
                create: dict[str, Any] = dict(name=pool.name, type=pool.type, description=pool.description or None,
                                              concurrency_limit=pool.concurrency_limit)
                template = _default_job_template(pool.type)
                if template:
                    create["base_job_template"] = template
                c.create_work_pool(WorkPoolCreate(**create))
                actions.append(("created", f"pool {pool.name}"))
            else:
                if existing.type != pool.type:
                    raise PoolError(f"work pool {pool.name!r} exists with type {existing.type!r}, the spec says "
                                    f"{pool.type!r}; delete it or rename the pool in the spec")
                changes = {}
                if (existing.description or "") != pool.description:
                    changes["description"] = pool.description
                if existing.concurrency_limit != pool.concurrency_limit:
                    changes["concurrency_limit"] = pool.concurrency_limit
                if changes:
                    c.update_work_pool(pool.name, WorkPoolUpdate(**changes))
                actions.append(("updated" if changes else "unchanged", f"pool {pool.name}"))
            queues = {q.name: q for q in c.read_work_queues(work_pool_name=pool.name)}
            for priority, q in enumerate(pool.queues, start=1):
                label = f"queue {pool.name}/{q.name}"
                have = queues.get(q.name)
                if have is None:
                    c.create_work_queue(name=q.name, description=q.description or None,
                                        concurrency_limit=q.concurrency_limit, priority=priority,
                                        work_pool_name=pool.name)
                    actions.append(("created", label))
                    continue
                changes = {}
                if (have.description or "") != q.description:
                    changes["description"] = q.description
                if have.concurrency_limit != q.concurrency_limit:
                    changes["concurrency_limit"] = q.concurrency_limit
                if have.priority != priority:
                    changes["priority"] = priority
                if changes:
                    c.update_work_queue(have.id, **changes)
                actions.append(("updated" if changes else "unchanged", label))
    return actions


def check_pool(client: Any, pool: str, queues: str | Iterable[str] = ()) -> str | None:
    """None when work pool `pool` and every queue in `queues` exist on the server; otherwise one line
    naming the first that is missing (and the queues the pool does have). Creates nothing.
    Raises `ApiUnreachable` when no server answers."""
    from prefect.exceptions import ObjectNotFound

    wanted = [queues] if isinstance(queues, str) else list(queues)
    with _client(client) as c, _reachable(c):
        url = str(getattr(getattr(c, "_client", None), "base_url", None) or api_url()).rstrip("/")
        try:
            c.read_work_pool(pool)
        except ObjectNotFound:
            return (f"work pool {pool!r} does not exist on {url}; create it with `gyre up` "
                    f"(or gyre_ops.pools.ensure_pools from infra/pools.yaml)")
        have = sorted(q.name for q in c.read_work_queues(work_pool_name=pool))
        for q in wanted:
            if q not in have:
                return (f"work queue {q!r} does not exist in work pool {pool!r} on {url} "
                        f"(it has: {', '.join(have) or 'none'}); add it to infra/pools.yaml and run `gyre up`")
    return None
