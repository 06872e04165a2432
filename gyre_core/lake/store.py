"""The trajectory lake: Parquet files under a local path or s3:// prefix, committed by manifests.

    lake = Lake("data/lake")                        # or Lake("s3://bucket/prefix", storage_options={...})
    lake.write_part("run1", step_part(3), {"executions": executions_table(recs), "calls": calls_table(recs)})
    lake.read("calls", run_id="run1")                # only committed parts

Layout: <root>/runs/<run_id>/<part>/<table>.parquet and <root>/runs/<run_id>/<part>/_MANIFEST.json.
A part is a label (`step=3`, `step=-1`, `eval=before`, `demos`); the rows keep a numeric `step` column.
The manifest is written last and is the commit: S3 has no atomic rename, so readers see only the files
a manifest lists, and a part whose writer died before its manifest is invisible. A retry of the same
part first removes the old manifest, then replaces the files under the same names: it never duplicates.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime, timezone
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from gyre_core.lake.schema import METADATA_KEY, SCHEMAS, read_executions
from gyre_core.records import SCHEMA_VERSION, ExecutionRecord

MANIFEST = "_MANIFEST.json"
_NAME = re.compile(r"^[A-Za-z0-9_.=+-]+$")   # run ids, part labels
_TABLE = re.compile(r"^[a-z][a-z0-9_]*$")


def step_part(step: int) -> str:
    """The part label of an RL step (negative steps too: `step=-1`)."""
    return f"step={int(step)}"


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", "..") or name.startswith("_"):
        raise ValueError(f"invalid {kind} {name!r}: use letters, digits and . _ = + - (not leading _)")
    return name


def _part_key(part: str) -> tuple[int, int | str]:
    # step=N parts in numeric order, then the rest alphabetically.
    m = re.fullmatch(r"step=(-?\d+)", part)
    return (0, int(m.group(1))) if m else (1, part)


class Lake:
    """Write and read the lake's tables; `files()` is what `gyre_core.lake.sql.connect` scans."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None):
        self.root = str(root)
        self.fs, path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.path = path.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self._writable = False

    def __repr__(self) -> str:
        return f"Lake({self.root!r})"

    # ---- paths -------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        """A path of this filesystem as a URL that fsspec and DuckDB understand."""
        if self.local:
            return path
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{path}"

    def part_dir(self, run_id: str, part: str) -> str:
        return f"{self.path}/runs/{_check_name('run id', run_id)}/{_check_name('part', part)}"

    def relpath(self, path: str) -> str:
        """`path` relative to the root (the name a file has inside the lake)."""
        return path[len(self.path) + 1:] if path.startswith(self.path + "/") else path

    # ---- writing -----------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise ValueError (one line) unless the root can be created and written."""
        probe = f"{self.path}/.gyre-write-check-{uuid.uuid4().hex}"
        try:
            self.fs.makedirs(self.path, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any failure means "not writable"
            msg = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"lake root {self.root!r} is not writable: {msg}") from None
        self._writable = True

    def write_part(self, run_id: str, part: str, tables: dict[str, pa.Table]) -> str:
        """Write one part's tables, then its manifest (the commit). Returns the manifest path."""
        d = self.part_dir(run_id, part)
        for name, table in tables.items():
            _check_table(name, table)
        if not self._writable:
            self.check_writable()
        manifest = f"{d}/{MANIFEST}"
        if self.fs.exists(manifest):      # un-commit first: a half-done retry must not look committed
            self.fs.rm_file(manifest)
        self.fs.makedirs(d, exist_ok=True)
        files = {}
        for name, table in sorted(tables.items()):
            fname = f"{name}.parquet"
            self._put(f"{d}/{fname}", lambda f, t=_with_version(table): pq.write_table(t, f))
            files[name] = {"file": fname, "rows": table.num_rows, "bytes": self.fs.size(f"{d}/{fname}")}
        body = {
            "format": "gyre-lake",
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "part": part,
            "written_at": datetime.now(timezone.utc).isoformat(),
            "files": files,
        }
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        self._put(manifest, lambda f: f.write(data))
        self._remove_strays(d, {v["file"] for v in files.values()} | {MANIFEST})
        return manifest

    def _put(self, path: str, write) -> None:
        if not self.local:                 # one PUT: an object appears whole or not at all
            with self.fs.open(path, "wb") as f:
                write(f)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _remove_strays(self, d: str, keep: set[str]) -> None:
        # Files of an earlier attempt that this one no longer lists (or a crashed temp file).
        for p in self.fs.ls(d, detail=False):
            if p.rstrip("/").rsplit("/", 1)[-1] not in keep:
                self.fs.rm(p, recursive=True)

    # ---- reading -----------------------------------------------------------------------------
    def manifest(self, run_id: str, part: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(f"{self.part_dir(run_id, part)}/{MANIFEST}", "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def committed(self, run_id: str, part: str) -> bool:
        return self.fs.exists(f"{self.part_dir(run_id, part)}/{MANIFEST}")

    def _dirs(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def parts(self, run_id: str) -> list[str]:
        """Committed parts of a run: step=N in numeric order, then other labels."""
        self.fs.invalidate_cache()        # another process may have committed since we last listed
        return self._parts(run_id)

    def _parts(self, run_id: str) -> list[str]:
        base = f"{self.path}/runs/{_check_name('run id', run_id)}"
        found = [p for p in self._dirs(base) if _NAME.match(p) and self.fs.exists(f"{base}/{p}/{MANIFEST}")]
        return sorted(found, key=_part_key)

    def runs(self) -> list[str]:
        """Runs with at least one committed part."""
        self.fs.invalidate_cache()
        return [r for r in self._dirs(f"{self.path}/runs") if _NAME.match(r) and self._parts(r)]

    def manifests(self, run_id: str | None = None, part: str | None = None) -> list[dict[str, Any]]:
        """The committed manifests (all runs, one run, one part), each read once."""
        self.fs.invalidate_cache()        # another process may have committed since we last listed
        out = []
        for run in [run_id] if run_id is not None else self.runs():
            for p in [part] if part is not None else self._parts(run):
                m = self.manifest(run, p)
                if m is not None:     # where a manifest lies is what counts, should a lake be moved
                    out.append({**m, "run_id": run, "part": p})
        return out

    def entries(self, table: str, run_id: str | None = None, part: str | None = None,
                manifests: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Manifest entries ({path, rows, bytes, written_at}) of a table's committed files."""
        out = []
        for m in self.manifests(run_id, part) if manifests is None else manifests:
            if table in m["files"]:
                e = m["files"][table]
                out.append({"path": f"{self.part_dir(m['run_id'], m['part'])}/{e['file']}", "rows": e["rows"],
                            "bytes": e["bytes"], "written_at": m["written_at"]})
        return out

    def files(self, table: str, run_id: str | None = None, part: str | None = None) -> list[str]:
        """URLs of a table's files that a manifest lists (nothing else is part of the lake)."""
        return [self.url(e["path"]) for e in self.entries(table, run_id, part)]

    def read(self, table: str, run_id: str | None = None, part: str | None = None) -> pa.Table:
        """A table's committed rows (columns unioned by name across files)."""
        paths = [e["path"] for e in self.entries(table, run_id, part)]
        if not paths:
            schema = SCHEMAS.get(table)
            return schema.empty_table() if schema is not None else pa.table({})
        tables = [pq.read_table(p, filesystem=self.fs) for p in paths]
        return pa.concat_tables(tables, promote_options="permissive")

    def read_records(self, run_id: str, part: str | None = None) -> list[ExecutionRecord]:
        """ExecutionRecords (full calls) of a run, or of one part of it."""
        return read_executions(self.read("executions", run_id, part), self.read("calls", run_id, part))


def _check_table(name: str, table: pa.Table) -> None:
    if not _TABLE.match(name):
        raise ValueError(f"invalid table name {name!r}")
    expected = SCHEMAS.get(name)
    if expected is None:
        return
    for f in expected:  # the lake's own tables keep their columns and types (extra columns are fine)
        i = table.schema.get_field_index(f.name)
        if i < 0 or table.schema.field(i).type != f.type:
            got = "missing" if i < 0 else str(table.schema.field(i).type)
            raise ValueError(f"table {name!r}: column {f.name!r} should be {f.type}, is {got}")


def _with_version(table: pa.Table) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    meta[METADATA_KEY] = str(SCHEMA_VERSION).encode()
    return table.replace_schema_metadata(meta)
