"""The lake bench's generated call-row tables: valid lake tables whose planted duplicates are exactly
what the project's dedup (and the bench's handwritten baseline) collapse. No timings."""
from __future__ import annotations

import duckdb
import pyarrow.compute as pc

from bench.lake import HANDWRITTEN_DEDUP, lake_step_tables
from gyre_core.lake.dedup import dedup_executions
from gyre_core.lake.schema import CALLS, EXECUTIONS
from gyre_core.lake.sql import connect
from gyre_core.lake.store import Lake, step_part


def _write(root, steps=3, n_exec=120):
    lake = Lake(str(root))
    planted, expected, forks, n = 0, {}, 0, 0
    for step in range(steps):
        ex, calls, info = lake_step_tables(step, n_exec, calls_per_exec=6, dup_frac=0.15, fork_frac=0.3,
                                           group_size=4, context_calls=3, seed=7)
        assert ex.schema.equals(EXECUTIONS, check_metadata=False) and calls.schema.equals(CALLS, check_metadata=False)
        assert ex.num_rows == n_exec
        # every execution's stored calls are its call_index range from its fork point on
        per_exec = calls.group_by("execution_id").aggregate([("call_index", "min"), ("call_index", "count")])
        stored = dict(zip(per_exec["execution_id"].to_pylist(), zip(per_exec["call_index_min"].to_pylist(),
                                                                    per_exec["call_index_count"].to_pylist())))
        for e in ex.to_pylist():
            assert stored[e["execution_id"]] == (e["fork_call"], e["n_calls"] - e["fork_call"])
        assert pc.all(pc.equal(calls["prompt_len"], pc.add(calls["prefix_len"],
                                                          pc.list_value_length(calls["new_prompt_ids"])))).as_py()
        lake.write_part("bench", step_part(step), {"executions": ex, "calls": calls})
        planted += info["planted"]
        forks += info["forks"]
        expected.update(info["expected"])
        n += n_exec
    return lake, planted, expected, forks, n


def test_planted_duplicates_are_what_dedup_collapses(tmp_path):
    lake, planted, expected, forks, n = _write(tmp_path / "lake")
    assert planted > 0 and forks > 0 and any(m > 2 for m in expected.values())
    kept = dedup_executions(connect(str(tmp_path / "lake")), step=None)
    mult = dict(zip(kept["execution_id"].to_pylist(), kept["multiplicity"].to_pylist()))
    assert sum(mult.values()) == n and n - len(mult) == planted
    assert {i: m for i, m in mult.items() if m > 1} == expected

    # the bench's handwritten baseline gives the same answer from the files directly
    files = {t: lake.files(t, "bench") for t in ("executions", "calls")}
    hand = duckdb.connect().sql(HANDWRITTEN_DEDUP, params=files).to_arrow_table()
    assert dict(zip(hand["execution_id"].to_pylist(), hand["multiplicity"].to_pylist())) == mult


def test_generation_is_deterministic():
    a = lake_step_tables(2, 50, calls_per_exec=4, seed=3)
    b = lake_step_tables(2, 50, calls_per_exec=4, seed=3)
    assert a[0].equals(b[0]) and a[1].equals(b[1]) and a[2] == b[2]


def test_a_benchmark_missing_a_dev_package_says_so_in_one_line(monkeypatch, capsys):
    """After the README's first install (no dev extras), `gyre bench lake` named no install command."""
    import builtins

    from gyre_cli.main import main

    real_import = builtins.__import__

    def without_moto(name, *args, **kw):
        if name == "moto" or name.startswith("moto."):
            raise ModuleNotFoundError(f"No module named {name!r}", name="moto")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", without_moto)
    from bench import lake

    monkeypatch.setattr(lake, "_lake_figures", lambda *a, **k: {})     # straight to the S3 half
    assert main(["bench", "lake", "--quick", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "gyre bench lake: needs the package 'moto', a development extra: bash scripts/install.sh --dev"
