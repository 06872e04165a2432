"""The SQL surface of the lake: the `steps` view, the named queries in gyre_core/lake/queries/ (package data),
`gyre sql`, and refusals.

    .venv/bin/python -m pytest tests/core/test_sql.py -q -p no:cacheprovider

One hand-made lake (two runs, RL steps, score/process parts, demos and evaluations, a failed, a timed-out
and limit-reached executions, duplicates, train_tokens and scores) is written once; every expected value
below is worked out by hand from it.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gyre_cli.main import main
from gyre_core.lake import (
    SCHEMAS,
    Lake,
    SqlError,
    SqlRefused,
    calls_table,
    connect,
    executions_table,
    run_sql,
    train_tokens_table,
)
from gyre_core.lake import sql as lake_sql
from gyre_core.lake.dedup import dedup_executions
from gyre_core.lake.sql import named_queries, named_query, sql_dir
from gyre_core.records import CallRecord, ExecutionRecord

QUERIES = ("duplicates", "failure_reasons", "longest_executions", "step_summary", "timeouts", "tokens_trained")


# ---- the hand-made lake -------------------------------------------------------------------------
def _call(eid, i, prompt, completion, t0, t1, parent=-1, prefix=0, finish="stop"):
    return CallRecord(eid, i, 0, "main", prompt, completion, [-0.5] * len(completion), [1] * len(completion),
                      finish_reason=finish, parent_call=parent, prefix_len=prefix, t_start=t0, t_end=t1)


def _two_calls(eid, t0=0.0):
    """The same token content for every execution that uses it (a1, a2, a3): 3 + 1 tokens generated."""
    return [_call(eid, 0, [1, 2], [5, 6, 7], t0, t0 + 2.0),
            _call(eid, 1, [1, 2, 5, 6, 7, 8], [9], t0 + 3.0, t0 + 4.0, parent=0, prefix=5)]


def _ex(run, step, eid, task, t0, t1, status="done", error="", reward=0.0, success=False, partial=0.0,
        calls=(), split="train", version=0, turns=1):
    return ExecutionRecord(run, step, eid, task, 7, split, "grid", status=status, error=error, reward=reward,
                           success=success, partial=partial, turns=turns, policy_version=version,
                           t_start=t0, t_end=t1, calls=list(calls))


def _r1_step1():
    return [
        # task t1: a1 and a2 are the same execution twice; a3 has the same tokens but timed out
        _ex("r1", 1, "a1", "t1", 0.0, 10.0, reward=1.0, success=True, partial=1.0, calls=_two_calls("a1")),
        _ex("r1", 1, "a2", "t1", 0.0, 8.0, reward=1.0, success=True, partial=1.0, calls=_two_calls("a2")),
        _ex("r1", 1, "a3", "t1", 0.0, 6.0, status="timeout", reward=0.5, partial=0.5, calls=_two_calls("a3")),
        # task t2: two failures with no calls (identical, so collapsible) and one that hit the turn limit
        _ex("r1", 1, "b1", "t2", 0.0, 1.0, status="failed", error="env crashed"),
        _ex("r1", 1, "b2", "t2", 0.0, 2.0, status="failed", error="env crashed"),
        _ex("r1", 1, "b3", "t2", 0.0, 30.0, status="turn_limit", partial=0.25, turns=9,
            calls=[_call("b3", 0, [3], [4, 4], 1.0, 3.0, finish="length")]),
    ]


def _r1_step2():
    return [
        _ex("r1", 2, "d1", "t1", 0.0, 5.0, reward=1.0, success=True, partial=1.0,
            calls=[_call("d1", 0, [1], [2], 0.0, 1.0)]),
        _ex("r1", 2, "d2", "t1", 0.0, 20.0, status="token_limit", partial=0.5,
            calls=[_call("d2", 0, [1], [3, 3, 3, 3, 3], 0.0, 15.0, finish="length")]),
        _ex("r1", 2, "d3", "t3", 0.0, 0.5, status="failed", error="sandbox lost"),
    ]


def _scores(rows):
    return pa.Table.from_pylist([dict(zip(("run_id", "step", "execution_id", "task_id", "reward", "advantage",
                                           "excluded", "reason"), r)) for r in rows], schema=SCHEMAS["scores"])


SCORES_1 = [("r1", 1, "a1", "t1", 1.0, 0.25, False, ""), ("r1", 1, "a2", "t1", 1.0, 0.25, False, ""),
            ("r1", 1, "a3", "t1", 0.5, -0.5, False, ""), ("r1", 1, "b1", "t2", None, None, True, "env crashed"),
            ("r1", 1, "b2", "t2", None, None, True, "env crashed"), ("r1", 1, "b3", "t2", 0.25, 0.0, False, "")]


def _train(rows):
    keys = ("run_id", "step", "execution_id", "call_index", "advantage", "n_tokens", "n_trainable", "weight")
    return train_tokens_table([dict(zip(keys, r)) for r in rows])


TRAIN_1 = [("r1", 1, "a1", 1, 0.25, 8, 4, 1.0), ("r1", 1, "a1", 0, 0.25, 6, 1, 0.5),
           ("r1", 1, "a3", 1, -0.5, 7, 3, 1.0), ("r1", 1, "b3", 0, 0.0, 3, 2, 0.25)]
TRAIN_2 = [("r1", 2, "d1", 0, 0.5, 2, 1, 1.0)]


def _r2():
    demos = [_ex("r2", -1, "m1", "demo-task", 0.0, 2.0, reward=1.0, success=True, split="demo",
                 calls=[_call("m1", 0, [1], [2, 3], 0.0, 1.0)])]
    before = [_ex("r2", -2, "v1", "seed1", 0.0, 3.0, reward=1.0, success=True, split="eval-sampled"),
              _ex("r2", -2, "v2", "seed2", 0.0, 4.0, status="turn_limit", split="eval-sampled")]
    after = [_ex("r2", -2, "w1", "seed1", 0.0, 2.5, reward=1.0, success=True, split="eval-sampled", version=3,
                 calls=[_call("w1", 0, [1], [4], 0.0, 2.0)])]
    final = [_ex("r2", -3, "f1", "seed9", 0.0, 1.5, split="eval-final")]
    # twelve one-second executions of different tasks: enough that longest_executions has to cut at 20
    step1 = [_ex("r2", 1, f"s{i:02d}", f"task{i:02d}", 0.0, 1.0, reward=float(i % 2), success=bool(i % 2))
             for i in range(12)]
    return {"demos": demos, "eval-before": before, "eval-after": after, "eval=final": final, "step=1": step1}


def _tables(recs):
    return {"executions": executions_table(recs), "calls": calls_table(recs)}


@pytest.fixture(scope="module")
def lake_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sql") / "lake")
    lake = Lake(root)
    lake.write_part("r1", "step=1", _tables(_r1_step1()))
    lake.write_part("r1", "step=2", _tables(_r1_step2()))
    lake.write_part("r1", "score=1", {"scores": _scores(SCORES_1)})
    lake.write_part("r1", "process=1", {"train_tokens": _train(TRAIN_1)})
    lake.write_part("r1", "process=2", {"train_tokens": _train(TRAIN_2)})
    for part, recs in _r2().items():
        lake.write_part("r2", part, _tables(recs))
    # a writer that died before its manifest: neither its rows nor its part may show anywhere
    crashed = lake.part_dir("r1", "step=3")
    lake.fs.makedirs(crashed, exist_ok=True)
    pq.write_table(executions_table(_r1_step2()), f"{crashed}/executions.parquet")
    return root


def _json(root, query, **kw):
    return json.loads(run_sql(root, query, fmt="json", **kw))


def _named(root, name, **kw):
    return _json(root, named_query(name), **kw)


def _pick(rows, *cols):
    return [tuple(r[c] for c in cols) for r in rows]


# ---- steps ------------------------------------------------------------------------------------------
def test_steps_view(lake_root):
    rows = _json(lake_root, "SELECT * FROM steps")
    assert _pick(rows, "run_id", "part", "kind", "step", "tables", "rows") == [
        # r1: step parts in numeric order, then the other labels alphabetically (the lake's order)
        ("r1", "step=1", "step", 1, ["calls", "executions"], 6 + 7),       # 7 calls: a1 2, a2 2, a3 2, b3 1
        ("r1", "step=2", "step", 2, ["calls", "executions"], 3 + 2),
        ("r1", "process=1", "process", 1, ["train_tokens"], 4),
        ("r1", "process=2", "process", 2, ["train_tokens"], 1),
        ("r1", "score=1", "score", 1, ["scores"], 6),
        ("r2", "step=1", "step", 1, ["calls", "executions"], 12),
        ("r2", "demos", "demos", None, ["calls", "executions"], 2),
        ("r2", "eval-after", "eval-after", None, ["calls", "executions"], 2),
        ("r2", "eval-before", "eval-before", None, ["calls", "executions"], 2),
        ("r2", "eval=final", "eval", None, ["calls", "executions"], 1),
    ]
    lake = Lake(lake_root)
    for r in rows:     # bytes, time and version are the manifest's (and the bytes are the files' sizes)
        m = lake.manifest(r["run_id"], r["part"])
        sizes = [os.path.getsize(f"{lake.part_dir(r['run_id'], r['part'])}/{f['file']}") for f in m["files"].values()]
        assert r["bytes"] == sum(f["bytes"] for f in m["files"].values()) == sum(sizes)
        written = datetime.fromisoformat(m["written_at"]).astimezone(timezone.utc).replace(tzinfo=None)
        assert r["written_at"] == str(written)
        assert r["schema_version"] == m["schema_version"]
    # per run, and usable in joins with the tables (executions per RL step)
    assert _pick(_json(lake_root, "SELECT part, step FROM steps ORDER BY part", run_id="r2"), "part", "step") == [
        ("demos", None), ("eval-after", None), ("eval-before", None), ("eval=final", None), ("step=1", 1)]
    q = ("SELECT s.run_id, s.step, count(e.execution_id) AS n FROM steps s JOIN executions e "
         "ON e.run_id = s.run_id AND e.step = s.step WHERE s.kind = 'step' GROUP BY ALL ORDER BY 1, 2")
    assert run_sql(lake_root, q, fmt="csv") == "run_id,step,n\nr1,1,6\nr1,2,3\nr2,1,12\n"


def test_steps_types_and_empty_lake(lake_root, tmp_path):
    expected = [("run_id", "VARCHAR"), ("part", "VARCHAR"), ("kind", "VARCHAR"), ("step", "BIGINT"),
                ("tables", "VARCHAR[]"), ("rows", "BIGINT"), ("bytes", "BIGINT"), ("written_at", "TIMESTAMP"),
                ("schema_version", "INTEGER")]
    q = ("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'steps' "
         "ORDER BY ordinal_position")
    for root in (lake_root, str(tmp_path / "empty")):
        con = connect(root)
        try:
            assert con.execute(q).fetchall() == expected
        finally:
            con.close()
    assert run_sql(str(tmp_path / "empty"), "SELECT count(*) AS n FROM steps", fmt="csv") == "n\n0\n"


def test_steps_cannot_be_changed(lake_root):
    for q in ("INSERT INTO steps SELECT * FROM steps", "UPDATE steps SET rows = 0", "DELETE FROM steps",
              "DROP TABLE steps"):
        with pytest.raises(SqlRefused, match="read-only mode"):
            run_sql(lake_root, q)
    assert _json(lake_root, "SELECT count(*) AS n FROM steps") == [{"n": 10}]


# ---- named queries -----------------------------------------------------------------------------------
def test_named_queries_are_listed_with_their_header():
    found = named_queries()
    assert tuple(found) == QUERIES
    for name, about in found.items():
        text = named_query(name)
        assert text.startswith("-- ") and about and about == text.splitlines()[0][3:].strip()
    with pytest.raises(SqlError, match="no named query 'nope'; known: duplicates, failure_reasons"):
        named_query("nope")
    with pytest.raises(SqlError, match="no named query"):
        named_query("../queries/step_summary")     # a name, never a path


def test_named_queries_on_an_empty_lake(lake_root, tmp_path):
    empty = str(tmp_path / "empty")
    for name in QUERIES:
        full = run_sql(lake_root, named_query(name), fmt="csv").splitlines()
        assert run_sql(empty, named_query(name), fmt="csv").splitlines() == full[:1]   # same columns, no rows
        assert len(full) > 1


def test_step_summary(lake_root):
    cols = ("run_id", "step", "split", "eval_version", "executions", "successes", "failed", "timeouts", "limits",
            "calls", "tokens_generated", "prompt_tokens", "longest_prompt", "wall_s")
    rows = _pick(_named(lake_root, "step_summary"), *cols)
    assert rows == [
        # prompts: a1..a3 each 2 + 6, b3 1 -> 25; tokens: a1..a3 4 each + b3 2
        ("r1", 1, "train", None, 6, 2, 2, 1, 1, 7, 14, 25, 6, 30.0),
        ("r1", 2, "train", None, 3, 1, 1, 0, 1, 2, 6, 2, 1, 20.0),
        # the two evaluations share step -2 and split: the evaluated version keeps them apart
        ("r2", -3, "eval-final", 0, 1, 0, 0, 0, 0, 0, 0, 0, None, 1.5),
        ("r2", -2, "eval-sampled", 0, 2, 1, 0, 0, 1, 0, 0, 0, None, 4.0),
        ("r2", -2, "eval-sampled", 3, 1, 1, 0, 0, 0, 1, 1, 1, 1, 2.5),
        ("r2", -1, "demo", 0, 1, 1, 0, 0, 0, 1, 2, 1, 1, 2.0),
        ("r2", 1, "train", None, 12, 6, 0, 0, 0, 0, 0, 0, None, 1.0),
    ]
    r1 = _named(lake_root, "step_summary")[0]
    assert r1["success_rate"] == round(2 / 6, 4) and r1["mean_reward"] == round(2.5 / 6, 4)
    assert r1["mean_call_s"] == round((2 + 1) * 3 / 7 + 2 / 7, 4)      # a1..a3: 2 s + 1 s calls, b3: 2 s


def test_failure_reasons(lake_root):
    rows = _named(lake_root, "failure_reasons")
    assert _pick(rows, "run_id", "step", "split", "status", "error", "executions", "tasks", "share", "example") == [
        ("r1", 1, "train", "failed", "env crashed", 2, 1, round(2 / 6, 4), "b1"),
        ("r1", 1, "train", "timeout", None, 1, 1, round(1 / 6, 4), "a3"),
        ("r1", 1, "train", "turn_limit", None, 1, 1, round(1 / 6, 4), "b3"),
        ("r1", 2, "train", "failed", "sandbox lost", 1, 1, round(1 / 3, 4), "d3"),
        ("r1", 2, "train", "token_limit", None, 1, 1, round(1 / 3, 4), "d2"),
        ("r2", -2, "eval-sampled", "turn_limit", None, 1, 1, round(1 / 3, 4), "v2"),   # of v1, v2 and w1
    ]
    assert _pick(_named(lake_root, "failure_reasons", run_id="r2"), "example") == [("v2",)]


def test_longest_executions(lake_root):
    rows = _named(lake_root, "longest_executions")
    assert len(rows) == 20            # 9 + 17 executions in the lake, the top 20 kept
    assert _pick(rows[:6], "execution_id", "status", "wall_s", "model_s", "calls", "tokens_generated",
                 "tokens_rank", "prompt_tokens", "longest_prompt") == [
        ("b3", "turn_limit", 30.0, 2.0, 1, 2, 5, 1, 1),
        ("d2", "token_limit", 20.0, 15.0, 1, 5, 1, 1, 1),
        ("a1", "done", 10.0, 3.0, 2, 4, 2, 8, 6),
        ("a2", "done", 8.0, 3.0, 2, 4, 2, 8, 6),
        ("a3", "timeout", 6.0, 3.0, 2, 4, 2, 8, 6),
        ("d1", "done", 5.0, 1.0, 1, 1, 7, 1, 1),
    ]
    # the one-second executions tie on wall time and tokens: run, step and id decide, and the cut falls among them
    assert [r["execution_id"] for r in rows[-3:]] == ["s04", "s05", "s06"]
    assert {r["execution_id"] for r in rows} >= {"v1", "v2", "w1", "m1", "b1", "b2"}


def test_timeouts(lake_root):
    rows = _named(lake_root, "timeouts")
    assert _pick(rows, "run_id", "step", "execution_id", "status", "calls", "tokens_generated", "wall_s",
                 "partial", "scored_reward", "advantage", "excluded", "last_finish") == [
        ("r1", 1, "a3", "timeout", 2, 4, 6.0, 0.5, 0.5, -0.5, False, "stop"),
        ("r1", 1, "b3", "turn_limit", 1, 2, 30.0, 0.25, 0.25, 0.0, False, "length"),
        ("r1", 2, "d2", "token_limit", 1, 5, 20.0, 0.5, None, None, None, "length"),
        ("r2", -2, "v2", "turn_limit", 0, 0, 4.0, 0.0, None, None, None, None),
    ]


def test_duplicates(lake_root):
    rows = _named(lake_root, "duplicates")
    assert _pick(rows, "run_id", "step", "task_id", "executions", "distinct_contents", "kept", "collapsible",
                 "largest_set") == [
        ("r1", 1, "t1", 3, 1, 2, 1, 2),     # a1 == a2; a3 has their tokens but another status and reward
        ("r1", 1, "t2", 3, 2, 2, 1, 2),     # b1 == b2 (no calls, same failure); b3 differs
    ]
    # the same count as the dedup query itself
    con = connect(lake_root)
    try:
        kept = dedup_executions(con)
        total = con.execute("SELECT count(*) FROM executions").fetchone()[0]
    finally:
        con.close()
    assert total - kept.num_rows == sum(r["collapsible"] for r in rows)
    assert sorted(kept.filter(pa.compute.greater(kept["multiplicity"], 1))["execution_id"].to_pylist()) == ["a1", "b1"]


def test_tokens_trained(lake_root):
    rows = _named(lake_root, "tokens_trained")
    assert _pick(rows, "run_id", "step", "execution_id", "task_id", "tokens_generated", "sequences", "tokens",
                 "trainable", "weighted", "reward", "advantage", "excluded") == [
        ("r1", 1, "a1", "t1", 4, 2, 14, 5, 4.5, 1.0, 0.25, False),
        ("r1", 1, "a3", "t1", 4, 1, 7, 3, 3.0, 0.5, -0.5, False),
        ("r1", 1, "b3", "t2", 2, 1, 3, 2, 0.5, 0.25, 0.0, False),
        ("r1", 2, "d1", "t1", 1, 1, 2, 1, 1.0, None, None, None),     # step 2 has no scores part
    ]


# ---- gyre sql ---------------------------------------------------------------------------------------
def test_cli_named_query_json_and_csv(lake_root, capsys):
    assert main(["sql", "--query", "tokens_trained", "--lake", lake_root, "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == _named(lake_root, "tokens_trained")
    assert main(["sql", "--query", "failure_reasons", "--lake", lake_root, "--run", "r2", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out == ("run_id,step,split,status,error,executions,tasks,share,example\n"
                   "r2,-2,eval-sampled,turn_limit,,1,1,0.3333,v2\n")
    assert main(["sql", "SELECT count(*) AS n FROM steps", "--lake", lake_root]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [["n"], ["--"], ["10"], ["(1", "row)"]]


def test_cli_list_queries(capsys):
    assert main(["sql", "--list-queries"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(QUERIES)
    for line, (name, about) in zip(lines, named_queries().items()):
        assert line.split(None, 1)[1] == about


@pytest.mark.bad_input("bad `gyre sql` arguments")
def test_cli_errors_are_one_line(lake_root, capsys, tmp_path):
    assert main(["sql", "--query", "nope", "--lake", lake_root]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gyre sql: no named query 'nope'; known: ") and all(q in err for q in QUERIES)
    for argv in (["sql", "--lake", lake_root], ["sql", "SELECT 1", "--query", "timeouts", "--lake", lake_root]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            "gyre sql: give exactly one of a query text or --query NAME (see --list-queries)\n")
    # a plain error (not a refusal) is one line too, DuckDB's hint kept and its caret dropped
    assert main(["sql", "SELECT nope FROM calls", "--lake", lake_root]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gyre sql: Binder Error: Referenced column \"nope\"")
    assert "Candidate bindings" in err and "^" not in err
    assert main(["sql", f"COPY calls TO '{tmp_path / 'never.csv'}'", "--lake", lake_root]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disabled by configuration" in err and not (tmp_path / "never.csv").exists()
    assert main(["sql", "SELECT 1", "--run", "../up", "--lake", lake_root]) == 2
    assert capsys.readouterr().err.startswith("gyre sql: invalid run id '../up'")


def test_sql_dir_override(lake_root, tmp_path, monkeypatch, capsys):
    (tmp_path / "per_run.sql").write_text("-- Executions per run.\nSELECT run_id, count(*) AS n FROM executions "
                                          "GROUP BY 1 ORDER BY 1\n")
    (tmp_path / "notes.txt").write_text("not a query")
    monkeypatch.delenv("GYRE_SQL_DIR", raising=False)
    assert sql_dir() == Path(lake_sql.__file__).resolve().parent / "queries"   # package data, in a wheel too
    monkeypatch.setenv("GYRE_SQL_DIR", str(tmp_path))
    assert sql_dir() == tmp_path and named_queries() == {"per_run": "Executions per run."}
    assert main(["sql", "--query", "per_run", "--lake", lake_root, "--format", "csv"]) == 0
    assert capsys.readouterr().out == "run_id,n\nr1,9\nr2,17\n"


# ---- refusals that tests/core/test_lake.py does not already cover ------------------------------------
@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    d = tmp_path_factory.mktemp("outside")
    (d / "f.csv").write_text("a,b\n1,2\n")
    pq.write_table(pa.table({"a": [1]}), str(d / "f.parquet"))
    return d


@pytest.mark.parametrize("query, says", [
    ("INSERT INTO calls SELECT * FROM calls", "the lake is read-only: INSERT refused"),
    ("UPDATE executions SET reward = 0", "the lake is read-only: UPDATE refused"),
    ("DELETE FROM executions", "the lake is read-only: DELETE refused"),
    ("DROP VIEW calls", "read-only mode"),
    ("CREATE OR REPLACE VIEW calls AS SELECT 1", "read-only mode"),
    ("SELECT * FROM read_blob('{out}/f.csv')", "disabled by configuration"),
    ("SELECT * FROM read_parquet('{out}/f.parquet')", "disabled by configuration"),
    ("SELECT * FROM parquet_metadata('{out}/f.parquet')", "disabled by configuration"),
    ("SELECT * FROM read_json_auto('{out}/f.csv')", "disabled by configuration"),
    ("SELECT * FROM sniff_csv('{out}/f.csv')", "disabled by configuration"),
    ("SELECT * FROM '{out}/f.csv'", "disabled by configuration"),
    ("FROM '{out}/f.parquet'", "disabled by configuration"),
    ("SELECT * FROM read_csv(['{out}/f.csv'])", "disabled by configuration"),
    ("EXPORT DATABASE '{out}/export'", "disabled by configuration"),
    ("SET threads = 1", "configuration has been locked"),
    ("PRAGMA enable_profiling", "configuration has been locked"),
    ("LOAD '{out}/evil.duckdb_extension'", "disabled"),
    ("INSTALL '{out}/evil.duckdb_extension'", "disabled"),
])
@pytest.mark.bad_input("SQL writes, escapes and outside reads")
def test_more_refusals(lake_root, outside, query, says):
    with pytest.raises(SqlRefused) as info:
        run_sql(lake_root, query.format(out=outside))
    msg = str(info.value)
    assert says in msg and "\n" not in msg
    assert not (outside / "export").exists()


def test_a_failed_insert_into_nothing_is_not_a_refusal(lake_root):
    with pytest.raises(SqlError) as info:     # no such table: an ordinary error, not "read-only"
        run_sql(lake_root, "INSERT INTO nothing VALUES (1)")
    assert not isinstance(info.value, SqlRefused)


@pytest.mark.bad_input("a run or lake that is not there")
def test_a_run_or_lake_that_is_not_there_is_an_error_not_zero_rows(lake_root, tmp_path, capsys):
    with pytest.raises(SqlError, match=r"no run 'r9' in the lake at .* \(runs: r1, r2\)"):
        run_sql(lake_root, "SELECT count(*) FROM executions", run_id="r9")
    assert main(["sql", "SELECT 1", "--lake", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"gyre sql: no lake at {tmp_path / 'nowhere'} (not a directory)\n"


@pytest.mark.fault("a runaway `gyre sql` query", "stopped at --timeout; a huge result prints its first --max-rows")
def test_a_long_query_stops_at_its_timeout_and_a_big_result_prints_its_first_rows(lake_root, capsys):
    import time

    t0 = time.monotonic()
    with pytest.raises(SqlError, match=r"ran past 0.5 s and was stopped"):
        run_sql(lake_root, "SELECT count(*) FROM range(100000000000) a", timeout_s=0.5)
    assert time.monotonic() - t0 < 60            # interrupted, not run to its end (hours)
    cut = []
    out = run_sql(lake_root, "SELECT range AS i FROM range(1000)", fmt="csv", max_rows=3, on_truncate=cut.append)
    assert out == "i\n0\n1\n2\n" and cut == [3]
    assert run_sql(lake_root, "SELECT range AS i FROM range(3)", fmt="csv", max_rows=3, on_truncate=cut.append) \
        == "i\n0\n1\n2\n" and cut == [3]          # exactly max_rows: nothing cut
    assert main(["sql", "SELECT range AS i FROM range(50)", "--format", "csv", "--max-rows", "5", "--lake",
                 lake_root]) == 0
    got = capsys.readouterr()
    assert got.out == "i\n0\n1\n2\n3\n4\n" and "showing the first 5 rows of more" in got.err


@pytest.mark.fault("a `gyre sql` query past its memory", "fails cleanly at --memory-limit")
def test_a_query_past_its_memory_limit_fails_cleanly(lake_root):
    with pytest.raises(SqlError, match=r"(?i)out of memory|memory limit"):
        run_sql(lake_root, "SELECT list(range) FROM range(50000000)", memory_limit="64MB")


@pytest.mark.fault("Ctrl-C during a `gyre sql` query", "the query stops, rc 130")
def test_ctrl_c_stops_a_running_query(lake_root, monkeypatch):
    """The query runs on a thread; a KeyboardInterrupt in the waiting one interrupts DuckDB and propagates."""
    import threading

    from gyre_core.lake import sql as sql_mod

    real_join = threading.Thread.join
    calls = []

    def join(self, timeout=None):            # the waiting loop's first poll is where Ctrl-C lands
        if self.name == "gyre-sql" and timeout is not None and not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real_join(self, timeout)
    monkeypatch.setattr(sql_mod.threading.Thread, "join", join)
    with pytest.raises(KeyboardInterrupt):
        run_sql(lake_root, "SELECT count(*) FROM range(100000000000) a")
