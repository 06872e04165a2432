"""Read-only SQL over the lake with DuckDB. `connect()` is the one place that opens DuckDB on it.

    from gyre_core.lake.sql import connect, run_sql
    print(run_sql("data/lake", "SELECT execution_id, tokens_generated FROM executions"))
    con = connect("s3://bucket/lake", run_id="run1", storage_options={...})

Views: one per lake table (`executions`, `calls`, `scores`, `train_tokens` and the processor's tables) over
exactly the files that manifests list (an uncommitted part is invisible), `tokens` (calls unnested: one row
per completion token with its log-prob and policy version), `execution_content` (a content hash per
execution, `gyre_core.lake.dedup`) and `steps` (one row per committed part, from the manifests alone).
Named queries live in `gyre_core/lake/queries/NAME.sql`, package data (`named_query`, `named_queries`;
`gyre sql --query NAME`); $GYRE_SQL_DIR points them at another directory.
Read-only is enforced by DuckDB itself, never by filtering SQL text:
  * the views live in a throwaway database file opened with `read_only=True` (CREATE/INSERT/ATTACH fail);
  * DuckDB sees the lake only through `gyrelake://`, a registered fsspec filesystem that serves the
    manifest-listed files for reading and refuses every write (a DuckDB allow-list alone is not enough:
    `allowed_paths` also permits `COPY ... TO` over a listed file with USE_TMP_FILE false);
  * then `allowed_directories=['gyrelake://']`, `temp_directory=''` (no spill directory to write to),
    `enable_external_access=false` (no other file, no INSTALL/LOAD, no secrets) and finally
    `lock_configuration=true` (no SET/RESET undoes any of it). Extensions are never auto-installed
    or auto-loaded. S3 goes through s3fs, so DuckDB's httpfs extension (downloaded at run time,
    unavailable offline) is never needed.
Session-scoped TEMP tables and macros still work: they live in memory and die with the connection.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from fsspec import AbstractFileSystem

from gyre_core.lake.dedup import EXECUTION_CONTENT_VIEW
from gyre_core.lake.schema import SCHEMAS, duckdb_type
from gyre_core.lake.store import Lake

PROTOCOL = "gyrelake"
_REFUSED_MARK = "the lake is read-only"
# Set at start-up; everything else is SET on the open connection, in the order that DuckDB accepts.
_START_CONFIG = {"autoinstall_known_extensions": "false", "autoload_known_extensions": "false"}
_LOCKDOWN = (
    f"SET allowed_directories = ['{PROTOCOL}://']",
    "SET temp_directory = ''",
    "SET allow_community_extensions = false",
    "SET allow_persistent_secrets = false",
    "SET enable_external_access = false",
    "SET lock_configuration = true",
)
TOKENS_VIEW = """
CREATE VIEW tokens AS
SELECT run_id, step, execution_id, call_index, context_index, role,
       unnest(range(len(completion_ids))) AS position,
       unnest(completion_ids) AS token_id,
       unnest(logprobs) AS logprob,
       unnest(versions) AS version
FROM calls
"""


# `steps`: one row per committed part of a run, from its manifest (no Parquet read). A table, made before
# the views database is reopened read-only, so it cannot be changed afterwards; typed when empty too.
_STEPS_ARROW = pa.schema([
    ("run_id", pa.string()), ("part", pa.string()), ("kind", pa.string()), ("step", pa.int64()),
    ("tables", pa.list_(pa.string())), ("rows", pa.int64()), ("bytes", pa.int64()),
    ("written_at", pa.timestamp("us")), ("schema_version", pa.int32()),
])
_KIND_STEP = re.compile(r"^([^=]+)=(-?\d+)$")

SQL_DIR_ENV = "GYRE_SQL_DIR"
_QUERY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


class SqlError(RuntimeError):
    """A query failed (its message is DuckDB's)."""

    def one_line(self) -> str:
        """The message on one line: DuckDB's hints kept, its echo of the query and the caret dropped."""
        lines = [line.strip() for line in str(self).splitlines()]
        kept = [line for line in lines if line and not line.startswith("LINE ") and set(line) != {"^"}]
        return " ".join(kept)


class SqlRefused(SqlError):
    """A query tried to write, attach, install/load, change settings or read outside the lake."""


class PositionalReader(io.RawIOBase):
    """A read-only file that DuckDB's worker threads can share.

    DuckDB's adapter for Python filesystems turns each positional read into seek() then read() on one
    shared handle, from several threads at once: on an ordinary file object one thread's seek moves
    another's read (short reads, Snappy errors, or silently wrong sums). Here every thread keeps its own
    position, and a read is positional: os.pread on a local file, a ranged GET on an object store."""

    def __init__(self, fs: AbstractFileSystem, path: str, size: int):
        super().__init__()
        self._fs, self._path, self._size = fs, path, int(size)
        self._at = threading.local()
        self._fd = os.open(path, os.O_RDONLY) if "file" in _protocols(fs) else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return getattr(self._at, "pos", 0)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at.pos = max(0, (0, self.tell(), self._size)[whence] + offset)
        return self._at.pos

    def read(self, n: int = -1) -> bytes:
        start = self.tell()
        end = self._size if n is None or n < 0 else min(self._size, start + n)
        if start >= end:
            return b""
        if self._fd is None:
            data = self._fs.cat_file(self._path, start=start, end=end)
        else:
            chunks, at = [], start
            while at < end:                       # pread may return less than asked for
                chunk = os.pread(self._fd, end - at, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
            data = b"".join(chunks)
        self._at.pos = start + len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        if self._fd is not None and not self.closed:
            os.close(self._fd)
        super().close()


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


class _ReadOnlyLakeFS(AbstractFileSystem):
    """The manifest-listed files of a lake, for reading only, as `gyrelake://<path in the lake>`."""

    protocol = PROTOCOL
    cachable = False

    def __init__(self, fs: AbstractFileSystem, files: dict[str, dict[str, Any]]):
        super().__init__()
        self.fs = fs
        self.files = files     # name in the lake -> manifest entry {path, bytes, written_at, ...}

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return path.strip("/")

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"{_REFUSED_MARK}: cannot open {path!r} for writing")
        entry = self.files.get(self._strip_protocol(path))
        if entry is None:
            raise FileNotFoundError(path)
        return PositionalReader(self.fs, entry["path"], entry["bytes"])

    def info(self, path, **kwargs):
        name = self._strip_protocol(path)
        if name in self.files:
            return {"name": name, "size": self.files[name]["bytes"], "type": "file"}
        if name == "" or any(f.startswith(name + "/") for f in self.files):
            return {"name": name, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path, detail=True, **kwargs):
        name = self._strip_protocol(path)
        if name in self.files:
            out = [self.info(name)]
        else:
            prefix = f"{name}/" if name else ""
            heads = {prefix + f[len(prefix):].split("/", 1)[0] for f in self.files if f.startswith(prefix)}
            if not heads:
                raise FileNotFoundError(path)
            out = [self.info(h) for h in sorted(heads)]
        return out if detail else [o["name"] for o in out]

    def modified(self, path):
        entry = self.files.get(self._strip_protocol(path))
        if entry is None:
            raise FileNotFoundError(path)
        return datetime.fromisoformat(entry["written_at"])

    def _refuse(self, *args, **kwargs):
        raise PermissionError(f"{_REFUSED_MARK}: no writes, moves or deletes")

    mkdir = makedirs = rmdir = rm = rm_file = _rm = mv = cp_file = touch = pipe_file = put_file = _refuse


def _view_sql(table: str, urls: list[str]) -> str:
    if not urls:   # no files yet: an empty view that still has the right columns
        cols = ", ".join(f'CAST(NULL AS {duckdb_type(f.type)}) AS "{f.name}"' for f in SCHEMAS[table])
        return f"CREATE VIEW {table} AS SELECT {cols} LIMIT 0"
    quoted = ", ".join("'" + u.replace("'", "''") + "'" for u in urls)
    # hive_partitioning off: `step=3` directories must not replace the rows' own `step` column.
    return (f"CREATE VIEW {table} AS SELECT * FROM "
            f"read_parquet([{quoted}], union_by_name = true, hive_partitioning = false)")


def _add_missing_columns(con: duckdb.DuckDBPyConnection, table: str, urls: list[str]) -> None:
    """Files of an older schema version lack the newer columns: the view gets them as typed NULLs, so a
    query (and the dedup hash) sees every column of the current schema whatever the files' versions."""
    have = {r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()}
    missing = [f for f in SCHEMAS[table] if f.name not in have]
    if not urls or not missing:
        return
    extra = ", ".join(f'CAST(NULL AS {duckdb_type(f.type)}) AS "{f.name}"' for f in missing)
    con.execute(_view_sql(table, urls).replace("CREATE VIEW", "CREATE OR REPLACE VIEW")
                .replace(" AS SELECT * FROM ", f" AS SELECT *, {extra} FROM ", 1))


def steps_table(manifests: list[dict[str, Any]]) -> pa.Table:
    """The `steps` rows of these manifests: kind and step from the part label (`step=3` -> step, 3;
    `eval=before` -> eval, NULL; `demos` -> demos, NULL), table names, total rows and bytes."""
    rows = []
    for m in manifests:
        part = m["part"]
        hit = _KIND_STEP.match(part)
        kind, step = (hit.group(1), int(hit.group(2))) if hit else (part.split("=", 1)[0], None)
        files = m.get("files") or {}
        written = m.get("written_at")
        if written:
            t = datetime.fromisoformat(written)
            written = (t.astimezone(timezone.utc) if t.tzinfo else t).replace(tzinfo=None)
        version = m.get("schema_version")
        rows.append({
            "run_id": m["run_id"], "part": part, "kind": kind, "step": step, "tables": sorted(files),
            "rows": sum(int(f.get("rows", 0)) for f in files.values()),
            "bytes": sum(int(f.get("bytes", 0)) for f in files.values()),
            "written_at": written or None, "schema_version": None if version is None else int(version),
        })
    return pa.Table.from_pylist(rows, schema=_STEPS_ARROW)


def _create_steps(con: duckdb.DuckDBPyConnection, manifests: list[dict[str, Any]]) -> None:
    con.register("_gyre_steps_rows", steps_table(manifests))   # in the lake's order: runs, then parts
    con.execute("CREATE TABLE steps AS SELECT * FROM _gyre_steps_rows")
    con.unregister("_gyre_steps_rows")


def connect(root: str, run_id: str | None = None, storage_options: dict[str, Any] | None = None,
            memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection with the lake's views (all runs, or one run); `memory_limit`: DuckDB's
    (None: its default, 80% of RAM)."""
    lake = Lake(root, storage_options)
    files: dict[str, dict[str, Any]] = {}
    views: dict[str, list[str]] = {}
    manifests = lake.manifests(run_id)
    for table in SCHEMAS:
        views[table] = []
        for entry in lake.entries(table, manifests=manifests):
            name = lake.relpath(entry["path"])
            files[name] = entry
            views[table].append(f"{PROTOCOL}://{name}")
    rofs = _ReadOnlyLakeFS(lake.fs, files)
    tmp = tempfile.mkdtemp(prefix="gyre-sql-")
    db = os.path.join(tmp, "views.duckdb")
    try:
        build = duckdb.connect(db, config=_START_CONFIG)
        try:
            build.register_filesystem(rofs)
            for table, urls in views.items():
                build.execute(_view_sql(table, urls))
                _add_missing_columns(build, table, urls)
            build.execute(TOKENS_VIEW)
            build.execute(EXECUTION_CONTENT_VIEW)
            _create_steps(build, manifests)
        finally:
            build.close()
        config = dict(_START_CONFIG, **({"memory_limit": memory_limit} if memory_limit else {}))
        con = duckdb.connect(db, read_only=True, config=config)
        con.register_filesystem(rofs)
        for statement in _LOCKDOWN:
            con.execute(statement)
    finally:
        # The read-only connection keeps its open handle; the file itself is not needed again.
        shutil.rmtree(tmp, ignore_errors=True)
    return con


def _wrap(e: duckdb.Error) -> SqlError:
    msg = str(e).strip()
    if _REFUSED_MARK in msg:  # raised by _ReadOnlyLakeFS inside DuckDB: keep the last line, not the traceback
        msg = next(line for line in reversed(msg.splitlines()) if _REFUSED_MARK in line).strip()
        return SqlRefused(msg)
    refused = isinstance(e, duckdb.PermissionException) or any(
        s in msg for s in ("read-only mode", "configuration has been locked", "disabled by configuration",
                           "disabled through configuration"))
    # A refusal is one line (DuckDB appends the query with a caret); so is a file that cannot be read (its
    # details follow on further lines); other errors, such as a syntax error, keep their hints.
    if refused:
        return SqlRefused(msg.splitlines()[0].strip())
    if isinstance(e, (duckdb.IOException, duckdb.InvalidInputException)):
        return SqlError(" ".join(msg.split()) + " (`gyre lake check` finds damaged files and sets them aside)")
    return SqlError(msg)


def sql_dir() -> Path:
    """Where named queries live: $GYRE_SQL_DIR, else `queries/` beside this module (package data, so an
    installed wheel has them too)."""
    env = os.environ.get(SQL_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parent / "queries"


def _description(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line[2:].strip() if line.startswith("--") else ""
    return ""


def named_queries() -> dict[str, str]:
    """Named queries by name, each with the first line of its comment header."""
    d = sql_dir()
    files = sorted(d.glob("*.sql")) if d.is_dir() else []
    return {f.stem: _description(f.read_text()) for f in files if _QUERY_NAME.match(f.stem)}


def named_query(name: str) -> str:
    """The SQL text of `<name>.sql` in `sql_dir()`; SqlError (naming the known ones) when there is none."""
    path = sql_dir() / f"{name}.sql"
    if not _QUERY_NAME.match(name) or not path.is_file():
        known = ", ".join(named_queries()) or f"none in {sql_dir()}"
        raise SqlError(f"no named query {name!r}; known: {known}")
    return path.read_text()


def _refuse_write(con: duckdb.DuckDBPyConnection, query: str, e: duckdb.Error) -> SqlError:
    # INSERT/UPDATE/DELETE on a view fail in DuckDB's binder with a message about base tables; say why.
    wrapped = _wrap(e)
    try:
        kind = con.extract_statements(query)[0].type
    except duckdb.Error:
        return wrapped
    writes = {getattr(duckdb.StatementType, k, None) for k in ("INSERT", "UPDATE", "DELETE", "MERGE_INTO")}
    on_view = any(s in str(wrapped) for s in ("base table", "not an table", "is not a table"))
    if kind in writes and on_view and not isinstance(wrapped, SqlRefused):
        what = kind.name.replace("_", " ")
        return SqlRefused(f"{_REFUSED_MARK}: {what} refused ({str(wrapped).splitlines()[0].strip()})")
    return wrapped


def run_sql(root: str, query: str, run_id: str | None = None, fmt: str = "table",
            storage_options: dict[str, Any] | None = None, *, timeout_s: float | None = None,
            memory_limit: str | None = None, max_rows: int | None = None,
            on_truncate: Callable[[int], None] | None = None) -> str:
    """Run one SQL statement on the lake and render its result as "table", "csv" or "json".

    `timeout_s`: stop the query past that many seconds (SqlError); `memory_limit`: DuckDB's (e.g. "2GB"; a
    query that needs more fails, as nothing may spill to disk); `max_rows`: render at most that many rows,
    calling `on_truncate(max_rows)` when there were more. Ctrl-C (KeyboardInterrupt) stops the query and is
    raised again."""
    if fmt not in ("table", "csv", "json"):
        raise ValueError(f"fmt must be 'table', 'csv' or 'json', not {fmt!r}")
    try:
        con = connect(root, run_id, storage_options, memory_limit)
    except duckdb.Error as e:       # e.g. a listed file that is not Parquet
        raise _wrap(e) from None
    except ValueError as e:         # e.g. a run id that cannot name a run
        raise SqlError(str(e)) from None
    if run_id is not None and not (lake := Lake(root, storage_options)).parts(run_id):
        con.close()                 # (a misspelt run would answer every query with no rows)
        raise SqlError(f"no run {run_id!r} in the lake at {root} (runs: {', '.join(lake.runs()) or 'none'})")
    try:
        try:
            n = len(con.extract_statements(query))
            if n != 1:
                raise SqlError(f"run_sql runs exactly one statement; got {n}")
            columns, rows = _execute(con, query, timeout_s, max_rows)
        except duckdb.Error as e:
            raise _refuse_write(con, query, e) from None
    finally:
        con.close()
    if columns is None:
        return ""
    if max_rows is not None and len(rows) > max_rows:
        rows = rows[:max_rows]
        if on_truncate is not None:
            on_truncate(max_rows)
    return {"table": _render_table, "csv": _render_csv, "json": _render_json}[fmt](columns, rows)


def _execute(con: duckdb.DuckDBPyConnection, query: str, timeout_s: float | None,
             max_rows: int | None) -> tuple[list[str] | None, list[tuple]]:
    """Run the query on a thread while this one waits, so that a timeout or Ctrl-C can interrupt DuckDB
    (a signal would only be handled after the query returned); fetch at most max_rows + 1 rows."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            cur = con.execute(query)
            if cur.description is None:
                box["result"] = (None, [])
                return
            columns = [d[0] for d in cur.description]
            box["result"] = (columns, cur.fetchall() if max_rows is None else cur.fetchmany(max_rows + 1))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    th = threading.Thread(target=work, name="gyre-sql", daemon=True)
    th.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    def stop() -> None:
        while th.is_alive():           # (an interrupt before the query began would be lost: repeat it)
            con.interrupt()
            th.join(0.05)

    try:
        while th.is_alive():
            th.join(0.05)
            if deadline is not None and th.is_alive() and time.monotonic() > deadline:
                stop()
                raise SqlError(f"the query ran past {timeout_s:g} s and was stopped (gyre sql --timeout)")
    except KeyboardInterrupt:
        stop()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


def _render_csv(columns: list[str], rows: list[tuple]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    w.writerows([["" if v is None else v for v in r] for r in rows])
    return buf.getvalue()


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    return v


def _render_json(columns: list[str], rows: list[tuple]) -> str:
    records = [{c: _json_value(v) for c, v in zip(columns, r)} for r in rows]
    return json.dumps(records, default=str)


def _cell(v: Any, width: int = 60) -> str:
    s = "NULL" if v is None else str(v)
    return s if len(s) <= width else s[: width - 1] + "…"


def _render_table(columns: list[str], rows: list[tuple]) -> str:
    """A plain aligned table (numbers right-aligned, long cells cut at 60 characters)."""
    cells = [[_cell(v) for v in r] for r in rows]
    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    numeric = [all(is_number(r[i]) for r in rows if r[i] is not None) for i in range(len(columns))]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(vals: list[str]) -> str:
        padded = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric))
        return "  ".join(padded).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"
