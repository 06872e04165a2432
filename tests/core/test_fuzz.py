"""Bad input, generated: property-based tests (hypothesis) over the four places input enters Gyre.

- the config loader and its overrides: a valid config or one ConfigError line naming where; never another
  exception;
- the lake reader, over random corruptions of real Parquet files and manifests: queries answer, a damaged
  file is set aside and named, and no file is ever deleted;
- `gyre sql`, over statements from a grammar of refused forms (writes, outside reads, settings, extensions,
  hidden behind case, comments, CTEs and statement lists): refused, and the lake and disk unchanged;
- the proxy's request parser, over random JSON bodies: a completion or an OpenAI-style 4xx error, never a
  5xx or a traceback.

Each runs a bounded, derandomized number of examples, so a failure reproduces and the suite's time stays put.
"""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre_core.config import ConfigError, GyreConfig, load_config

FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- the config loader ------------------------------------------------------------------------------
def _fields(model, prefix=""):
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            yield from _fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


KEYS = sorted(_fields(GyreConfig))
VALUES = st.one_of(
    st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from([".inf", "-.inf", ".nan", "null", "~", "[]", "{}", "true", "no", "'", '"', "[1, [2", "{a: ",
                     "../../etc/passwd", "/", "0x1f", "1e400", "-0", "!!python/object:os.system", "*alias",
                     "&a [1]", "? x", "|\n  y"]),
    st.text(max_size=30))


@pytest.mark.bad_input("random overrides of every config field")
@FUZZ
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=20)), VALUES), min_size=1, max_size=4),
       st.sampled_from(["smoke", "quick", "nope", "../smoke", ""]))
def test_any_override_is_a_config_or_one_line_naming_where(pairs, preset):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_config(preset, overrides)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg, msg
        assert ":" in msg, msg                         # "field: what is wrong"
    else:
        assert isinstance(cfg, GyreConfig)
        GyreConfig.model_validate(cfg.model_dump(mode="json"))   # what is saved to config.yaml reloads


# ---- the lake reader --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A real lake: two runs, each with a committed part of real records (as test_lake.py builds them)."""
    from gyre_core.lake import Lake
    from tests.core.test_lake import _records, _tables

    root = tmp_path_factory.mktemp("pristine") / "lake"
    lake = Lake(str(root))
    for run in ("run1", "run2"):
        lake.write_part(run, "step=3", _tables(_records()))
    assert len(lake.read_records("run1")) == len(_records()) > 0
    return root


def _files(root) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


CORRUPT = st.tuples(st.sampled_from(["truncate", "flip", "garbage", "empty", "json"]), st.integers(0, 10**6),
                    st.binary(min_size=1, max_size=64))


@pytest.mark.bad_input("random corruptions of real lake files and manifests")
@FUZZ
@given(st.lists(st.tuples(st.integers(0, 50), CORRUPT), min_size=1, max_size=3))
def test_a_corrupted_lake_answers_sets_aside_and_deletes_nothing(tmp_path_factory, pristine, hits):
    import shutil

    from gyre_core.lake import Lake
    from gyre_core.lake.store import LakeVersionError
    from gyre_core.lake.sql import SqlError, run_sql

    root = tmp_path_factory.mktemp("corrupt") / "lake"
    shutil.copytree(pristine, root)
    targets = sorted(p for p in _files(root) if p.endswith((".parquet", "_MANIFEST.json")))
    for which, (how, at, junk) in hits:
        path = root / targets[which % len(targets)]
        data = path.read_bytes()
        if how == "truncate":
            data = data[: at % max(len(data), 1)]
        elif how == "flip":
            i = at % len(data)
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
        elif how == "garbage":
            data = junk * (1 + at % 64)
        elif how == "empty":
            data = b""
        else:
            data = json.dumps({"files": {"x": {"file": junk.hex()}}, "schema_version": at}).encode()
        path.write_bytes(data)
    before = _hashes(root)
    lake = Lake(str(root))
    try:
        recs = lake.read_records("run1")
        out = json.loads(run_sql(str(root), "SELECT count(*) AS n FROM executions", fmt="json"))
        assert out[0]["n"] >= 0 and isinstance(recs, list)
        lake.cleanup("run1")
    except (LakeVersionError, SqlError) as e:                # a refusal naming the file, in one line
        msg = str(e)
        assert "\n" not in msg and str(root) in msg, msg
    after = _hashes(root)
    # every file that was there is still somewhere, byte for byte: in place, or moved under _quarantine/;
    # only a manifest changes in place (it records what was set aside)
    gone = {p: h for p, h in before.items() if p not in after}
    kept_aside = {h for p, h in after.items() if p.startswith("_quarantine/")}
    assert all(h in kept_aside for h in gone.values()), (sorted(gone), sorted(p for p in after if "_quar" in p))
    assert all(p.endswith("_MANIFEST.json") for p, h in before.items() if after.get(p, h) != h)


def _hashes(root) -> dict[str, str]:
    import hashlib

    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in _files(root)}


# ---- gyre sql: a grammar of refused forms -------------------------------------------------------------
WRITES = ["INSERT INTO calls SELECT * FROM calls", "UPDATE executions SET reward = 1", "DELETE FROM scores",
          "DROP VIEW calls", "CREATE TABLE t AS SELECT 1", "CREATE OR REPLACE VIEW calls AS SELECT 1",
          "ALTER VIEW calls RENAME TO c", "COPY calls TO '{out}/x.parquet'", "EXPORT DATABASE '{out}/db'",
          "ATTACH '{out}/x.duckdb' AS x", "INSTALL httpfs", "LOAD httpfs", "SET threads = 1",
          "PRAGMA enable_profiling", "SET memory_limit = '10GB'", "RESET threads"]
READS = ["read_parquet('{out}/f.parquet')", "read_csv('{out}/f.csv')", "read_text('/etc/hostname')",
         "read_blob('{out}/f.csv')", "'{out}/f.csv'", "read_json('{out}/f.csv')", "glob('/etc/*')",
         "parquet_schema('{out}/f.parquet')", "sniff_csv('{out}/f.csv')"]


def _case(s: str, flips: list[bool]) -> str:
    return "".join(c.upper() if i < len(flips) and flips[i] else c.lower() if c.isalpha() else c
                   for i, c in enumerate(s)) if flips else s


REFUSED = st.one_of(
    st.sampled_from(WRITES),
    st.sampled_from(READS).map(lambda r: f"SELECT * FROM {r}"),
    st.tuples(st.sampled_from(READS), st.sampled_from(["WITH t AS (SELECT * FROM {r}) SELECT * FROM t",
                                                       "SELECT count(*) FROM calls, {r}",
                                                       "SELECT (SELECT count(*) FROM {r})",
                                                       "FROM {r}"])).map(lambda x: x[1].format(r=x[0])),
    st.sampled_from(WRITES).map(lambda w: f"SELECT 1; {w}"),
).flatmap(lambda q: st.tuples(st.just(q), st.lists(st.booleans(), max_size=40),
                              st.sampled_from(["", "  ", "\n", "/* x */ ", "-- c\n"])))


@pytest.fixture(scope="module")
def sql_lake(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gyre_core.lake import Lake
    from tests.core.test_lake import _records, _tables

    root = tmp_path_factory.mktemp("sqlfuzz")
    Lake(str(root / "lake")).write_part("run1", "step=0", _tables(_records()))
    out = root / "outside"
    out.mkdir()
    (out / "f.csv").write_text("a,b\n1,2\n")
    pq.write_table(pa.table({"a": [1]}), str(out / "f.parquet"))
    return root


@pytest.mark.bad_input("SQL statements from a grammar of refused forms")
@FUZZ
@given(REFUSED)
def test_every_refused_form_is_refused_and_changes_nothing(sql_lake, case):
    from gyre_core.lake.sql import SqlError, run_sql

    query, flips, lead = case
    text = lead + _case(query.format(out=sql_lake / "outside"), flips)
    before = _files(sql_lake)
    with pytest.raises(SqlError) as info:
        run_sql(str(sql_lake / "lake"), text)
    assert "\n" not in str(info.value)
    assert _files(sql_lake) == before


# ---- the proxy's request parser -----------------------------------------------------------------------
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                                 st.text(max_size=12)),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", 3]),
                                 "content": st.one_of(st.text(max_size=40), st.none(), JSONISH)},
                                optional={"tool_calls": JSONISH, "tool_call_id": JSONISH, "name": JSONISH})
BODY = st.one_of(
    JSONISH,
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)},
                          optional={k: JSONISH for k in ("model", "tools", "tool_choice", "stop", "n", "stream",
                                                         "max_tokens", "max_completion_tokens", "temperature",
                                                         "top_p", "seed", "logprobs", "response_format")}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=40), JSONISH)},
                          optional={k: JSONISH for k in ("max_tokens", "stop", "n", "stream", "echo")}))


@pytest.mark.bad_input("random JSON request bodies to the proxy")
@settings(max_examples=120, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), BODY), min_size=1,
                max_size=4))
def test_any_request_body_is_answered_or_refused_as_openai_does(proxy_server, requests):
    server, key = proxy_server
    import httpx

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        for path, body in requests:
            r = http.post(path, content=json.dumps(body).encode())
            assert r.status_code < 500, (body, r.text)
            assert "Traceback" not in r.text
            if r.status_code >= 400:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and "\n" not in err["message"]


@pytest.fixture(scope="module")
def proxy_server():
    from gyre_core.harness.tools import system_with_tools
    from gyre_core.model import train_tokenizer
    from gyre_core.proxy.recorder import Limits
    from tests.core.test_proxy import CALL, SYSTEM, TOOLS, ScriptedEngine, open_exe, serving

    tok = train_tokenizer([SYSTEM, CALL, "What is 2 + 3? The answer is 5.", system_with_tools(SYSTEM, TOOLS)] * 20,
                          vocab_size=320)
    eng = ScriptedEngine(tok, ["ok"])
    with serving(tok, [eng], limits=Limits(100_000, 10**9, 4096, 10**6)) as (proxy, server):
        _, keys = open_exe(proxy)
        yield server, keys.main
