"""The trajectory lake: Parquet files under a local path or s3:// prefix, committed by manifests.

    lake = Lake("data/lake")                        # or Lake("s3://bucket/prefix", storage_options={...})
    lake.write_part("run1", step_part(3), {"executions": executions_table(recs), "calls": calls_table(recs)})
    lake.read("calls", run_id="run1")                # only committed parts

Layout: <root>/runs/<run_id>/<part>/<table>.parquet and <root>/runs/<run_id>/<part>/_MANIFEST.json.
A part is a label (`step=3`, `step=-1`, `eval=before`, `demos`); the rows keep a numeric `step` column.
The manifest is written last and is the commit: S3 has no atomic rename, so readers see only the files
a manifest lists, and a part whose writer died before its manifest is invisible. A retry of the same
part first removes the old manifest, then replaces the files under the same names: it never duplicates.

Also here, each a method of `Lake`:
  * versions: a manifest of a newer schema version than this code, or an older one it cannot read, stops
    the read with both versions named (`LakeVersionError`); older files lack newer columns, read as NULL.
  * payloads: a call whose new prompt ids exceed `payload_bytes` keeps them in a content-addressed object
    `<part>/payloads/<sha256>.int32` (listed by the manifest); the row keeps its lake-relative URI.
  * quarantine: every listed file is checked once per process (size, Parquet footer, row count, column
    types) before it is read; a bad one is moved to `<root>/_quarantine/...` with the reason, its manifest
    entry is dropped, a warning names the path, and every read goes on with the rest.
  * cleanup: `cleanup(run)` removes what a crashed writer left (temp files, unlisted files) and finishes
    an interrupted compaction; a part without a manifest has its whole Parquet files moved to
    `<root>/_quarantine/<run>/<part>/<time>/` (they may be committed data whose manifest was lost).
  * damaged manifests (truncated, not JSON, no `files`) are moved aside the same way and named in a warning;
    the part then reads as uncommitted (`cleanup` sets its files aside too), never as an error.
  * compaction's last act: after a `compacted-<id>` part's manifest (the commit; `gyre_core.lake.compaction`
    writes it), the parts it covers keep their manifests (the completion markers) with `compacted_into`
    and no files of their own (`_retire_covered`; `cleanup` finishes an interrupted one).
  * retention: `usage(run)` says what a run holds and when it last committed or wrote; `delete_run(run)`
    removes its manifests (readers stop seeing it), then its files; nothing goes to quarantine.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import uuid
from datetime import datetime, timezone
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from gyre_core.lake.schema import ADDED_IN, METADATA_KEY, SCHEMAS, read_executions
from gyre_core.records import SCHEMA_VERSION, ExecutionRecord

MANIFEST = "_MANIFEST.json"
MIN_READ_VERSION = 1                           # the oldest lake schema version this code reads
QUARANTINE = "_quarantine"
PAYLOADS = "payloads"
COMPACTED = "compacted-"                        # label prefix of a compaction part
_NAME = re.compile(r"^[A-Za-z0-9_.=+-]+$")   # run ids, part labels
_TABLE = re.compile(r"^[a-z][a-z0-9_]*$")
_STEP_PART = re.compile(r"^(step|score|process)=(-?\d+)$")   # the parts compaction may merge
_verified: set[tuple[str, str, int, str]] = set()   # (protocol, path, bytes, written_at) checked this process
_verified_lock = threading.Lock()
STEP_PART_PREFIX = "step="


def step_part(step: int) -> str:
    """The part label of an RL step's executions (negative steps too: `step=-1`)."""
    return f"{STEP_PART_PREFIX}{int(step)}"


class LakeVersionError(ValueError):
    """A manifest or file written with a lake schema version this code cannot read."""


def _warn(msg: str) -> None:
    print(f"gyre lake: {msg}", file=sys.stderr, flush=True)


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

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None,
                 payload_bytes: int = 4 << 20):
        self.root = str(root)
        self.fs, path = fsspec.core.url_to_fs(self.root, **(storage_options or {}))
        self.path = path.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.payload_bytes = int(payload_bytes)
        self._writable = False

    @classmethod
    def from_config(cls, lake_cfg) -> "Lake":
        """The lake a run's `lake` config section names."""
        return cls(lake_cfg.root, lake_cfg.resolved_storage_options(),
                   payload_bytes=int(lake_cfg.payload_mb * (1 << 20)))

    def __repr__(self) -> str:
        return f"Lake({self.root!r})"

    # ---- paths -------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        """A path of this filesystem as a URL that fsspec and DuckDB understand."""
        if self.local:
            return path
        return f"{self._protocol()}://{path}"

    def _protocol(self) -> str:
        return self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def part_dir(self, run_id: str, part: str) -> str:
        return f"{self.path}/runs/{_check_name('run id', run_id)}/{_check_name('part', part)}"

    def relpath(self, path: str) -> str:
        """`path` relative to the root (the name a file has inside the lake)."""
        return path[len(self.path) + 1:] if path.startswith(self.path + "/") else path

    # ---- writing -----------------------------------------------------------------------------
    def check_writable(self, home: str | None = None) -> None:
        """Raise ValueError (one line) unless the root can be created and written.

        A local root may be created when its parent exists, or anywhere inside `home` when that directory
        exists (the Gyre home: its data folders are made as needed, so a fresh home works); elsewhere a
        missing parent is taken for a typo. An object-store bucket must exist already (a typo in a bucket
        name must not create a bucket)."""
        probe = f"{self.path}/.gyre-write-check-{uuid.uuid4().hex}"
        try:
            if self.local:
                parent = os.path.dirname(self.path) or "."
                in_home = home is not None and os.path.isdir(home) and \
                    os.path.commonpath([os.path.abspath(home), os.path.abspath(self.path)]) == os.path.abspath(home)
                if not os.path.isdir(self.path) and not os.path.isdir(parent) and not in_home:
                    raise FileNotFoundError(f"neither it nor its parent directory {parent!r} exists")
            else:
                bucket = self.path.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise FileNotFoundError(f"bucket {bucket!r} does not exist")
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
        old = self._read_manifest(manifest)
        if old is not None and old.get("compacted_into"):
            raise ValueError(f"part {part!r} of run {run_id!r} was compacted into {old['compacted_into']!r}: "
                             f"a finished step is not rewritten")
        if old is not None:               # un-commit first: a half-done retry must not look committed
            self.fs.rm_file(manifest)
        self.fs.makedirs(d, exist_ok=True)
        files, payloads = {}, []
        for name, table in sorted(tables.items()):
            if name == "calls" and "payload_uri" in table.column_names:
                table, written = self._offload_payloads(run_id, part, table)
                payloads += written
            fname = f"{name}.parquet"
            size = self._put(f"{d}/{fname}", lambda f, t=_with_version(table): write_parquet(t, f))
            files[name] = {"file": fname, "rows": table.num_rows, "bytes": size}
        body = {
            "format": "gyre-lake",
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "part": part,
            "written_at": datetime.now(timezone.utc).isoformat(),
            "files": files,
        }
        if payloads:
            body["payloads"] = sorted(set(payloads))
        self._put_json(manifest, body)
        if old is not None:               # a first attempt that died before its manifest: cleanup() at run start
            self._remove_strays(d, {v["file"] for v in files.values()} | {MANIFEST}, set(body.get("payloads", [])))
        return manifest

    def _put(self, path: str, write) -> int:
        """Write a whole file (readers never see part of it); returns its size in bytes."""
        if not self.local:                 # one PUT: an object appears whole or not at all
            with self.fs.open(path, "wb") as f:
                write(f)
                return f.tell()
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, path)
            return size
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _put_json(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body, indent=2, sort_keys=True).encode()
        self._put(path, lambda f: f.write(data))

    def _offload_payloads(self, run_id: str, part: str, table: pa.Table) -> tuple[pa.Table, list[str]]:
        """Move new prompt ids longer than `payload_bytes` into content-addressed objects of the part."""
        col = table.column("new_prompt_ids")
        lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
        big = np.flatnonzero(lengths * 4 > self.payload_bytes)
        if not len(big):
            return table, []
        ids, uris = col.to_pylist(), table.column("payload_uri").to_pylist()
        d = self.part_dir(run_id, part)
        self.fs.makedirs(f"{d}/{PAYLOADS}", exist_ok=True)
        written = []
        for i in big:
            data = np.asarray(ids[i], dtype="<i4").tobytes()
            name = f"{PAYLOADS}/{hashlib.sha256(data).hexdigest()[:32]}.int32"
            path = f"{d}/{name}"
            if name not in written and not self.fs.exists(path):
                self._put(path, lambda f, b=data: f.write(b))
            written.append(name)
            ids[i], uris[i] = [], self.relpath(path)
        table = table.set_column(table.schema.get_field_index("new_prompt_ids"), table.schema.field("new_prompt_ids"),
                                 pa.array(ids, type=col.type))
        table = table.set_column(table.schema.get_field_index("payload_uri"), table.schema.field("payload_uri"),
                                 pa.array(uris, type=pa.string()))
        return table, written

    def _resolve_payloads(self, table: pa.Table) -> pa.Table:
        """Put offloaded prompt ids back into a calls table."""
        if "payload_uri" not in table.column_names or table.column("payload_uri").null_count == table.num_rows:
            return table
        ids, uris = table.column("new_prompt_ids").to_pylist(), table.column("payload_uri").to_pylist()
        for i, uri in enumerate(uris):
            if uri:
                with self.fs.open(f"{self.path}/{uri}", "rb") as f:
                    ids[i] = np.frombuffer(f.read(), dtype="<i4").tolist()
        i = table.schema.get_field_index("new_prompt_ids")
        return table.set_column(i, table.schema.field(i), pa.array(ids, type=table.schema.field(i).type))

    def _remove_strays(self, d: str, keep: set[str], payloads: set[str] = frozenset(),
                       set_aside: bool = False) -> int:
        """Files of an earlier attempt that this one no longer lists (or a crashed temp file) go. With
        `set_aside` (a run's clean-up, where the manifest may be one that lost an entry) whole Parquet files
        are moved to the quarantine instead of deleted."""
        removed = 0
        for p in self.fs.ls(d, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name == PAYLOADS and payloads:
                for q in self.fs.ls(f"{d}/{PAYLOADS}", detail=False):
                    if f"{PAYLOADS}/{q.rstrip('/').rsplit('/', 1)[-1]}" not in payloads:
                        self.fs.rm(q, recursive=True)
                        removed += 1
            elif name not in keep:
                if set_aside and name.endswith(".parquet"):    # whole: maybe data its manifest forgot
                    self._set_aside(d, [p], "a whole Parquet file its part's manifest does not list")
                else:
                    self.fs.rm(p, recursive=True)
                removed += 1
        return removed

    # ---- reading -----------------------------------------------------------------------------
    def _read_manifest(self, path: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
                raise ValueError("not a Gyre lake manifest (no 'files')")
            for table, f in body["files"].items():     # each table's one file, as write_part names it
                if not (isinstance(f, dict) and f.get("file") == f"{table}.parquet"
                        and isinstance(f.get("rows"), int) and isinstance(f.get("bytes"), int)):
                    raise ValueError(f"its entry for table {str(table)[:40]!r} is not one a Gyre lake writes")
        except ValueError as e:           # truncated, garbage, or another file's: set aside, never trusted
            self._set_aside(path.rsplit("/", 1)[0], [path], f"damaged manifest ({type(e).__name__}: {e})")
            return None
        v = body.get("schema_version")
        if not isinstance(v, int) or not MIN_READ_VERSION <= v <= SCHEMA_VERSION:
            hint = "upgrade Gyre to read it" if isinstance(v, int) and v > SCHEMA_VERSION else \
                "rewrite it with a Gyre that can read it"
            raise LakeVersionError(f"{self.url(path)}: written with lake schema version {v}; this Gyre reads "
                                   f"versions {MIN_READ_VERSION}..{SCHEMA_VERSION} ({hint})")
        return body

    def manifest(self, run_id: str, part: str) -> dict[str, Any] | None:
        return self._read_manifest(f"{self.part_dir(run_id, part)}/{MANIFEST}")

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
        """The committed manifests (all runs, one run, one part), each read once. With a part of a
        compacted run, the compaction that holds its rows comes too."""
        self.fs.invalidate_cache()        # another process may have committed since we last listed
        out = []
        for run in [run_id] if run_id is not None else self.runs():
            labels = [part] if part is not None else self._parts(run)
            found = []
            for p in labels:
                m = self.manifest(run, p)
                if m is not None:     # where a manifest lies is what counts, should a lake be moved
                    found.append({**m, "run_id": run, "part": p})
            if part is not None and found and found[0].get("compacted_into"):
                c = self.manifest(run, found[0]["compacted_into"])
                if c is not None:
                    found.append({**c, "run_id": run, "part": found[0]["compacted_into"]})
            out += found
        return out

    def entries(self, table: str, run_id: str | None = None, part: str | None = None,
                manifests: list[dict[str, Any]] | None = None, verify: bool = True) -> list[dict[str, Any]]:
        """Manifest entries ({path, rows, bytes, written_at}, and `step` when only one step of a compacted
        file belongs to the part asked for) of a table's committed, readable files."""
        ms = self.manifests(run_id, part) if manifests is None else manifests
        covered = {(m["run_id"], p): m["part"] for m in ms for p in m.get("covers", [])}
        out = []
        for m in ms:
            if (m["run_id"], m["part"]) in covered or table not in m["files"]:
                continue             # rows now in a compaction (a crash may have left the old files)
            e = m["files"][table]
            entry = {"path": f"{self.part_dir(m['run_id'], m['part'])}/{e['file']}", "rows": e["rows"],
                     "bytes": e["bytes"], "written_at": m["written_at"], "run_id": m["run_id"],
                     "part": m["part"], "table": table}
            if part is not None and m["part"] != part:        # the compaction holding the part's rows
                entry["step"] = int(_STEP_PART.match(part).group(2))
            if verify and not self._verify(entry):
                continue
            out.append(entry)
        return out

    def files(self, table: str, run_id: str | None = None, part: str | None = None) -> list[str]:
        """URLs of a table's files that a manifest lists (nothing else is part of the lake)."""
        return [self.url(e["path"]) for e in self.entries(table, run_id, part)]

    def read(self, table: str, run_id: str | None = None, part: str | None = None) -> pa.Table:
        """A table's committed rows (columns unioned by name across files)."""
        tables = []
        for e in self.entries(table, run_id, part):
            try:
                t = pq.read_table(e["path"], filesystem=self.fs, page_checksum_verification=True)
            except (OSError, pa.ArrowException) as exc:      # a damaged page, past the footer's check, or I/O
                if isinstance(exc, FileNotFoundError) or not self.fs.exists(e["path"]):
                    raise
                problem = self._file_problem(e, deep=True)  # read it again, whole: is it the file?
                if problem is not None:
                    self.quarantine(e["run_id"], e["part"], table, problem)
                    continue
                t = pq.read_table(e["path"], filesystem=self.fs, page_checksum_verification=True)   # it was I/O
            if "step" in e:
                t = t.filter(pc.equal(t.column("step"), e["step"]))
            tables.append(t)
        if not tables:
            schema = SCHEMAS.get(table)
            return schema.empty_table() if schema is not None else pa.table({})
        out = pa.concat_tables(tables, promote_options="permissive")
        return self._resolve_payloads(out) if table == "calls" else out

    def read_records(self, run_id: str, part: str | None = None) -> list[ExecutionRecord]:
        """ExecutionRecords (full calls) of a run, or of one part of it."""
        return read_executions(self.read("executions", run_id, part), self.read("calls", run_id, part))

    # ---- bad files: checked once, quarantined ------------------------------------------------
    def _verify(self, entry: dict[str, Any], fresh: bool = False, deep: bool = False) -> bool:
        """True when the listed file is what its manifest says; otherwise quarantine it and say so.
        A file is checked once per process unless `fresh`; `deep` reads every page (`_file_problem`)."""
        key = (self._protocol(), entry["path"], entry["bytes"], entry["written_at"])
        with _verified_lock:
            if key in _verified and not fresh:
                return True
        problem = self._file_problem(entry, deep)
        if problem is None:
            with _verified_lock:
                _verified.add(key)
            return True
        self.quarantine(entry["run_id"], entry["part"], entry["table"], problem)
        return False

    def _file_problem(self, entry: dict[str, Any], deep: bool = False) -> str | None:
        """What is wrong with a listed file (None: nothing): its size, footer, rows and column types, and with
        `deep` every page read and checked against its CRC."""
        path, table = entry["path"], entry["table"]
        try:
            size = self.fs.size(path)
            if size != entry["bytes"]:
                return f"{size} bytes, its manifest says {entry['bytes']} (truncated or replaced)"
            with self.fs.open(path, "rb", **({} if self.local else {"size": size})) as f:   # no second HEAD
                pf = pq.ParquetFile(f, page_checksum_verification=deep)
                rows, schema = pf.metadata.num_rows, pf.schema_arrow
                if deep:
                    pf.read()
        except FileNotFoundError:
            return "missing"
        except Exception as e:  # noqa: BLE001 - whatever pyarrow says about a broken file
            if _io_error(e):   # the store did not answer: nothing is known about the file
                raise
            return _unreadable(e)
        if rows != entry["rows"]:
            return f"{rows} rows, its manifest says {entry['rows']}"
        version = int((schema.metadata or {}).get(METADATA_KEY, b"1"))
        if version > SCHEMA_VERSION:
            raise LakeVersionError(f"{self.url(path)}: written with lake schema version {version}; this Gyre "
                                   f"reads versions {MIN_READ_VERSION}..{SCHEMA_VERSION} (upgrade Gyre to read it)")
        for f in SCHEMAS.get(table, []):
            i = schema.get_field_index(f.name)
            if i < 0 and ADDED_IN.get(table, {}).get(f.name, 1) > version:
                continue                  # a column added after the file's version: reads as NULL
            if i < 0 or schema.field(i).type != f.type:
                got = "missing" if i < 0 else str(schema.field(i).type)
                return f"schema mismatch: column {f.name!r} should be {f.type}, is {got}"
        return None

    def quarantine(self, run_id: str, part: str, table: str, reason: str) -> str | None:
        """Move a table's file of a part to `<root>/_quarantine/` (nothing is deleted), drop it from the
        part's manifest, and say so. Returns where it went (None when the lake cannot be written)."""
        d = self.part_dir(run_id, part)
        m = self._read_manifest(f"{d}/{MANIFEST}")
        if m is None or table not in m["files"]:
            return None
        src = f"{d}/{m['files'][table]['file']}"
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")     # two in one second keep both
        dest = f"{self.path}/{QUARANTINE}/{run_id}/{part}/{stamp}-{m['files'][table]['file']}"
        try:
            if self.fs.exists(src):
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                self.fs.mv(src, dest)
            note = {"source": self.relpath(src), "reason": reason, "at": stamp, "manifest_entry": m["files"][table]}
            self._put_json(f"{dest}.reason.json", note)
            m.setdefault("quarantined", {})[table] = {**m["files"][table], "reason": reason,
                                                      "moved_to": self.relpath(dest)}
            del m["files"][table]
            self._put_json(f"{d}/{MANIFEST}", {k: v for k, v in m.items() if k not in ("run_id", "part")} |
                           {"run_id": run_id, "part": part})
        except Exception as e:  # noqa: BLE001 - a read-only lake: skip the file in this session only
            _warn(f"{self.url(src)}: {reason}; skipped (cannot move it to {QUARANTINE}/: {type(e).__name__}: {e})")
            return None
        _warn(f"{self.url(src)}: {reason}; moved to {self.url(dest)}, reading on without it")
        return dest

    def _set_aside(self, d: str, paths: list[str], reason: str) -> None:
        """Move `paths` of part directory `d` to `<root>/_quarantine/<run>/<part>/` with a note of why, and
        say so (on a lake that cannot be written: only say so)."""
        run_id, part = d.rstrip("/").rsplit("/", 2)[-2:]
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        dest = f"{self.path}/{QUARANTINE}/{run_id}/{part}/{stamp}"
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]
        try:
            self.fs.makedirs(dest, exist_ok=True)
            for p, name in zip(paths, names):
                self.fs.mv(p, f"{dest}/{name}")
            self._put_json(f"{dest}/reason.json", {"source": self.relpath(d), "files": names, "reason": reason,
                                                   "at": stamp})
        except Exception as e:  # noqa: BLE001 - a read-only lake: skip it in this session only
            _warn(f"{self.url(d)}: {reason}; skipped (cannot move {', '.join(names)} to {QUARANTINE}/: "
                  f"{type(e).__name__}: {e})")
            return
        _warn(f"{self.url(d)}: {reason}; {', '.join(names)} moved to {self.url(dest)}")

    def check(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Check every listed file now, every page against its CRC (quarantining bad ones); returns what was
        quarantined."""
        before = {(m["run_id"], m["part"]): set(m.get("quarantined", {})) for m in self.manifests(run_id)}
        for table in SCHEMAS:
            for e in self.entries(table, run_id, verify=False):
                self._verify(e, fresh=True, deep=True)
        out = []
        for m in self.manifests(run_id):
            for table, q in m.get("quarantined", {}).items():
                if table not in before.get((m["run_id"], m["part"]), set()):
                    out.append({"run_id": m["run_id"], "part": m["part"], "table": table, **q})
        return out

    def problems(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """What `check` would quarantine now, moving nothing (a dry run)."""
        return [{"run_id": e["run_id"], "part": e["part"], "table": table, "file": self.relpath(e["path"]),
                 "reason": why} for table in SCHEMAS for e in self.entries(table, run_id, verify=False)
                if (why := self._file_problem(e, deep=True)) is not None]

    # ---- crash leftovers ---------------------------------------------------------------------
    def cleanup(self, run_id: str) -> dict[str, int]:
        """Remove what a crashed writer of this run left behind; finish an interrupted compaction.
        Call it when no other process writes the run (at a run's start)."""
        base = f"{self.path}/runs/{_check_name('run id', run_id)}"
        self.fs.invalidate_cache()
        report = {"uncommitted_parts": 0, "stray_files": 0, "compactions_finished": 0}
        for p in self._dirs(base):
            d = f"{base}/{p}"
            m = self._read_manifest(f"{d}/{MANIFEST}")
            if m is None:
                # a writer that died before its commit, or a manifest lost or damaged: whole Parquet files
                # may be committed data, so they are moved aside, never deleted; temp files go
                whole = [f for f in self.fs.ls(d, detail=False) if f.endswith(".parquet")]
                if whole:
                    self._set_aside(d, whole, "a part without a manifest (an uncommitted write, or its manifest "
                                              "was lost)")
                try:
                    self.fs.rm(d, recursive=True)
                except FileNotFoundError:         # (on S3 a directory is gone with its last file)
                    pass
                report["uncommitted_parts"] += 1
                continue
            keep = {v["file"] for v in m["files"].values()} | {MANIFEST}
            report["stray_files"] += self._remove_strays(d, keep, set(m.get("payloads", [])),
                                                         set_aside="compacted_into" not in m)
            if p.startswith(COMPACTED):
                report["compactions_finished"] += self._retire_covered(run_id, p, m)
        return report

    # ---- compaction (`gyre_core.lake.compaction`): what a compaction's commit leaves behind --------
    def _retire_covered(self, run_id: str, label: str, body: dict[str, Any]) -> int:
        """After a compaction's commit: its parts keep their manifests (completion markers) without files."""
        done = 0
        for p in body.get("covers", []):
            d = self.part_dir(run_id, p)
            m = self._read_manifest(f"{d}/{MANIFEST}")
            if m is None or m.get("compacted_into") == label:
                continue
            m["compacted_into"] = label
            m["compacted_files"], m["files"] = m["files"], {}
            self._put_json(f"{d}/{MANIFEST}", m)
            self._remove_strays(d, {MANIFEST}, set(m.get("payloads", [])))   # offloaded prompts stay put
            done += 1
        return done

    # ---- retention -----------------------------------------------------------------------------
    def _run_files(self, run_id: str) -> dict[str, dict[str, Any]]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(f"{self.path}/runs/{_check_name('run id', run_id)}", detail=True)
        except FileNotFoundError:
            return {}
        return {p: info for p, info in found.items() if info.get("type") == "file"}

    def usage(self, run_id: str) -> dict[str, Any]:
        """What a run holds and when it last wrote: its committed `parts`, every file under its directory
        (`files`, `bytes`), `newest_commit` (the latest `written_at` of a part that is not a compaction:
        compacting adds no data) and `newest_uncommitted` (the latest change to a file of a part without
        a manifest: a writer may be at work), both POSIX seconds or None."""
        files = self._run_files(run_id)
        base = f"{self.path}/runs/{run_id}/"
        committed = {p[len(base):].split("/", 1)[0] for p in files if p.endswith(f"/{MANIFEST}")}
        commits = [_posix(m.get("written_at")) for m in self.manifests(run_id)
                   if not m["part"].startswith(COMPACTED)]
        loose = [_mtime(info) for p, info in files.items() if p[len(base):].split("/", 1)[0] not in committed]
        return {"run_id": run_id, "parts": len(committed), "files": len(files),
                "bytes": sum(int(info.get("size") or 0) for info in files.values()),
                "newest_commit": max((t for t in commits if t is not None), default=None),
                "newest_uncommitted": max((t for t in loose if t is not None), default=None)}

    def delete_run(self, run_id: str) -> dict[str, Any]:
        """Delete a run from the lake: every manifest first (readers stop seeing the run at once), then its
        files. Nothing goes to quarantine. Returns what was removed ({run_id, parts, files, bytes}); a crash
        in between leaves unlisted files that a second call (or `cleanup`) removes."""
        files = self._run_files(run_id)
        manifests = sorted(p for p in files if p.endswith(f"/{MANIFEST}"))
        report = {"run_id": run_id, "parts": len(manifests), "files": len(files),
                  "bytes": sum(int(info.get("size") or 0) for info in files.values())}
        if not files:
            return report
        if not self._writable:
            self.check_writable()
        if manifests:
            self.fs.rm(manifests)
        self.fs.rm(f"{self.path}/runs/{run_id}", recursive=True)
        self.fs.invalidate_cache()
        return report


def _posix(iso: Any) -> float | None:
    try:
        t = datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time from an fsspec listing (local: `mtime`; S3: `LastModified`)."""
    t = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(t, datetime):
        return t.timestamp()
    return float(t) if isinstance(t, (int, float)) else None


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


def _io_error(e: BaseException) -> bool:
    """An error of the storage or the network, not of a file's bytes: pyarrow's decode and checksum errors
    carry no errno; an OS or connection error does (or is a connection/timeout/permission error, or comes
    from an HTTP client library)."""
    if isinstance(e, (ConnectionError, TimeoutError, PermissionError)):
        return True
    if isinstance(e, OSError) and e.errno is not None:
        return True
    return type(e).__module__.split(".")[0] in ("botocore", "aiohttp", "urllib3", "requests", "httpx")


def _unreadable(e: BaseException) -> str:
    return f"not a readable Parquet file ({type(e).__name__}: {' '.join(str(e).split())})"


def write_parquet(table: pa.Table, f, **kw) -> None:
    """A lake file: with a CRC per page, so a flipped bit is found when the file is read (`Lake.read`, `gyre
    lake check`) instead of reading as a wrong value."""
    pq.write_table(table, f, write_page_checksum=True, **kw)


def _with_version(table: pa.Table) -> pa.Table:
    meta = dict(table.schema.metadata or {})
    meta[METADATA_KEY] = str(SCHEMA_VERSION).encode()
    return table.replace_schema_metadata(meta)
