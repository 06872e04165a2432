"""The trajectory lake: round trips, manifest commits, read-only SQL, and the same path on S3.

    .venv/bin/python -m pytest tests/core/test_lake.py -q -p no:cacheprovider
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from gyre_core.lake import (
    Lake,
    SqlError,
    SqlRefused,
    calls_table,
    connect,
    executions_table,
    read_executions,
    run_sql,
    step_part,
    train_tokens_table,
)
from gyre_core.records import SCHEMA_VERSION, CallRecord, ExecutionRecord


def _records(run_id: str = "run1", step: int = 3) -> list[ExecutionRecord]:
    """Hand-made token ids; log-probs are float32-representable so the round trip is exact."""
    p0 = [1, 2, 3]
    c0 = CallRecord("e1", 0, 0, "main", p0, [10, 11, 12], [-0.5, -0.25, -1.5], [0, 0, 1],
                    t_start=1.0, t_end=2.0)
    p1 = p0 + [10, 11, 12] + [4, 5]                      # appends to call 0's prompt + completion
    c1 = CallRecord("e1", 1, 0, "main", p1, [13, 14], [-2.0, -0.125], [1, 1],
                    parent_call=0, prefix_len=6, progress=0.375)
    # Context compaction mid-execution: a fresh context with no parent.
    p2 = [1, 2, 99, 98]
    c2 = CallRecord("e1", 2, 1, "main-summary", p2, [20], [-0.75], [1], parent_call=-1, prefix_len=0)
    p3 = p2 + [20, 6]
    c3 = CallRecord("e1", 3, 1, "main", p3, [21, 22], [-1.0, -3.0], [2, 2], parent_call=2, prefix_len=5,
                    finish_reason="length")
    # A fork of call 1 that keeps only 4 of its 10 prompt+completion tokens.
    p4 = p1[:4] + [7, 7]
    c4 = CallRecord("e1", 4, 2, "sub-agent", p4, [30], [-0.0625], [2], parent_call=1, prefix_len=4)
    e1 = ExecutionRecord(run_id, step, "e1", "task-a", 11, "train", "grid", status="done", reward=1.0,
                         success=True, partial=1.0, turns=4, compactions=1, policy_version=0,
                         t_start=0.5, t_end=9.5, evaluator_s=1.25, calls=[c0, c1, c2, c3, c4])
    e2 = ExecutionRecord(run_id, step, "e2", "task-a", 12, "train", "grid", status="timeout", reward=0.25,
                         partial=0.25, turns=1, invalid_actions=2, policy_version=1,
                         calls=[CallRecord("e2", 0, 0, "main", [1, 2], [40, 41, 42, 43], [-1.0] * 4, [1] * 4)])
    e3 = ExecutionRecord(run_id, step, "e3", "task-b", 13, "train", "grid", status="failed",
                         error="evaluator crashed", calls=[])
    return [e1, e2, e3]


def _tables(recs):
    return {"executions": executions_table(recs), "calls": calls_table(recs)}


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "lake")


def test_round_trip_exact(root):
    recs = _records()
    lake = Lake(root)
    lake.write_part("run1", step_part(3), _tables(recs))
    assert lake.read_records("run1") == recs
    # The stored prompt is only the part the parent does not supply.
    calls = lake.read("calls", "run1").to_pylist()
    assert [c["new_prompt_ids"] for c in calls] == [[1, 2, 3], [4, 5], [1, 2, 99, 98], [6], [7, 7], [1, 2]]
    assert [c["prompt_len"] for c in calls] == [3, 8, 4, 6, 6, 2]
    # The schema version travels in the Parquet metadata.
    for f in lake.files("calls") + lake.files("executions"):
        assert pq.read_schema(f).metadata[b"gyre.schema_version"] == str(SCHEMA_VERSION).encode()


def test_logprobs_are_float32():
    rec = _records()[1]
    rec.calls[0].logprobs = [-0.1] * 4
    back = read_executions(executions_table([rec]), calls_table([rec]))[0]
    assert back.calls[0].logprobs == [float(np.float32(-0.1))] * 4 != [-0.1] * 4


def test_bad_prefix_is_refused_at_write():
    rec = _records()[0]
    rec.calls[1].prefix_len = 0       # no parent contribution with a parent set is fine ...
    calls_table([rec])
    rec.calls[2].prefix_len = 2       # ... a prefix without a parent is not
    with pytest.raises(ValueError, match="without a parent"):
        calls_table([rec])


def test_uncommitted_part_is_invisible(root):
    lake = Lake(root)
    lake.write_part("run1", step_part(3), _tables(_records(step=3)))
    # A writer that died after its Parquet files and before its manifest.
    crashed = f"{lake.part_dir('run1', step_part(4))}"
    lake.fs.makedirs(crashed, exist_ok=True)
    for name, table in _tables(_records(step=4)).items():
        pq.write_table(table, f"{crashed}/{name}.parquet")
    assert not lake.committed("run1", "step=4") and lake.committed("run1", "step=3")
    assert lake.parts("run1") == ["step=3"]
    assert lake.read("executions").column("step").to_pylist() == [3, 3, 3]
    assert all("step=4" not in f for f in lake.files("calls"))
    assert run_sql(root, "SELECT count(*) AS n, min(step) AS lo, max(step) AS hi FROM calls",
                   fmt="csv") == "n,lo,hi\n6,3,3\n"
    with pytest.raises(SqlRefused):   # not even by naming it
        run_sql(root, f"SELECT count(*) FROM read_parquet('{crashed}/calls.parquet')")
    with pytest.raises(SqlError, match="No files found"):   # not served: only manifest-listed files are
        run_sql(root, "SELECT count(*) FROM read_parquet('gyrelake://runs/run1/step=4/calls.parquet')")


def test_rewrite_replaces_not_duplicates(root):
    lake = Lake(root)
    recs = _records()
    lake.write_part("run1", "step=3", _tables(recs))
    recs[0].reward = 0.5
    lake.write_part("run1", "step=3", _tables(recs))
    assert lake.read("executions").num_rows == 3
    assert lake.read("executions").column("reward").to_pylist()[0] == 0.5
    assert run_sql(root, "SELECT count(*) AS n FROM calls", fmt="json") == '[{"n": 6}]'
    # A retry that writes fewer tables leaves no stray file behind (and no temp files).
    lake.write_part("run1", "step=3", {"executions": executions_table(recs)})
    assert sorted(lake.fs.ls(lake.part_dir("run1", "step=3"), detail=False)) == [
        f"{lake.part_dir('run1', 'step=3')}/{n}" for n in ("_MANIFEST.json", "executions.parquet")]
    manifest = lake.manifest("run1", "step=3")
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["files"]["executions"]["rows"] == 3


def test_parts_and_runs(root):
    lake = Lake(root)
    for part in ["step=10", "step=-1", "eval=before", "step=2"]:
        lake.write_part("run1", part, _tables(_records()))
    lake.write_part("run0", "demos", _tables(_records("run0", -1)))
    assert lake.parts("run1") == ["step=-1", "step=2", "step=10", "eval=before"]
    assert lake.runs() == ["run0", "run1"]
    assert lake.read("executions").num_rows == 15
    assert lake.read("executions", part="demos").column("run_id").to_pylist() == ["run0"] * 3
    with pytest.raises(ValueError, match="invalid part"):
        lake.write_part("run1", "../escape", _tables(_records()))
    with pytest.raises(ValueError, match="column 'reward' should be double, is missing"):
        lake.write_part("run1", "step=5", {"executions": executions_table(_records()).drop_columns(["reward"])})
    assert not lake.committed("run1", "step=5")


def test_step_column_is_not_taken_from_the_part_label(root):
    # `step=N` directories look like hive partitions; the rows' own `step` must win (DuckDB would
    # otherwise auto-detect the partition and replace the column).
    lake = Lake(root)
    lake.write_part("run1", "step=3", _tables(_records(step=7)))
    lake.write_part("run1", "step=4", _tables(_records(step=-2)))
    assert sorted(set(lake.read("executions").column("step").to_pylist())) == [-2, 7]
    assert run_sql(root, "SELECT step, count(*) AS n FROM calls GROUP BY 1 ORDER BY 1", fmt="csv") == \
        "step,n\n-2,6\n7,6\n"


def test_unwritable_root_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="is not writable") as info:
        Lake(str(blocker / "lake")).check_writable()
    assert "\n" not in str(info.value)


def test_sql_aggregates(root):
    lake = Lake(root)
    lake.write_part("run1", "step=3", _tables(_records()))
    lake.write_part("run1", "step=3", {**_tables(_records()), "train_tokens": train_tokens_table([
        {"run_id": "run1", "step": 3, "execution_id": "e1", "call_index": 3, "advantage": 0.5,
         "n_tokens": 8, "n_trainable": 3, "weight": 1.0},
        {"run_id": "run1", "step": 3, "execution_id": "e1", "call_index": 4, "advantage": 0.5,
         "n_tokens": 7, "n_trainable": 1, "weight": 0.5}])})
    # Tokens generated per execution, by hand: e1 = 3+2+1+2+1 = 9, e2 = 4, e3 = 0.
    q = ("SELECT e.execution_id, e.tokens_generated, count(t.token_id) AS from_tokens "
         "FROM executions e LEFT JOIN tokens t USING (execution_id) GROUP BY ALL ORDER BY 1")
    assert json.loads(run_sql(root, q, fmt="json")) == [
        {"execution_id": "e1", "tokens_generated": 9, "from_tokens": 9},
        {"execution_id": "e2", "tokens_generated": 4, "from_tokens": 4},
        {"execution_id": "e3", "tokens_generated": 0, "from_tokens": 0}]
    # Tokens per policy version: v0 = 2, v1 = 1+2+1+4 = 8, v2 = 2+1 = 3; sum of e1's logprobs by hand.
    assert run_sql(root, "SELECT version, count(*) AS n FROM tokens GROUP BY 1 ORDER BY 1",
                   fmt="csv") == "version,n\n0,2\n1,8\n2,3\n"
    assert json.loads(run_sql(root, "SELECT sum(logprob) AS s FROM tokens WHERE execution_id = 'e1'",
                              fmt="json")) == [{"s": -9.1875}]
    assert json.loads(run_sql(root, "SELECT sum(n_trainable * weight) AS w FROM train_tokens",
                              fmt="json")) == [{"w": 3.5}]
    table = run_sql(root, "SELECT execution_id, status FROM executions ORDER BY 1")
    assert table.splitlines()[0].split() == ["execution_id", "status"] and "(3 rows)" in table


def test_empty_lake_has_typed_views(root):
    con = connect(root)
    assert con.execute("SELECT count(*) FROM calls").fetchone() == (0,)
    cols = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                            "WHERE table_name = 'calls'").fetchall())
    assert cols["completion_ids"] == "INTEGER[]" and cols["logprobs"] == "FLOAT[]"
    assert con.execute("SELECT count(*) FROM tokens").fetchone() == (0,)


def test_run_filter(root):
    lake = Lake(root)
    lake.write_part("run1", "step=3", _tables(_records("run1")))
    lake.write_part("run2", "step=3", _tables(_records("run2")))
    assert run_sql(root, "SELECT DISTINCT run_id FROM executions", run_id="run2", fmt="csv") == "run_id\nrun2\n"


@pytest.fixture
def committed_lake(tmp_path):
    root = str(tmp_path / "lake")
    Lake(root).write_part("run1", "step=3", _tables(_records()))
    (tmp_path / "secret.txt").write_text("outside the lake")
    return root, tmp_path


@pytest.mark.parametrize("query", [
    "CREATE TABLE t AS SELECT 1",
    "CREATE VIEW v AS SELECT 1",
    "ATTACH ':memory:' AS m",
    "ATTACH '{tmp}/other.duckdb' AS o",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
    "RESET enable_external_access",
    "SET allowed_directories = ['/']",
    "SELECT * FROM read_text('{tmp}/secret.txt')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('{tmp}/secret.txt')",
    "SELECT * FROM glob('/*')",
    "SELECT * FROM glob('{tmp}/*')",
    "SELECT * FROM glob('{root}/**')",
    "SELECT * FROM read_parquet('{root}/runs/run1/step=3/calls.parquet')",
])
def test_refused(committed_lake, query):
    root, tmp = committed_lake
    with pytest.raises(SqlRefused) as info:
        run_sql(root, query.format(tmp=tmp, root=root))
    assert "\n" not in str(info.value)
    assert not (tmp / "other.duckdb").exists()


def test_insert_has_nothing_to_write_into(committed_lake):
    root, _ = committed_lake
    with pytest.raises(SqlError, match="not an table"):       # the lake's tables are views
        run_sql(root, "INSERT INTO calls SELECT * FROM calls")
    with pytest.raises(SqlRefused, match="read-only mode"):   # and no table can be created to insert into
        run_sql(root, "CREATE TABLE main.x (a INT)")
    assert run_sql(root, "SELECT count(*) AS n FROM calls", fmt="csv") == "n\n6\n"


@pytest.mark.parametrize("target", ["{tmp}/out.csv", "{root}/out.parquet", "{root}/runs/run1/step=3/calls.parquet",
                                    "gyrelake://runs/run1/step=3/calls.parquet", "gyrelake://out.csv"])
def test_copy_to_is_refused(committed_lake, target):
    root, tmp = committed_lake
    lake = Lake(root)
    before = {f: open(f, "rb").read() for f in lake.files("calls")}
    dest = target.format(tmp=tmp, root=root)
    for opts in ("", " (FORMAT parquet, USE_TMP_FILE false)"):
        with pytest.raises(SqlRefused):
            run_sql(root, f"COPY (SELECT 1 AS x) TO '{dest}'{opts}")
    assert not (tmp / "out.csv").exists() and not (tmp / "lake" / "out.parquet").exists()
    assert {f: open(f, "rb").read() for f in lake.files("calls")} == before
    assert lake.read_records("run1") == _records()


# ---- the same path on an S3-compatible server on loopback --------------------------------------
@pytest.fixture
def s3_options(s3_server):
    import s3fs
    s3fs.S3FileSystem(**s3_server).makedirs("gyre-test", exist_ok=True)
    return s3_server


def test_s3_write_read_sql(s3_options):
    root = "s3://gyre-test/lake"
    lake = Lake(root, storage_options=s3_options)
    lake.check_writable()
    recs = _records()
    lake.write_part("run1", "step=3", _tables(recs))
    lake.write_part("run1", "step=3", _tables(recs))              # a retry: no duplicates
    lake.fs.pipe(f"{lake.part_dir('run1', 'step=4')}/calls.parquet", b"not committed")
    assert lake.parts("run1") == ["step=3"] and lake.runs() == ["run1"]
    assert lake.files("calls") == ["s3://gyre-test/lake/runs/run1/step=3/calls.parquet"]
    assert lake.read_records("run1") == recs
    q = "SELECT execution_id, count(*) AS n FROM tokens GROUP BY 1 ORDER BY 1"
    assert run_sql(root, q, fmt="csv", storage_options=s3_options) == "execution_id,n\ne1,9\ne2,4\n"
    for refused in ["COPY calls TO 'gyrelake://runs/run1/step=3/calls.parquet' (USE_TMP_FILE false)",
                    "CREATE TABLE t AS SELECT 1", "INSTALL httpfs",
                    "SELECT * FROM read_parquet('s3://gyre-test/lake/runs/run1/step=3/calls.parquet')"]:
        with pytest.raises(SqlRefused):
            run_sql(root, refused, storage_options=s3_options)
    assert lake.read_records("run1") == recs


class _FlakyS3:
    """A proxy in front of the S3 server that answers every `every`-th request with a 503 ("slow down",
    as S3 under load does) and holds every `every`-th + 1 back for `stall_s` seconds before forwarding it
    (longer than the client's read timeout): the transient errors and timeouts S3 clients must retry.
    At most `failures` of each, spread over the requests, so that the retries' backoff stays short."""

    def __init__(self, target: str, every: int = 3, stall_s: float = 1.0, failures: int = 6) -> None:
        import http.client
        import itertools
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        host, port = urlsplit(target).hostname, urlsplit(target).port
        counter, lock = itertools.count(1), threading.Lock()
        self.failed = self.stalled = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    n = next(counter)
                if n % every == 0 and outer.failed < failures:
                    outer.failed += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if n % every == 1 and n > 1 and outer.stalled < failures:
                    outer.stalled += 1
                    time.sleep(stall_s)
                conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request(self.command, self.path, body=body or None,
                             headers={k: v for k, v in self.headers.items() if k.lower() != "connection"})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():   # (a HEAD keeps its Content-Length: the object's size)
                    if k.lower() not in ("transfer-encoding", "connection") and (
                            k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.mark.fault("S3 errors: 503s and stalled requests", "retried by the client; the part is written once, "
                   "read back whole, and queries answer")
def test_an_s3_lake_through_503s_and_timeouts_keeps_every_row(s3_options):
    import s3fs

    flaky = _FlakyS3(s3_options["client_kwargs"]["endpoint_url"])
    try:
        options = {**s3_options, "client_kwargs": {"endpoint_url": flaky.url},
                   "config_kwargs": {"read_timeout": 0.5, "connect_timeout": 2,
                                     "retries": {"max_attempts": 10, "mode": "standard"}}}
        s3fs.S3FileSystem(**s3_options).makedirs("gyre-flaky", exist_ok=True)
        root = "s3://gyre-flaky/lake"
        lake = Lake(root, storage_options=options)
        lake.check_writable()
        recs = _records()
        lake.write_part("run1", "step=0", _tables(recs))
        assert lake.parts("run1") == ["step=0"]
        assert lake.read_records("run1") == recs
        q = "SELECT execution_id, count(*) AS n FROM tokens GROUP BY 1 ORDER BY 1"
        assert run_sql(root, q, fmt="csv", storage_options=options) == "execution_id,n\ne1,9\ne2,4\n"
        assert flaky.failed > 0 and flaky.stalled > 0          # the faults were met, and retried past
    finally:
        flaky.close()
    # what landed is exactly one committed part, read straight from the server
    direct = Lake(root, storage_options=s3_options)
    assert direct.parts("run1") == ["step=0"] and direct.read_records("run1") == recs
