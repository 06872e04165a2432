"""Compaction: merge the files of a run's finished RL steps into one file per table.

    report = compact(lake, "quick-s0")     # {"compactions": [...], "parts", "files_before", "files_after"}
    compactable(lake, "quick-s0")          # the parts it would merge now (a dry run)

Finished: `step=N`, `score=N`, `process=N` parts with N below the run's newest committed step (that one
may still be in flight). The merged rows go to a `compacted-<id>` part whose manifest is the commit; the
covered parts then keep their manifests (the completion markers) with `compacted_into` and no files of
their own (`Lake._retire_covered`). Query results do not change. `lake.maintenance.compact_run` skips a
run with a part being written.
"""
from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gyre_core.lake.store import _STEP_PART, COMPACTED, MANIFEST, Lake, _with_version, write_parquet
from gyre_core.records import SCHEMA_VERSION


def compact(lake: Lake, run_id: str, target_mb: float = 256.0, include_latest: bool = False) -> dict[str, Any]:
    """Merge the files of a run's finished RL steps into compacted parts (one file per table each).

    Finished: `step=N`, `score=N`, `process=N` parts with N below the run's newest committed step
    (that one may still be in flight; `include_latest=True` takes it too). Query results are unchanged.
    """
    if not lake._writable:
        lake.check_writable()
    for m in lake.manifests(run_id):     # an interrupted compaction first (never a writer's parts:
        if m["part"].startswith(COMPACTED):   # the run may be in flight)
            lake._retire_covered(run_id, m["part"], m)
    steps, todo = _finished_steps(lake, run_id, include_latest)
    if not steps:
        return {"run_id": run_id, "compactions": [], "parts": 0, "files_before": 0, "files_after": 0}
    groups, size = [[]], 0
    for m in todo:                      # consecutive parts, up to target_mb of files per compaction
        b = sum(e["bytes"] for e in m["files"].values())
        if groups[-1] and size + b > target_mb * (1 << 20):
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += b
    made, files_before, files_after = [], 0, 0
    for group in (g for g in groups if g):
        label = f"{COMPACTED}{uuid.uuid4().hex[:12]}"
        tables: dict[str, list[pa.Table]] = {}
        kept = []
        for m in group:
            read = {t: pq.read_table(e["path"], filesystem=lake.fs)
                    for t in m["files"] for e in lake.entries(t, manifests=[m])}
            # a part's rows are found again in the merged file by their step: only parts whose rows
            # all carry the step of their label are merged (the others stay as they are)
            if not read or any(t.num_rows and pc.min_max(t.column("step")).as_py() !=
                               {"min": steps[m["part"]], "max": steps[m["part"]]} for t in read.values()):
                continue
            kept.append(m)
            for t, rows in read.items():
                tables.setdefault(t, []).append(rows)
            files_before += len(m["files"])
        if not kept:
            continue
        group = kept
        d = lake.part_dir(run_id, label)
        lake.fs.makedirs(d, exist_ok=True)
        files = {}
        for table, parts in sorted(tables.items()):
            merged = pa.concat_tables(parts, promote_options="permissive")
            fname = f"{table}.parquet"
            size = lake._put(f"{d}/{fname}",
                             lambda f, t=_with_version(merged): write_parquet(t, f, row_group_size=1 << 20))
            files[table] = {"file": fname, "rows": merged.num_rows, "bytes": size}
        body = {"format": "gyre-lake", "schema_version": SCHEMA_VERSION, "run_id": run_id, "part": label,
                "written_at": datetime.now(timezone.utc).isoformat(), "files": files,
                "covers": [m["part"] for m in group]}
        lake._put_json(f"{d}/{MANIFEST}", body)              # the commit
        lake._retire_covered(run_id, label, body)
        files_after += len(files)
        made.append({"part": label, "covers": body["covers"], "rows": {t: v["rows"] for t, v in files.items()}})
    return {"run_id": run_id, "compactions": made, "parts": sum(len(c["covers"]) for c in made),
            "files_before": files_before,
            "files_after": files_after}

def _finished_steps(lake: Lake, run_id: str, include_latest: bool) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """(the step of each uncompacted step part, the manifests of those `compact` takes, in step order)."""
    ms = [m for m in lake.manifests(run_id) if not m.get("compacted_into") and not m.get("covers")]
    steps = {m["part"]: int(_STEP_PART.match(m["part"]).group(2)) for m in ms if _STEP_PART.match(m["part"])}
    newest = max(steps.values(), default=0)
    todo = sorted((m for m in ms if m["part"] in steps and (include_latest or steps[m["part"]] < newest)
                   and m["files"]), key=lambda m: (steps[m["part"]], m["part"]))
    return steps, todo

def compactable(lake: Lake, run_id: str, include_latest: bool = False) -> list[str]:
    """The parts `compact` would merge now (a dry run; a part whose rows carry another step is skipped
    only when merging)."""
    return [m["part"] for m in _finished_steps(lake, run_id, include_latest)[1]]
