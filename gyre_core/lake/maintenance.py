"""Lake maintenance over runs: retention, the file check and compaction (the `lake-maintenance` flow and
`gyre lake retain` run these).

    rows = retain(lake, days=30, keep=["baseline-s0"], dry_run=True)   # who would go, and why the rest stay
    check_run(lake, "quick-s0"); compact_run(lake, "quick-s0")

Retention deletes (`Lake.delete_run`), it quarantines nothing: a run goes when its newest commit (manifest
`written_at`; compactions do not count) is more than `days` old, unless it is kept by name, or it has
committed or written a part in the last hour (it may be running). Compaction skips a run with a part being
written (compaction first cleans up uncommitted parts, which would pull the files from under a writer).
"""
from __future__ import annotations

import time
from typing import Any

from gyre_core.config import ConfigError
from gyre_core.lake.compaction import compact, compactable
from gyre_core.lake.store import Lake

BUSY_S = 3600.0        # a run that committed or wrote a part this recently may be running


def check_days(days: float | None) -> None:
    if days is not None and not days > 0:
        raise ConfigError(f"retention_days: must be > 0 (days since a run's newest commit), got {days}")


def lake_runs(lake: Lake, runs: list[str] | None = None) -> list[str]:
    """The runs given, or every run with a committed part."""
    return list(runs) if runs is not None else lake.runs()


def _busy(usage: dict[str, Any], now: float) -> bool:
    times = [t for t in (usage["newest_commit"], usage["newest_uncommitted"]) if t is not None]
    return any(now - t < BUSY_S for t in times)


def _kept_because(usage: dict[str, Any], days: float, keep: set[str], now: float) -> str | None:
    if usage["files"] == 0:
        return "not in the lake"
    if usage["run_id"] in keep:
        return "in keep_runs"
    if _busy(usage, now):
        return "wrote a part in the last hour (may be running)"
    if usage["newest_commit"] is None:
        return "no commit time in its manifests"
    age = (now - usage["newest_commit"]) / 86400
    return f"newest commit {age:.2f} d old" if age <= days else None


def retain(lake: Lake, days: float, keep: list[str] | tuple[str, ...] = (), runs: list[str] | None = None,
           dry_run: bool = False, now: float | None = None) -> list[dict[str, Any]]:
    """Delete the runs older than `days` (not with `dry_run`). One row per run: `Lake.usage`'s fields,
    `age_days`, `action` ("deleted", "would delete" or "keep") and `reason`."""
    check_days(days)
    now = time.time() if now is None else now
    rows = []
    for run in lake_runs(lake, runs):
        usage = lake.usage(run)
        reason = _kept_because(usage, days, set(keep), now)
        age = None if usage["newest_commit"] is None else (now - usage["newest_commit"]) / 86400
        row = {**usage, "age_days": age, "action": "keep" if reason else "would delete" if dry_run else "deleted",
               "reason": reason or f"newest commit {age:.2f} d old > {days:g} d"}
        if reason is None and not dry_run:
            row.update(lake.delete_run(run))      # what was removed (the same files, unless one just appeared)
        rows.append(row)
    return rows


def check_run(lake: Lake, run: str, dry_run: bool = False) -> list[dict[str, Any]]:
    """Bad files of the run: quarantined (`Lake.check`), or only named with `dry_run`."""
    return lake.problems(run) if dry_run else lake.check(run)


def compact_run(lake: Lake, run: str, dry_run: bool = False, target_mb: float = 256.0,
                now: float | None = None) -> dict[str, Any]:
    """Merge the run's finished steps (`compaction.compact`); with `dry_run` name the parts it would merge."""
    now = time.time() if now is None else now
    usage = lake.usage(run)
    if usage["newest_uncommitted"] is not None and now - usage["newest_uncommitted"] < BUSY_S:
        return {"run_id": run, "skipped": "a part is being written", "parts": 0}
    if dry_run:
        parts = compactable(lake, run)
        return {"run_id": run, "would_merge": parts, "parts": len(parts)}
    return compact(lake, run, target_mb=target_mb)


def maintenance_report(lake_root: str, runs: list[str], retention: list[dict[str, Any]],
                       checks: dict[str, list], compactions: dict[str, dict], dry_run: bool) -> dict[str, Any]:
    """The flow's result: per run what happened, and the deleted runs with their bytes."""
    by_run = {r["run_id"]: r for r in retention}
    deleted = [r for r in retention if r["action"] != "keep"]
    return {"lake": lake_root, "dry_run": dry_run,
            "runs": {run: {"retention": by_run.get(run), "check": checks.get(run), "compaction": compactions.get(run)}
                     for run in runs},
            "deleted": [{k: r[k] for k in ("run_id", "parts", "files", "bytes", "age_days")} for r in deleted],
            "deleted_bytes": sum(r["bytes"] for r in deleted),
            "quarantined": [q for qs in checks.values() for q in qs]}


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def format_report(report: dict[str, Any]) -> str:
    """A short table: one line per run (retention, check, compaction), then the totals."""
    def retention(r):
        if r is None:
            return "-"
        if r["action"] == "keep":
            return f"kept: {r['reason']}"
        return f"{r['action']} ({r['age_days']:.1f} d, {_size(r['bytes'])})"

    def check(q):
        if q is None:
            return "-"
        return "ok" if not q else f"{len(q)} bad" + (" (dry run)" if report["dry_run"] else ", quarantined")

    def compaction(c):
        if c is None:
            return "-"
        if "skipped" in c:
            return f"skipped: {c['skipped']}"
        if "would_merge" in c:
            return f"would merge {c['parts']} parts" if c["parts"] else "nothing to merge"
        if not c["parts"]:
            return "nothing to merge"
        return f"{c['parts']} parts, {c['files_before']} -> {c['files_after']} files"

    rows = [(run, retention(v["retention"]), check(v["check"]), compaction(v["compaction"]))
            for run, v in report["runs"].items()]
    head = ("run", "retention", "check", "compaction")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [f"lake {report['lake']}" + ("  (dry run: nothing changed)" if report["dry_run"] else "")]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    n = len(report["deleted"])
    lines.append(f"{'would delete' if report['dry_run'] else 'deleted'} {n} run(s), {_size(report['deleted_bytes'])}"
                 f"; {len(report['quarantined'])} bad file(s)")
    return "\n".join(lines)
