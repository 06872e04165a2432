"""The lake's storage guarantees, each run on local disk and on a real S3-compatible server on loopback
(moto's server mode): schema versions, offloaded payloads, quarantine of bad files, crash clean-up,
compaction, and roots refused before a run.

    .venv/bin/python -m pytest tests/core/test_lake_store.py -q -p no:cacheprovider
"""
from __future__ import annotations

import copy
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gyre_core.lake import Lake, connect, run_sql
from gyre_core.lake.compaction import compact
from gyre_core.lake.schema import ADDED_IN, CALLS, EXECUTIONS, SCORES
from gyre_core.lake.store import MANIFEST, LakeVersionError
from gyre_core.records import SCHEMA_VERSION

from test_lake import _records, _tables


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(root, storage_options) of an empty lake: a local directory, or a fresh prefix on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "lake"), None
    options = request.getfixturevalue("s3_server")           # tests/conftest.py
    import s3fs
    s3fs.S3FileSystem(**options).makedirs("gyre-store", exist_ok=True)
    return f"s3://gyre-store/{request.node.name.replace('[', '-').rstrip(']')}", options


def _lake(where, **kw) -> Lake:
    root, options = where
    return Lake(root, options, **kw)


def _sql(where, query: str) -> str:
    root, options = where
    return run_sql(root, query, fmt="csv", storage_options=options)


# ---- schema versions ------------------------------------------------------------------------------
def _as_version_1(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table as Gyre 1 wrote it: without the columns later versions added, version 1 in its metadata."""
    added = {c for cols in ADDED_IN.values() for c in cols}
    keep = [f.name for f in schema if f.name not in added]
    return table.select(keep).replace_schema_metadata({b"gyre.schema_version": b"1"})


def _write_raw_part(lake: Lake, run: str, part: str, tables: dict[str, pa.Table], version: int) -> None:
    """A part written file by file, as another version of Gyre would have."""
    d = lake.part_dir(run, part)
    lake.fs.makedirs(d, exist_ok=True)
    files = {}
    for name, t in tables.items():
        buf = io.BytesIO()
        pq.write_table(t, buf)
        lake.fs.pipe(f"{d}/{name}.parquet", buf.getvalue())
        files[name] = {"file": f"{name}.parquet", "rows": t.num_rows, "bytes": len(buf.getvalue())}
    body = {"format": "gyre-lake", "schema_version": version, "run_id": run, "part": part,
            "written_at": "2026-01-01T00:00:00+00:00", "files": files}
    lake.fs.pipe(f"{d}/{MANIFEST}", json.dumps(body).encode())


def test_version_1_lake_still_reads(where):
    lake = _lake(where)
    recs = _records("old")
    t = _tables(recs)
    _write_raw_part(lake, "old", "step=3", {"executions": _as_version_1(t["executions"], EXECUTIONS),
                                             "calls": _as_version_1(t["calls"], CALLS)}, version=1)
    lake.write_part("new", "step=3", _tables(_records("new")))           # and a version-2 part beside it
    back = lake.read_records("old")
    for r in recs:                    # what version 1 did not record reads as the defaults
        r.evaluator_s = 0.0
        for c in r.calls:
            c.progress = None
    assert back == recs                                   # tool_call_ids read as [] (the records have none)
    assert _sql(where, "SELECT run_id, count(*) AS n, count(payload_uri) AS offloaded, "
                       "count(tool_call_ids) AS with_ids FROM calls GROUP BY 1 ORDER BY 1") == \
        "run_id,n,offloaded,with_ids\nnew,6,0,6\nold,6,0,0\n"
    # a run whose files are all version 1 still has every column (NULL), so dedup's hash works on it
    root, options = where
    con = connect(root, run_id="old", storage_options=options)
    assert con.execute("SELECT count(*), count(payload_uri) FROM calls").fetchall() == [(6, 0)]
    assert con.execute("SELECT count(DISTINCT content_hash) FROM execution_content").fetchall() == [(3,)]


def test_newer_version_fails_naming_both(where):
    lake = _lake(where)
    t = _tables(_records())
    _write_raw_part(lake, "future", "step=3", t, version=SCHEMA_VERSION + 1)
    msg = f"written with lake schema version {SCHEMA_VERSION + 1}; this Gyre reads versions 1..{SCHEMA_VERSION}"
    with pytest.raises(LakeVersionError, match=msg):
        lake.read("executions", "future")
    with pytest.raises(LakeVersionError, match="upgrade Gyre"):
        lake.manifests()


def test_tool_call_ids_round_trip(where):
    recs = _records()
    recs[0].calls[1].tool_call_ids = ["e1/1", "e1/1b"]
    lake = _lake(where)
    lake.write_part("run1", "step=3", _tables(recs))
    assert lake.read_records("run1") == recs
    assert _sql(where, "SELECT call_index, len(tool_call_ids) AS n FROM calls WHERE execution_id = 'e1' "
                       "ORDER BY 1") == "call_index,n\n0,0\n1,2\n2,0\n3,0\n4,0\n"


# ---- payloads too large to inline -----------------------------------------------------------------
def test_large_prompts_are_offloaded_and_round_trip(where):
    lake = _lake(where, payload_bytes=12)                 # more than 3 new prompt ids goes out
    recs = _records()
    twin = copy.deepcopy(recs[0])                         # same prompts: one object serves both
    twin.execution_id = "e1-twin"
    for c in twin.calls:
        c.execution_id = "e1-twin"
    recs.append(twin)
    lake.write_part("run1", "step=3", _tables(recs))
    m = lake.manifest("run1", "step=3")
    # e1: call 2 (4 new ids) is offloaded; call 0 (3 ids) and the rest stay inline; e1-twin shares it.
    assert len(m["payloads"]) == 1 and m["payloads"][0].startswith("payloads/")
    assert lake.fs.exists(f"{lake.part_dir('run1', 'step=3')}/{m['payloads'][0]}")
    assert lake.read_records("run1") == recs
    rows = _sql(where, "SELECT execution_id, call_index, len(new_prompt_ids) AS n, payload_uri FROM calls "
                       "WHERE payload_uri IS NOT NULL ORDER BY 1, 2").splitlines()
    uri = f"runs/run1/step=3/{m['payloads'][0]}"
    assert rows == ["execution_id,call_index,n,payload_uri", f"e1,2,0,{uri}", f"e1-twin,2,0,{uri}"]
    # a retry of the same part keeps exactly the objects its new manifest lists
    lake.write_part("run1", "step=3", _tables(recs[1:2]))
    assert lake.manifest("run1", "step=3").get("payloads") is None
    assert not lake.fs.exists(f"{lake.part_dir('run1', 'step=3')}/payloads")


# ---- bad files are quarantined, the rest still answers ----------------------------------------------
@pytest.mark.fault("a truncated lake file", "set aside in _quarantine/ and named; queries answer")
def test_truncated_file_is_quarantined(where, capfd):
    lake = _lake(where)
    lake.write_part("run1", "step=3", _tables(_records()))
    lake.write_part("run1", "step=4", _tables(_records(step=4)))
    bad = f"{lake.part_dir('run1', 'step=3')}/calls.parquet"
    data = lake.fs.cat_file(bad)
    lake.fs.pipe(bad, data[: len(data) // 2])             # a writer cut off mid-file
    assert _sql(where, "SELECT step, count(*) AS n FROM calls GROUP BY 1 ORDER BY 1") == "step,n\n4,6\n"
    err = capfd.readouterr().err
    assert "runs/run1/step=3/calls.parquet" in err and "truncated" in err and "_quarantine" in err
    m = lake.manifest("run1", "step=3")
    q = m["quarantined"]["calls"]
    assert "calls" not in m["files"] and "executions" in m["files"] and "truncated" in q["reason"]
    moved = f"{lake.path}/{q['moved_to']}"
    assert lake.fs.cat_file(moved) == data[: len(data) // 2]          # nothing is lost
    assert json.loads(lake.fs.cat_file(moved + ".reason.json"))["source"] == "runs/run1/step=3/calls.parquet"
    assert lake.read("executions").num_rows == 6 and lake.read("calls").num_rows == 6


@pytest.mark.fault("a corrupt or mistyped lake file", "set aside and named; queries answer")
def test_corrupt_and_mismatched_files_are_named(where, capfd):
    lake = _lake(where)
    lake.write_part("run1", "step=3", _tables(_records()))
    lake.write_part("run1", "step=4", _tables(_records(step=4)))
    lake.write_part("run1", "score=3", {"scores": SCORES.empty_table()})
    # step=4's executions file is replaced by garbage of the same length; score=3's by a file whose
    # `reward` column is a string
    d4 = lake.part_dir("run1", "step=4")
    size = lake.fs.size(f"{d4}/executions.parquet")
    lake.fs.pipe(f"{d4}/executions.parquet", b"x" * size)
    wrong = pa.table({f.name: pa.array([], type=pa.string() if f.name == "reward" else f.type) for f in SCORES})
    _write_raw_part(lake, "run1", "score=3", {"scores": wrong}, version=SCHEMA_VERSION)
    found = lake.check()
    assert sorted((q["part"], q["table"]) for q in found) == [("score=3", "scores"), ("step=4", "executions")]
    reasons = {q["table"]: q["reason"] for q in found}
    assert "not a readable Parquet file" in reasons["executions"]
    assert reasons["scores"] == "schema mismatch: column 'reward' should be double, is string"
    err = capfd.readouterr().err
    assert "runs/run1/step=4/executions.parquet" in err and "runs/run1/score=3/scores.parquet" in err
    assert _sql(where, "SELECT step, count(*) AS n FROM executions GROUP BY 1") == "step,n\n3,3\n"
    assert lake.check() == []                              # nothing more to find


# ---- what a crashed writer leaves behind ------------------------------------------------------------
def test_cleanup_removes_leftovers_only(where):
    lake = _lake(where)
    recs = _records()
    lake.write_part("run1", "step=3", _tables(recs))
    lake.write_part("run2", "step=0", _tables(_records("run2", 0)))
    d3, d4 = lake.part_dir("run1", "step=3"), lake.part_dir("run1", "step=4")
    lake.fs.pipe(f"{d3}/calls.parquet.tmp-123", b"half")   # a temp file of a dead writer
    lake.fs.makedirs(d4, exist_ok=True)
    lake.fs.pipe(f"{d4}/executions.parquet", b"never committed")
    assert lake.cleanup("run1") == {"uncommitted_parts": 1, "stray_files": 1, "compactions_finished": 0}
    assert not lake.fs.exists(d4) and not lake.fs.exists(f"{d3}/calls.parquet.tmp-123")
    assert lake.read_records("run1") == recs and lake.read("executions", "run2").num_rows == 3
    assert lake.cleanup("run1") == {"uncommitted_parts": 0, "stray_files": 0, "compactions_finished": 0}
    # the uncommitted part's whole Parquet file was moved aside, not deleted (it might have been committed)
    [aside] = lake.fs.glob(f"{lake.path}/_quarantine/run1/step=4/*/executions.parquet")
    assert lake.fs.cat_file(aside) == b"never committed"


@pytest.mark.fault("a damaged or lost lake manifest", "set aside and named, never a reason to delete committed files")
def test_a_damaged_or_lost_manifest_is_set_aside_and_named_never_a_reason_to_delete(where, capfd):
    """A truncated manifest made every query, `gyre lake check` and resume fail with a JSON error naming no
    file; a deleted one made resume's clean-up delete the part's intact Parquet files."""
    lake = _lake(where)
    lake.write_part("run1", "step=0", _tables(_records("run1", 0)))
    lake.write_part("run1", "step=1", _tables(_records("run1", 1)))
    lake.write_part("run1", "step=2", _tables(_records("run1", 2)))
    d0, d1 = lake.part_dir("run1", "step=0"), lake.part_dir("run1", "step=1")
    files1 = {f.rsplit("/", 1)[-1]: lake.fs.cat_file(f) for f in lake.fs.ls(d1, detail=False) if f.endswith(".parquet")}
    m0 = lake.fs.cat_file(f"{d0}/{MANIFEST}")
    lake.fs.pipe(f"{d0}/{MANIFEST}", m0[: len(m0) // 2])          # truncated
    lake.fs.rm_file(f"{d1}/{MANIFEST}")                            # lost
    # queries answer from what is intact, and the damaged manifest is named
    assert _sql(where, "SELECT step, count(*) AS n FROM executions GROUP BY 1 ORDER BY 1") == "step,n\n2,3\n"
    err = capfd.readouterr().err
    assert "runs/run1/step=0" in err and "damaged manifest" in err
    assert lake.check() == [] and lake.parts("run1") == ["step=2"]
    # a run's start-up clean-up sets step 1's intact files aside, byte for byte, with the reason
    lake.cleanup("run1")
    moved = {f.rsplit("/", 1)[-1]: lake.fs.cat_file(f) for f in lake.fs.glob(f"{lake.path}/_quarantine/run1/step=1/*/*.parquet")}
    assert moved == files1 and len(files1) >= 2
    [why] = lake.fs.glob(f"{lake.path}/_quarantine/run1/step=1/*/reason.json")
    assert "without a manifest" in json.loads(lake.fs.cat_file(why))["reason"]
    [m] = lake.fs.glob(f"{lake.path}/_quarantine/run1/step=0/*/{MANIFEST}")
    assert lake.fs.cat_file(m) == m0[: len(m0) // 2]


# ---- compaction ---------------------------------------------------------------------------------------
QUERIES = [
    "SELECT step, execution_id, reward, n_calls FROM executions ORDER BY ALL",
    "SELECT step, execution_id, call_index, new_prompt_ids, completion_ids, logprobs, versions, payload_uri "
    "FROM calls ORDER BY ALL",
    "SELECT step, count(*) AS n, sum(logprob) AS lp FROM tokens GROUP BY 1 ORDER BY 1",
    "SELECT step, execution_id, advantage FROM scores ORDER BY ALL",
]


def _rl_run(lake: Lake, run: str, steps: int) -> None:
    for s in range(steps):
        recs = _records(run, s)
        lake.write_part(run, f"step={s}", _tables(recs))
        scores = pa.Table.from_pydict({
            "run_id": [run] * 3, "step": [s] * 3, "execution_id": ["e1", "e2", "e3"],
            "task_id": ["task-a", "task-a", "task-b"], "reward": [1.0, 0.25, 0.0],
            "advantage": [0.375, -0.375, None], "excluded": [False, False, True], "reason": ["", "", "failed"],
            "multiplicity": [1, 1, 1], "kept_as": ["e1", "e2", "e3"]}, schema=SCORES)
        lake.write_part(run, f"score={s}", {"scores": scores})
    lake.write_part(run, "eval-before", _tables(_records(run, -2)))


def test_compaction_keeps_query_results(where):
    lake = _lake(where, payload_bytes=12)
    _rl_run(lake, "run1", 4)
    _rl_run(lake, "run2", 2)
    before = [_sql(where, q) for q in QUERIES]
    per_part = {p: lake.read_records("run1", p) for p in ("step=0", "step=2", "step=3")}
    report = compact(lake, "run1")
    # steps 0..2 merged (step 3 is the run's newest, maybe in flight; eval-before is not a step)
    (c,) = report["compactions"]
    assert sorted(c["covers"]) == sorted(f"{k}={s}" for k in ("step", "score") for s in range(3))
    assert c["rows"] == {"executions": 9, "calls": 18, "scores": 9}
    # 3 × (executions, calls) + 3 × scores -> 3 (offloaded prompts stay where their URIs point)
    assert report["files_before"] == 9 and report["files_after"] == 3
    assert [_sql(where, q) for q in QUERIES] == before
    assert {p: lake.read_records("run1", p) for p in per_part} == per_part
    assert lake.read("scores", "run1", "score=1").column("step").to_pylist() == [1, 1, 1]
    assert lake.committed("run1", "step=1") and lake.manifest("run1", "step=1")["files"] == {}
    d1 = lake.part_dir("run1", "step=1")
    assert sorted(lake.fs.ls(d1, detail=False)) == [f"{d1}/{MANIFEST}", f"{d1}/payloads"]
    with pytest.raises(ValueError, match="compacted into"):
        lake.write_part("run1", "step=1", _tables(_records("run1", 1)))
    assert compact(lake, "run1")["compactions"] == []       # nothing new to merge
    more = compact(lake, "run1", include_latest=True)        # the run is over: its last step too
    assert more["parts"] == 2 and [_sql(where, q) for q in QUERIES] == before
    # the merged files are gone, not kept aside: a compaction frees their space (and a clean-up after it too)
    lake.cleanup("run1")
    assert not lake.fs.exists(f"{lake.path}/_quarantine")


def test_interrupted_compaction_never_shows_rows_twice(where):
    lake = _lake(where)
    _rl_run(lake, "run1", 3)
    before = [_sql(where, q) for q in QUERIES]
    real = Lake._retire_covered
    Lake._retire_covered = lambda self, *a: 0              # die right after the compaction's commit
    try:
        compact(lake, "run1")
    finally:
        Lake._retire_covered = real
    assert lake.manifest("run1", "step=0")["files"]        # the old files are still listed ...
    assert [_sql(where, q) for q in QUERIES] == before       # ... yet no row is read twice
    assert lake.read_records("run1", "step=1") == _records("run1", 1)
    assert lake.cleanup("run1")["compactions_finished"] == 4
    assert lake.manifest("run1", "step=0")["files"] == {} and [_sql(where, q) for q in QUERIES] == before


def test_parts_whose_rows_carry_another_step_are_left_alone(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    lake.write_part("run1", "step=0", _tables(_records(step=7)))    # rows not of step 0
    lake.write_part("run1", "step=1", _tables(_records(step=1)))
    lake.write_part("run1", "step=2", _tables(_records(step=2)))
    report = compact(lake, "run1")
    assert report["compactions"][0]["covers"] == ["step=1"]
    assert sorted(set(lake.read("executions").column("step").to_pylist())) == [1, 2, 7]


# ---- roots refused before a run starts ----------------------------------------------------------------
@pytest.mark.bad_input("a lake root that is not there")
def test_missing_roots_are_refused(tmp_path, s3_server):
    with pytest.raises(ValueError, match="neither it nor its parent directory"):
        Lake(str(tmp_path / "no" / "such" / "lake")).check_writable()
    Lake(str(tmp_path / "fresh")).check_writable()          # a new directory in an existing one is fine
    home = tmp_path / "home"                                  # inside an existing Gyre home, any depth is
    with pytest.raises(ValueError, match="neither it nor its parent directory"):
        Lake(str(home / "data" / "lake")).check_writable(home=str(home))     # (the home itself must exist)
    home.mkdir()
    Lake(str(home / "data" / "lake")).check_writable(home=str(home))
    assert (home / "data" / "lake").is_dir()
    with pytest.raises(ValueError, match="neither it nor its parent directory"):   # outside it, still a typo
        Lake(str(tmp_path / "elsewhere" / "lake")).check_writable(home=str(home))
    with pytest.raises(ValueError, match="bucket 'no-such-bucket' does not exist"):
        Lake("s3://no-such-bucket/lake", s3_server).check_writable()
    import s3fs
    assert not s3fs.S3FileSystem(**s3_server).exists("no-such-bucket")   # and it was not created


def test_lake_command(tmp_path, capsys):
    from gyre_cli.main import main

    root = str(tmp_path / "lake")
    lake = Lake(root)
    _rl_run(lake, "run1", 3)
    before = [run_sql(root, q, fmt="csv") for q in QUERIES]
    assert main(["lake", "compact", "--lake", root, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["run_id"] == "run1" and report["parts"] == 4 and report["files_after"] == 3
    assert [run_sql(root, q, fmt="csv") for q in QUERIES] == before
    lake.fs.pipe(f"{lake.part_dir('run1', 'step=2')}/calls.parquet", b"junk")
    assert main(["lake", "check", "--lake", root, "--json"]) == 0
    (q,) = json.loads(capsys.readouterr().out)
    assert (q["part"], q["table"]) == ("step=2", "calls") and "bytes, its manifest says" in q["reason"]
    assert main(["lake", "cleanup", "--lake", root]) == 2
    assert "cleanup needs --run" in capsys.readouterr().err


# ---- DuckDB's threads share one file handle -------------------------------------------------------------
def test_positional_reader_serves_concurrent_threads(where):
    """DuckDB reads a shared handle from several threads as seek() + read() pairs; every thread must get
    the bytes at its own position (a plain file object mixed them up: short reads, wrong sums)."""
    import random
    import threading

    from gyre_core.lake.sql import PositionalReader

    lake = _lake(where)
    data = bytes(random.Random(0).getrandbits(8) for _ in range(1 << 16))
    path = f"{lake.path}/blob.bin"
    lake.fs.makedirs(lake.path, exist_ok=True)
    lake.fs.pipe(path, data)
    reader = PositionalReader(lake.fs, path, len(data))
    bad = []

    def work(seed):
        rng = random.Random(seed)
        for _ in range(200):
            at, n = rng.randrange(len(data)), rng.randrange(1, 5000)
            reader.seek(at)
            got = reader.read(n)
            if got != data[at:at + n] or reader.tell() != at + len(got):
                bad.append((seed, at, n))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader.seek(-10, 2)
    assert bad == [] and reader.read() == data[-10:] and reader.read(5) == b""
    reader.close()


def test_sql_sums_are_exact_on_files_of_many_row_groups(tmp_path):
    """The case that broke: DuckDB's worker threads scanning the row groups of one file at once (a plain
    file object gave Thrift errors, row-count mismatches and wrong sums in most of these queries)."""
    import numpy as np

    lake = Lake(str(tmp_path / "lake"))
    rng = np.random.default_rng(0)
    expect = {}
    for step in range(4):
        n = 100_000
        lens = rng.integers(1, 10, n)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ids = pa.ListArray.from_arrays(pa.array(offsets),
                                       pa.array(rng.integers(0, 1 << 20, offsets[-1], dtype=np.int32)))
        cols = {"run_id": pa.array(["big"] * n), "step": pa.array(np.full(n, step)),
                "execution_id": pa.array([f"e{i // 50}" for i in range(n)]),
                "call_index": pa.array(np.arange(n, dtype=np.int32) % 50),
                "prompt_len": pa.array(lens.astype(np.int32)), "new_prompt_ids": ids}
        t = pa.table({f.name: cols.get(f.name, pa.nulls(n, f.type)) for f in CALLS}, schema=CALLS)
        buf = io.BytesIO()
        pq.write_table(t, buf, row_group_size=10_000)          # ten row groups a file
        d = lake.part_dir("big", f"step={step}")
        lake.fs.makedirs(d, exist_ok=True)
        lake.fs.pipe(f"{d}/calls.parquet", buf.getvalue())
        lake.fs.pipe(f"{d}/{MANIFEST}", json.dumps({
            "format": "gyre-lake", "schema_version": SCHEMA_VERSION, "run_id": "big", "part": f"step={step}",
            "written_at": "2026-01-01T00:00:00+00:00",
            "files": {"calls": {"file": "calls.parquet", "rows": n, "bytes": len(buf.getvalue())}}}).encode())
        expect[step] = (int(lens.sum()), int(np.asarray(ids.values, dtype=np.int64).sum()))
    q = ("SELECT step, sum(prompt_len)::BIGINT AS a, sum(list_sum(new_prompt_ids::BIGINT[]))::BIGINT AS b "
         "FROM calls GROUP BY 1 ORDER BY 1")
    want = "step,a,b\n" + "".join(f"{s},{a},{b}\n" for s, (a, b) in expect.items())
    for _ in range(5):
        assert run_sql(str(tmp_path / "lake"), q, fmt="csv") == want


# ---- retention: deleting whole runs ---------------------------------------------------------------------
def _age(lake: Lake, run: str, days: float) -> None:
    """Make every commit of a run `days` old (as if written then)."""
    from datetime import datetime, timedelta, timezone

    when = (datetime.now(timezone.utc) - timedelta(days=days)).isoformat()
    for part in lake.parts(run):
        path = f"{lake.part_dir(run, part)}/{MANIFEST}"
        body = json.loads(lake.fs.cat_file(path))
        lake.fs.pipe(path, json.dumps({**body, "written_at": when}).encode())


def test_delete_run_uncommits_first_then_removes_every_file(where, monkeypatch):
    lake = _lake(where, payload_bytes=12)                  # offloaded payloads too
    _rl_run(lake, "run1", 3)
    _rl_run(lake, "run2", 2)
    compact(lake, "run1")                                   # a compaction part and covered parts
    lake.fs.makedirs(lake.part_dir("run1", "step=9"), exist_ok=True)
    lake.fs.pipe(f"{lake.part_dir('run1', 'step=9')}/executions.parquet", b"an uncommitted part")
    others = _sql(where, "SELECT run_id, step, execution_id, reward FROM executions WHERE run_id = 'run2' ORDER BY ALL")
    run_dir = f"{lake.path}/runs/run1"
    n_bytes = lake.fs.du(run_dir)                          # what the filesystem itself says
    n_files = len(lake.fs.find(run_dir))
    committed = lake.parts("run1")
    assert len(committed) == 8                             # 3 × (step, score) + eval-before + compaction
    seen = []
    real_rm = lake.fs.rm

    def rm(path, *a, **kw):                                # what a reader sees after each removal
        real_rm(path, *a, **kw)
        seen.append((path, lake.runs(), lake.read("executions", "run1").num_rows,
                     lake.fs.exists(f"{lake.part_dir('run1', 'eval-before')}/executions.parquet")))

    monkeypatch.setattr(lake.fs, "rm", rm)
    report = lake.delete_run("run1")
    assert report == {"run_id": "run1", "parts": 8, "files": n_files, "bytes": n_bytes}
    first_path, runs_then, rows_then, files_still_there = seen[0]
    assert sorted(first_path) == sorted(f"{lake.part_dir('run1', p)}/{MANIFEST}" for p in committed)
    assert runs_then == ["run2"] and rows_then == 0 and files_still_there   # gone for readers, files not yet
    assert not lake.fs.exists(run_dir) and lake.runs() == ["run2"]
    assert _sql(where, "SELECT run_id, step, execution_id, reward FROM executions ORDER BY ALL") == others
    assert lake.delete_run("run1") == {"run_id": "run1", "parts": 0, "files": 0, "bytes": 0}


def test_retention_deletes_only_old_runs(tmp_path):
    import os
    import time

    from gyre_core.lake.maintenance import compact_run, retain

    lake = Lake(str(tmp_path / "lake"))
    for run, days in (("old", 10), ("kept", 10), ("young", 2), ("fresh", 0.5 / 24), ("inflight", 10)):
        _rl_run(lake, run, 2)
        _age(lake, run, days)
    d = lake.part_dir("inflight", "step=2")                # a writer at work: files, no manifest yet
    lake.fs.makedirs(d, exist_ok=True)
    lake.fs.pipe(f"{d}/executions.parquet", b"being written")
    files = {p: os.path.getsize(p) for p in map(str, tmp_path.rglob("*")) if os.path.isfile(p)}
    old_bytes = sum(s for p, s in files.items() if "/runs/old/" in p)

    plan = {r["run_id"]: r for r in retain(lake, 5, keep=["kept"], dry_run=True)}
    assert {r: plan[r]["action"] for r in plan} == {"old": "would delete", "kept": "keep", "young": "keep",
                                                    "fresh": "keep", "inflight": "keep"}
    assert plan["old"]["bytes"] == old_bytes and plan["old"]["age_days"] == pytest.approx(10, abs=1e-3)
    assert plan["kept"]["reason"] == "in keep_runs" and plan["young"]["reason"] == "newest commit 2.00 d old"
    assert plan["inflight"]["reason"].startswith("wrote a part in the last hour")
    assert {p: os.path.getsize(p) for p in map(str, tmp_path.rglob("*")) if os.path.isfile(p)} == files

    # a retention shorter than an hour still spares a run that committed 30 minutes ago
    (fresh,) = retain(lake, 0.01, runs=["fresh"])
    assert fresh["action"] == "keep" and fresh["reason"].startswith("wrote a part in the last hour")
    assert compact_run(lake, "inflight") == {"run_id": "inflight", "skipped": "a part is being written", "parts": 0}

    done = {r["run_id"]: r for r in retain(lake, 5, keep=["kept"], now=time.time())}
    assert [r for r in done if done[r]["action"] == "deleted"] == ["old"] and done["old"]["bytes"] == old_bytes
    assert sorted(lake.runs()) == ["fresh", "inflight", "kept", "young"]
    assert not (tmp_path / "lake" / "runs" / "old").exists() and not (tmp_path / "lake" / "_quarantine").exists()


def test_lake_retain_command(tmp_path, capsys):
    from gyre_cli.main import main

    root = str(tmp_path / "lake")
    lake = Lake(root)
    for run, days in (("old", 40), ("kept", 40), ("young", 3)):
        _rl_run(lake, run, 1)
        _age(lake, run, days)
    assert main(["lake", "retain", "--lake", root, "--days", "30", "--keep", "kept", "--dry-run", "--json"]) == 0
    rows = {r["run_id"]: r["action"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {"old": "would delete", "kept": "keep", "young": "keep"} and len(lake.runs()) == 3
    assert main(["lake", "retain", "--lake", root, "--days", "30", "--keep", "kept"]) == 0
    assert "deleted 1 run(s)" in capsys.readouterr().err and lake.runs() == ["kept", "young"]
    assert main(["lake", "retain", "--lake", root]) == 2
    assert "retain needs --days" in capsys.readouterr().err
