"""Lake maintenance: retention (delete runs whose newest commit is older than `retention_days`, never
those in `keep_runs` nor one that wrote in the last hour), then for every remaining run the file check
(bad files to quarantine) and compaction of finished steps. `dry_run` reports and changes nothing.

Run it from the `lake-maintenance` deployment (a weekly schedule), or `gyre lake check|compact|retain`.
"""
from __future__ import annotations

from prefect import flow

from gyre_core.config import load_config
from gyre_core.lake.maintenance import check_days, format_report, maintenance_report
from tasks import ops


@flow(name="gyre-lake-maintenance", flow_run_name="lake-maintenance", validate_parameters=True)
def lake_maintenance(preset: str = "default", overrides: list[str] | None = None, compact: bool = True,
                     retention_days: float | None = None, keep_runs: list[str] | None = None,
                     dry_run: bool = False, runs: list[str] | None = None) -> dict:
    overrides = list(overrides or [])
    cfg = load_config(preset, overrides)    # a bad parameter fails here, before any work
    check_days(retention_days)
    todo = ops.lake_runs(preset, overrides, runs)
    retention = [] if retention_days is None else \
        ops.retain(preset, overrides, todo, retention_days, list(keep_runs or []), dry_run)
    gone = {r["run_id"] for r in retention if r["action"] != "keep"}
    left = [r for r in todo if r not in gone]
    checks = {r: ops.check_run(preset, overrides, r, dry_run) for r in left}
    compactions = {r: ops.compact_run(preset, overrides, r, dry_run) for r in left} if compact else {}
    report = maintenance_report(cfg.lake.root, todo, retention, checks, compactions, dry_run)
    print(format_report(report))
    return report
