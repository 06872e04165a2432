"""`gyre bench lake --json`: the trajectory lake's ingest, dedup and summary figures, local and on S3.

    gyre bench lake --json             # ~4 minutes on a 2-core CPU (local, then the same on loopback S3)
    gyre bench lake --quick --json     # 1M call rows (0.5M on S3), smaller ingest, one round (~1 minute)
    python -m bench.lake [--quick] [--no-s3]

Every measured operation runs in a fresh spawned process; its `peak_mb` is that process's peak RSS
(`ru_maxrss`, inputs included). Ours and the baseline alternate (ours, baseline, ours, baseline), and a
figure is the best run. The written figures go to data/bench-lake.json by hand (`> data/bench-lake.json`).

- **ingest** (`ingest_mb_s`): `synthetic_executions` records (~700K stored tokens each, compaction at a
  64K context, sub-agents, retries, group forks) → `executions_table` / `calls_table` → `Lake.write_part`
  (fsync, manifest and stray check included). Baseline (`ingest_pyarrow_mb_s`): the same columns built by
  plain `pa.array` calls from the same records and written by `pq.write_table` next to them. MB/s are MB
  (10^6 bytes) of Parquet written per second; `ingest_vs_pyarrow` = ours / baseline.
- **call rows** (`rows` ≥ 1e7): calls / executions tables generated directly with numpy + pyarrow
  (`lake_step_tables`: the exact CALLS / EXECUTIONS schemas, 1-5 tokens per list, 3% forks, 5% planted
  duplicate executions), one `Lake.write_part` per step. The reference answers (the planted duplicate
  sets, the step summary) are computed from the tables in memory, before any file is read.
- **dedup** (`dedup_s_10m`): `dedup_executions(connect(root), step=None)`, connect included, against
  `HANDWRITTEN_DEDUP` (the same dedup written directly in DuckDB over `read_parquet` of the same files);
  `dedup_vs_handwritten` = ours / handwritten. Every answer is checked: exactly the planted duplicates
  collapsed, and ours keeps the same ids with the same multiplicities as the handwritten one.
- **summary** (`summary_query_s_10m`): `gyre_core/lake/queries/step_summary.sql` through `connect()`, fetched
  fully and checked against the reference, beside the same text over `read_parquet` views.
- An attempt that raises a DuckDB error or gives a wrong answer is counted (`*_failed_runs`,
  `*_wrong_runs`, `*_errors`), not timed, and retried; a figure is null when no attempt was right.
- **s3**: the same figures with the lake on a moto S3 server on 127.0.0.1 (`s3://gyre-bench/lake`).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import gyre_core.lake
from gyre_core.lake.schema import CALLS, EXECUTIONS

# the shipped query (package data), not one of $GYRE_SQL_DIR's
SUMMARY_SQL = Path(gyre_core.lake.__file__).resolve().parent / "queries" / "step_summary.sql"
RUN_ID = "bench"
ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")
STATUSES = ("done", "timeout", "failed")


# ---- the 10M-row workload, generated column by column ----------------------------------------------------
def _ragged(lengths: np.ndarray, values: pa.Array) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _segment_starts(sizes: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts


def _gather_ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Indices starts[i] .. starts[i]+sizes[i]-1 for every i, concatenated (no Python loop)."""
    total = int(sizes.sum())
    out_starts = _segment_starts(sizes)
    return np.repeat(starts - out_starts, sizes) + np.arange(total)


def _table(schema: pa.Schema, cols: dict[str, pa.Array], n: int) -> pa.Table:
    # a column of the schema that this generator does not fill (added later) is all NULL
    return pa.Table.from_pydict({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in schema},
                                schema=schema)


def lake_step_tables(step: int, n_exec: int, *, calls_per_exec: int = 50, tokens_per_list: int = 3,
                     group_size: int = 8, dup_frac: float = 0.05, fork_frac: float = 0.03, context_calls: int = 20,
                     seed: int = 0, run_id: str = RUN_ID) -> tuple[pa.Table, pa.Table, dict[str, Any]]:
    """One step's (executions, calls) tables with `n_exec` executions, built without per-row Python objects.

    Executions come in groups of `group_size` (one task_id each). About `fork_frac` of them are forks of
    their group's first execution (calls [0, fork_call) stored with that parent). Then `dup_frac` of the
    step's executions are planted duplicates: exact copies (calls, counts, status, reward, task; new id,
    seed and times) of an execution that is neither a fork nor a fork parent, a source possibly copied
    more than once. Returns the tables and {"planted": copies, "expected": {kept id: multiplicity} of the
    duplicate sets} (the kept id is the smallest, i.e. the source: ids are zero-padded, copies come last).
    """
    rng = np.random.default_rng([seed, step + 1_000_003])
    n_dup = int(round(n_exec * dup_frac))
    n_src = n_exec - n_dup
    if n_src < 1:
        raise ValueError("dup_frac leaves no execution to copy")
    # --- the unique executions
    n_calls = rng.integers(max(1, calls_per_exec // 2), calls_per_exec * 3 // 2 + 1, size=n_src)
    idx = np.arange(n_src)
    leader = (idx // group_size) * group_size
    is_fork = (idx != leader) & (rng.random(n_src) < fork_frac)
    fork_call = np.where(is_fork, np.minimum(rng.integers(1, 6, size=n_src),
                                             np.minimum(n_calls, n_calls[leader]) - 1), 0)
    is_fork &= fork_call > 0
    fork_call[~is_fork] = 0
    parent_of_fork = np.zeros(n_src, dtype=bool)
    parent_of_fork[leader[is_fork]] = True
    stored = n_calls - fork_call                                   # calls stored with this execution
    # --- their calls: one row per stored call
    n_rows = int(stored.sum())
    ex_of = np.repeat(idx, stored)
    call_index = (fork_call[ex_of] + np.arange(n_rows) - np.repeat(_segment_starts(stored), stored)).astype(np.int32)
    context_index = (call_index // context_calls).astype(np.int32)
    first_in_ctx = (call_index % context_calls == 0)
    role_i = np.where(context_index == 0, 0, 1)
    sub = (ex_of * 31 + context_index * 7) % 10 == 0              # about one context in ten is a sub-agent's
    role_i = np.where(sub & (context_index > 0), 2 + (call_index % 2), role_i).astype(np.int32)
    parent_call = np.where(first_in_ctx, -1, call_index - 1).astype(np.int32)
    new_len = rng.integers(1, 2 * tokens_per_list, size=n_rows).astype(np.int32)
    comp_len = rng.integers(1, 2 * tokens_per_list, size=n_rows).astype(np.int32)
    # prompt = everything earlier in the context (as stored here) + the new prompt tokens
    seg = np.cumsum(first_in_ctx | np.r_[True, ex_of[1:] != ex_of[:-1]]) - 1
    both = (new_len + comp_len).astype(np.int64)
    csum = np.cumsum(both)
    seg_start = np.zeros(seg[-1] + 1, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    seg_start[seg[starts]] = csum[starts] - both[starts]
    prompt_len = (csum - comp_len - seg_start[seg]).astype(np.int32)
    prefix_len = np.where(first_in_ctx, 0, prompt_len - new_len).astype(np.int32)
    prompt_len = np.where(first_in_ctx, new_len, prompt_len).astype(np.int32)
    n_new, n_comp = int(new_len.sum()), int(comp_len.sum())
    t_call = rng.uniform(0.0, 3600.0, size=n_rows)
    unique_calls = {
        "call_index": pa.array(call_index), "context_index": pa.array(context_index),
        "role": pa.array(ROLES).take(pa.array(role_i)),
        "parent_call": pa.array(parent_call), "prefix_len": pa.array(prefix_len), "prompt_len": pa.array(prompt_len),
        "new_prompt_ids": _ragged(new_len, pa.array(rng.integers(0, 32_000, size=n_new, dtype=np.int32))),
        "completion_ids": _ragged(comp_len, pa.array(rng.integers(0, 32_000, size=n_comp, dtype=np.int32))),
        "logprobs": _ragged(comp_len, pa.array(-rng.exponential(1.0, size=n_comp).astype(np.float32))),
        "versions": _ragged(comp_len, pa.array(np.full(n_comp, max(step, 0), dtype=np.int32))),
        "finish_reason": pa.array(["stop", "length"]).take(pa.array((rng.random(n_rows) < 0.02).astype(np.int8))),
        "t_start": pa.array(t_call), "t_end": pa.array(t_call + rng.exponential(2.0, size=n_rows)),
    }
    gen = np.zeros(n_src, dtype=np.int64)
    np.add.at(gen, ex_of, comp_len)                                # tokens_generated: own calls only
    # --- planted duplicates: copies of sources that are neither forks nor fork parents
    eligible = np.flatnonzero(~is_fork & ~parent_of_fork)
    src = np.sort(rng.choice(eligible, size=n_dup, replace=True)) if n_dup else np.zeros(0, dtype=np.int64)
    all_src = np.concatenate([idx, src])                            # content source of every execution
    rows = _gather_ranges(_segment_starts(stored)[src], stored[src])
    take = pa.array(np.concatenate([np.arange(n_rows), rows]))
    ex_all = np.concatenate([ex_of, np.repeat(np.arange(n_src, n_exec), stored[src])])
    ids = pa.array([f"{run_id}/{step}/{i:08d}" for i in range(n_exec)])
    calls = {"run_id": pa.array([run_id]).take(pa.array(np.zeros(len(ex_all), dtype=np.int8))),
             "step": pa.array(np.full(len(ex_all), step, dtype=np.int64)),
             "execution_id": ids.take(pa.array(ex_all))}
    calls |= {k: v.take(take) for k, v in unique_calls.items()}
    calls_t = _table(CALLS, calls, len(ex_all))
    # --- executions
    status = rng.choice(3, size=n_src, p=[0.7, 0.2, 0.1])[all_src]
    success = (rng.random(n_src) < 0.3)[all_src] & (status == 0)
    partial = rng.random(n_src)[all_src]
    t0 = rng.uniform(0.0, 600.0, size=n_exec)
    fork_of = np.array([""] + [f"{run_id}/{step}/{i:08d}" for i in leader[is_fork]], dtype=object)
    fork_pos = np.zeros(n_src, dtype=np.int64)
    fork_pos[is_fork] = np.arange(1, int(is_fork.sum()) + 1)
    n_ctx = (n_calls - 1) // context_calls + 1
    ex = {
        "run_id": pa.array([run_id]).take(pa.array(np.zeros(n_exec, dtype=np.int8))),
        "step": pa.array(np.full(n_exec, step, dtype=np.int64)), "execution_id": ids,
        "task_id": pa.array([f"task{step}-{g}" for g in range(n_src // group_size + 1)]).take(
            pa.array(all_src // group_size)),
        "seed": pa.array(np.arange(n_exec, dtype=np.int64) + step * 10_000_000),
        "split": pa.array(["train"]).take(pa.array(np.zeros(n_exec, dtype=np.int8))),
        "env": pa.array(["synthetic"]).take(pa.array(np.zeros(n_exec, dtype=np.int8))),
        "status": pa.array(STATUSES).take(pa.array(status)),
        "error": pa.array(["", "evaluator error"]).take(pa.array((status == 2).astype(np.int8))),
        "reward": pa.array(np.where(success, 1.0, 0.1 * partial)), "success": pa.array(success),
        "partial": pa.array(partial), "turns": pa.array(n_calls[all_src].astype(np.int32)),
        "invalid_actions": pa.array(rng.integers(0, 3, size=n_exec).astype(np.int32)),
        "compactions": pa.array((n_ctx[all_src] - 1).astype(np.int32)),
        "policy_version": pa.array(np.full(n_exec, max(step, 0), dtype=np.int32)),
        "t_start": pa.array(t0), "t_end": pa.array(t0 + rng.uniform(60.0, 3600.0, size=n_exec)),
        "n_calls": pa.array(n_calls[all_src].astype(np.int32)), "tokens_generated": pa.array(gen[all_src]),
        "fork_of": pa.array(fork_of[fork_pos[all_src]].tolist(), type=pa.string()),
        "fork_call": pa.array(fork_call[all_src].astype(np.int32)),
    }
    ex_t = _table(EXECUTIONS, ex, n_exec)
    mult = np.bincount(src, minlength=n_src) + 1
    expected = {f"{run_id}/{step}/{i:08d}": int(mult[i]) for i in np.flatnonzero(mult > 1)}
    return ex_t, calls_t, {"planted": n_dup, "expected": expected, "forks": int(is_fork.sum())}


# ---- measured operations, each in a fresh process ------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child_main(conn, name: str, kwargs: dict) -> None:
    import traceback

    try:
        out = globals()[name](**kwargs)
        out["peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        out = {"error": traceback.format_exc()}
    conn.send(out)
    conn.close()


def _in_child(name: str, **kwargs) -> dict:
    """Run `name(**kwargs)` (a function of this module) in a fresh spawned process; its dict + peak_mb."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, name, kwargs))
    proc.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = {"error": f"the process died (exit code {proc.exitcode}; out of memory?)"}
    proc.join()
    if "error" in out:
        raise RuntimeError(f"bench.lake {name}: {out['error']}")
    return out


# ---- ingest: records -> Parquet ------------------------------------------------------------------------
INGEST = dict(turns=400, branching=(0.05, 2), compaction=65_536, sub_agents=2, group_size=8, group_fork=0.3)


def _plain_tables(recs) -> dict[str, pa.Table]:
    """The baseline: the same columns from the same records with plain `pa.array` calls (no checks)."""
    def call_value(r, c, name):
        if name in ("run_id", "step"):
            return getattr(r, name)
        if name == "prompt_len":
            return len(c.prompt_ids)
        if name == "new_prompt_ids":
            return c.prompt_ids[c.prefix_len:]
        return getattr(c, name, None)

    rows = [(r, c) for r in recs for c in r.calls[r.fork_call:]]
    calls = pa.Table.from_arrays([pa.array([call_value(r, c, f.name) for r, c in rows], type=f.type) for f in CALLS],
                                 schema=CALLS)
    ex_value = {"n_calls": lambda r: len(r.calls)}
    execs = pa.Table.from_arrays(
        [pa.array([ex_value.get(f.name, lambda r, n=f.name: getattr(r, n))(r) for r in recs], type=f.type)
         for f in EXECUTIONS], schema=EXECUTIONS)
    return {"executions": execs, "calls": calls}


def _ingest(method: str, root: str, storage_options: dict | None, n_exec: int, tokens_per_exec: int,
            reps: int, tag: str, seed: int = 0) -> dict:
    import fsspec
    import pyarrow.parquet as pq

    from gyre_core.lake.schema import calls_table, executions_table
    from gyre_core.lake.store import Lake
    from gyre_core.processor.synthetic import synthetic_executions

    recs = synthetic_executions(n_exec, tokens_per_exec, seed=seed, **INGEST)
    stored = sum(len(c.prompt_ids) - c.prefix_len + len(c.completion_ids) for r in recs for c in r.calls[r.fork_call:])
    calls = sum(len(r.calls) - r.fork_call for r in recs)
    inputs_mb = _rss_mb()
    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    lake = Lake(root, storage_options)
    lake.check_writable()                  # once per run in real use: not timed
    runs = []
    for i in range(reps):
        t0 = time.perf_counter()
        if method == "ours":
            tables = {"executions": executions_table(recs), "calls": calls_table(recs)}
            t1 = time.perf_counter()
            lake.write_part(f"ingest-{tag}", f"rep={i}", tables)
            t2 = time.perf_counter()
            m = lake.manifest(f"ingest-{tag}", f"rep={i}")
            nbytes = sum(e["bytes"] for e in m["files"].values())
        else:
            tables = _plain_tables(recs)
            t1 = time.perf_counter()
            d = f"{base.rstrip('/')}/pyarrow-{tag}/rep={i}"
            fs.makedirs(d, exist_ok=True)
            for name, t in tables.items():
                pq.write_table(t, f"{d}/{name}.parquet", filesystem=fs)
            t2 = time.perf_counter()
            nbytes = sum(fs.size(f"{d}/{name}.parquet") for name in tables)
        runs.append({"s": t2 - t0, "tables_s": t1 - t0, "write_s": t2 - t1, "bytes": nbytes})
        tables = None
    best = min(runs, key=lambda r: r["s"])
    return {**best, "tokens": stored, "calls": calls, "executions": len(recs), "inputs_mb": round(inputs_mb, 1)}


def _ingest_figures(root: str, storage_options: dict | None, n_exec: int, tokens_per_exec: int,
                    rounds: int, reps: int) -> dict:
    """Ours and the baseline alternate (ours, pyarrow, ours, ...), each run in its own process."""
    res: dict[str, list[dict]] = {"ours": [], "pyarrow": []}
    for k in range(rounds):
        for method in res:
            res[method].append(_in_child("_ingest", method=method, root=root, storage_options=storage_options,
                                         n_exec=n_exec, tokens_per_exec=tokens_per_exec, reps=reps, tag=f"{k}"))
    best = {m: min(rs, key=lambda r: r["s"]) for m, rs in res.items()}
    mb_s = {m: b["bytes"] / 1e6 / b["s"] for m, b in best.items()}
    o, p = best["ours"], best["pyarrow"]
    return {
        "ingest_mb_s": round(mb_s["ours"], 2), "ingest_pyarrow_mb_s": round(mb_s["pyarrow"], 2),
        "ingest_vs_pyarrow": round(mb_s["ours"] / mb_s["pyarrow"], 3),
        "ingest_s": round(o["s"], 3), "ingest_pyarrow_s": round(p["s"], 3),
        "ingest_tables_s": round(o["tables_s"], 3), "ingest_write_s": round(o["write_s"], 3),
        "ingest_pyarrow_tables_s": round(p["tables_s"], 3), "ingest_pyarrow_write_s": round(p["write_s"], 3),
        "ingest_parquet_mb": round(o["bytes"] / 1e6, 2), "ingest_pyarrow_parquet_mb": round(p["bytes"] / 1e6, 2),
        "ingest_tokens": o["tokens"], "ingest_calls": o["calls"], "ingest_executions": o["executions"],
        "ingest_tok_per_s": round(o["tokens"] / o["s"]), "ingest_pyarrow_tok_per_s": round(p["tokens"] / p["s"]),
        "ingest_peak_mb": max(r["peak_mb"] for r in res["ours"]),
        "ingest_pyarrow_peak_mb": max(r["peak_mb"] for r in res["pyarrow"]),
        "ingest_inputs_mb": max(r["inputs_mb"] for rs in res.values() for r in rs),
        "ingest_runs": {m: [round(r["s"], 3) for r in rs] for m, rs in res.items()},
    }


# ---- the 10M-row lake: written once, then dedup and summary ---------------------------------------------
def _summary_rows(con) -> list[list]:
    return [list(r) for r in con.sql(SUMMARY_SQL.read_text()).fetchall()]


def _write_rows(root: str, storage_options: dict | None, rows: int, steps: int, calls_per_exec: int,
                seed: int = 0) -> dict:
    """Generate and write the call-row lake (one part per step). Also the reference answers, from the
    tables in memory (no file read): the planted duplicate sets and the step summary, step by step
    (neither groups across steps)."""
    import duckdb

    from gyre_core.lake.store import Lake, step_part

    per_step = -(-int(rows * 1.02) // (steps * calls_per_exec))     # 2% over: the call counts are random
    lake = Lake(root, storage_options)
    lake.check_writable()
    out = {"rows": 0, "executions": 0, "planted": 0, "forks": 0, "gen_s": 0.0, "write_s": 0.0, "summary": []}
    expected: dict[str, int] = {}
    for step in range(steps):
        t0 = time.perf_counter()
        ex, calls, info = lake_step_tables(step, per_step, calls_per_exec=calls_per_exec, seed=seed)
        t1 = time.perf_counter()
        lake.write_part(RUN_ID, step_part(step), {"executions": ex, "calls": calls})
        out["write_s"] += time.perf_counter() - t1
        out["gen_s"] += t1 - t0
        for k, v in (("rows", calls.num_rows), ("executions", ex.num_rows), ("planted", info["planted"]),
                     ("forks", info["forks"])):
            out[k] += v
        expected.update(info["expected"])
        con = duckdb.connect()
        con.register("executions", ex)
        con.register("calls", calls)
        out["summary"] += _summary_rows(con)
        con.close()
        ex = calls = con = None
    out["parquet_bytes"] = sum(e["bytes"] for t in ("executions", "calls") for e in lake.entries(t, RUN_ID))
    out["dup_digest"] = _digest(sorted(expected.items()))
    out["files"] = {t: lake.files(t, RUN_ID) for t in ("executions", "calls")}
    return out


def _digest(pairs) -> str:
    h = hashlib.sha256()
    for i, m in pairs:
        h.update(f"{i}\t{m}\n".encode())
    return h.hexdigest()[:16]


# The same dedup written directly: hash each execution's calls, group, join back; no views, no lake code.
HANDWRITTEN_DEDUP = """
WITH ex AS (SELECT * FROM read_parquet($executions)),
per_exec AS (
    SELECT run_id, step, execution_id,
           hash(list(hash(call_index, context_index, role, parent_call, prefix_len, prompt_len,
                          new_prompt_ids, payload_uri, completion_ids, logprobs, versions) ORDER BY call_index)) AS h
    FROM read_parquet($calls)
    GROUP BY run_id, step, execution_id
),
parents AS (SELECT DISTINCT run_id, step, fork_of AS execution_id FROM ex WHERE fork_call > 0),
sets AS (
    SELECT ex.run_id, ex.step, min(ex.execution_id) AS execution_id, count(*)::INTEGER AS multiplicity
    FROM ex
    LEFT JOIN per_exec c USING (run_id, step, execution_id)
    LEFT JOIN parents p USING (run_id, step, execution_id)
    GROUP BY ex.run_id, ex.step, ex.task_id, coalesce(c.h, 0::UBIGINT), ex.fork_of, ex.fork_call, ex.n_calls,
             ex.tokens_generated, ex.status, ex.reward, CASE WHEN p.execution_id IS NOT NULL THEN ex.execution_id END
)
SELECT ex.*, s.multiplicity FROM sets s JOIN ex USING (run_id, step, execution_id)
ORDER BY ex.run_id, ex.step, ex.execution_id
"""


def _plain_duckdb(storage_options: dict | None):
    """A plain DuckDB connection that reads the files where they are (s3:// through s3fs)."""
    import duckdb

    con = duckdb.connect()
    if storage_options is not None:
        import s3fs

        from gyre_core.lake.sql import PositionalReader

        class SafeS3(s3fs.S3FileSystem):     # the same thread-safe reads as the lake's own connection
            def _open(self, path, mode="rb", **kwargs):
                if mode != "rb":
                    return super()._open(path, mode, **kwargs)
                return PositionalReader(self, path, self.size(path))

        con.register_filesystem(SafeS3(**storage_options))
    return con


def _same_rows(a: list, b: list) -> bool:
    def same(x, y):
        if isinstance(x, float) and isinstance(y, float):    # sums in another order
            return abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y))
        return x == y

    return len(a) == len(b) and all(len(r) == len(s) and all(map(same, r, s)) for r, s in zip(a, b))


def _check(what: str, result, expect: dict) -> tuple[dict, str | None]:
    """The figures of one answer, and what is wrong with it (None when it is right)."""
    if what == "summary":
        if _same_rows(result, expect["summary"]):
            return {"rows": len(result)}, None
        diff = [(i, j, a, b) for i, (r, e) in enumerate(zip(result, expect["summary"]))
                for j, (a, b) in enumerate(zip(r, e)) if not _same_rows([[a]], [[b]])]
        return {"rows": len(result)}, (f"wrong summary: {len(result)} rows (expected {len(expect['summary'])}); "
                                       f"(row, column, got, expected): {diff[:3]}")
    ids, mult = result.column("execution_id").to_pylist(), result.column("multiplicity").to_pylist()
    pairs = sorted(zip(ids, mult))
    got = {"kept": len(ids), "executions": sum(mult), "all_digest": _digest(pairs),
           "dup_digest": _digest([p for p in pairs if p[1] > 1])}
    if got["executions"] != expect["executions"] or got["executions"] - got["kept"] != expect["planted"] \
            or got["dup_digest"] != expect["dup_digest"]:
        return got, (f"wrong dedup: collapsed {got['executions'] - got['kept']} of {got['executions']} executions, "
                     f"planted {expect['planted']} of {expect['executions']}")
    return got, None


def _query(method: str, what: str, root: str, storage_options: dict | None, files: dict, reps: int,
           expect: dict) -> dict:
    """Time the dedup or the step summary, ours (through `connect`) or handwritten, `reps` right answers.

    An attempt that raises a DuckDB error or gives a wrong answer is counted, not timed, and retried."""
    import duckdb

    from gyre_core.lake.dedup import dedup_executions
    from gyre_core.lake.sql import connect

    runs, errors, wrong, got = [], [], [], {}
    attempts = 0
    while len(runs) < reps and attempts < reps + 8:
        attempts += 1
        t0 = time.perf_counter()
        try:
            if method == "ours":
                con = connect(root, storage_options=storage_options)
            else:
                con = _plain_duckdb(storage_options)
                if what == "summary":
                    for t in ("executions", "calls"):
                        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet({files[t]!r})")
            t1 = time.perf_counter()
            if what == "dedup":
                result = (dedup_executions(con, step=None) if method == "ours" else
                          con.sql(HANDWRITTEN_DEDUP, params=files).to_arrow_table())
            else:
                result = _summary_rows(con)
            t2 = time.perf_counter()
            con.close()
        except duckdb.Error as e:
            errors.append(" ".join(str(e).split())[:160])
            continue
        got, problem = _check(what, result, expect)
        if problem:
            wrong.append(problem[:300])
            continue
        runs.append({"s": t2 - t0, "connect_s": t1 - t0, "query_s": t2 - t1})
    best = min(runs, key=lambda r: r["s"]) if runs else {"s": None, "connect_s": None, "query_s": None}
    return {**best, **got, "ok_runs": len(runs), "errors": errors, "wrong": wrong}


def _query_figures(what: str, root: str, storage_options: dict | None, files: dict, expect: dict, rounds: int,
                   reps: int) -> dict[str, Any]:
    """Ours and handwritten alternate, each run in its own process; best right answer of each."""
    res: dict[str, list[dict]] = {"ours": [], "handwritten": []}
    for _ in range(rounds):
        for method in res:
            res[method].append(_in_child("_query", method=method, what=what, root=root, expect=expect,
                                         storage_options=storage_options, files=files, reps=reps))
    out = {}
    for m, rs in res.items():
        good = [r for r in rs if r["s"] is not None]
        out[m] = {**(min(good, key=lambda r: r["s"]) if good else rs[0]),
                  "peak_mb": max(r["peak_mb"] for r in rs), "ok_runs": sum(r["ok_runs"] for r in rs),
                  "errors": [e for r in rs for e in r["errors"]], "wrong": [w for r in rs for w in r["wrong"]],
                  "runs": [None if r["s"] is None else round(r["s"], 3) for r in rs]}
    return out


def _ratio(a, b):
    return None if a is None or b is None else round(a / b, 3)


def _r3(x):
    return None if x is None else round(x, 3)


def _lake_figures(root: str, storage_options: dict | None, *, ingest_exec: int, ingest_tokens: int,
                  ingest_reps: int, rows: int, steps: int, calls_per_exec: int, rounds: int,
                  reps: int) -> dict[str, Any]:
    """Every figure for one lake root (a local directory or an s3:// prefix)."""
    out: dict[str, Any] = {}
    out.update(_ingest_figures(f"{root}/ingest", storage_options, ingest_exec, ingest_tokens, rounds, ingest_reps))
    lake_root = f"{root}/rows"
    t0 = time.perf_counter()
    setup = _in_child("_write_rows", root=lake_root, storage_options=storage_options, rows=rows, steps=steps,
                      calls_per_exec=calls_per_exec)
    out.update(rows=setup["rows"], executions=setup["executions"], planted_duplicates=setup["planted"],
               forks=setup["forks"], rows_parquet_mb=round(setup["parquet_bytes"] / 1e6, 1),
               rows_write_s=round(setup["write_s"], 2), rows_generate_s=round(setup["gen_s"], 2),
               rows_write_mb_s=round(setup["parquet_bytes"] / 1e6 / setup["write_s"], 1),
               rows_write_peak_mb=setup["peak_mb"], rows_setup_wall_s=round(time.perf_counter() - t0, 1))
    expect = {k: setup[k] for k in ("executions", "planted", "dup_digest", "summary")}
    for name in ("dedup", "summary"):
        f = _query_figures(name, lake_root, storage_options, setup["files"], expect, rounds, reps)
        o, h = f["ours"], f["handwritten"]
        if name == "dedup":
            if h["s"] is None:
                raise AssertionError(f"the handwritten dedup never gave the planted answer: "
                                     f"{h['wrong'] or h['errors']}")
            if o["s"] is not None and o["all_digest"] != h["all_digest"]:
                raise AssertionError("ours and the handwritten dedup keep different execution ids or multiplicities")
            out.update(collapsed=h["executions"] - h["kept"], kept=h["kept"],
                       dedup_same_as_handwritten=None if o["s"] is None else True)
        key = "dedup_s_10m" if name == "dedup" else "summary_query_s_10m"
        out.update({
            key: _r3(o["s"]), f"{name}_connect_s": _r3(o["connect_s"]), f"{name}_query_only_s": _r3(o["query_s"]),
            f"{name}_handwritten_s": _r3(h["s"]),
            f"{name}_vs_handwritten": _ratio(o["s"], h["s"]),
            f"{name}_query_only_vs_handwritten": _ratio(o["query_s"], h["s"]),
            f"{name}_peak_mb": o["peak_mb"], f"{name}_handwritten_peak_mb": h["peak_mb"],
            f"{name}_ok_runs": o["ok_runs"], f"{name}_failed_runs": len(o["errors"]),
            f"{name}_wrong_runs": len(o["wrong"]),
            f"{name}_handwritten_failed_runs": len(h["errors"]) + len(h["wrong"]),
            f"{name}_errors": sorted(set(o["errors"] + h["errors"]))[:3] + sorted(set(o["wrong"] + h["wrong"]))[:2],
            f"{name}_runs": {"ours": o["runs"], "handwritten": h["runs"]},
        })
    return out


# ---- S3 on loopback --------------------------------------------------------------------------------------
_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}


class _LoopbackS3:
    """A moto S3 server on 127.0.0.1 (in this process; the measured processes talk to it over HTTP)."""

    def __enter__(self) -> dict:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)     # one log line per request otherwise
        self._env = {k: os.environ.get(k) for k in _AWS_ENV}
        os.environ.update(_AWS_ENV)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.options = {"anon": False, "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
                        "skip_instance_cache": True}
        import s3fs

        s3fs.S3FileSystem(**self.options).mkdir("gyre-bench")
        return self.options

    def __exit__(self, *exc) -> None:
        self.server.stop()
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- the bench ---------------------------------------------------------------------------------------------
def bench_lake(quick: bool = False, s3: bool = True) -> dict:
    t_start = time.time()
    local = dict(ingest_exec=3 if quick else 8, ingest_tokens=200_000 if quick else 700_000, ingest_reps=3,
                 rows=1_000_000 if quick else 10_000_000, steps=4 if quick else 10, calls_per_exec=50,
                 rounds=1 if quick else 2, reps=2)
    # the same workload on S3 (quick: smaller); moto keeps the objects of the bench process (~0.5 GB)
    remote = local if not quick else dict(local, ingest_exec=2, rows=500_000, steps=2)
    out: dict[str, Any] = {"quick": quick}
    tmp = tempfile.mkdtemp(prefix="gyre-bench-lake-")
    try:
        out.update(_lake_figures(tmp, None, **local))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if s3:
        with _LoopbackS3() as options:
            out["s3"] = _lake_figures("s3://gyre-bench/lake", options, **remote)
            out["s3"]["endpoint"] = "moto ThreadedMotoServer on 127.0.0.1 (in the bench process)"
    out["config"] = {"local": local, "s3": remote if s3 else None, "ingest_generator": {
        "fn": "gyre_core.processor.synthetic.synthetic_executions", **{k: list(v) if isinstance(v, tuple) else v
                                                                       for k, v in INGEST.items()}},
        "rows_generator": "bench.lake.lake_step_tables: 5% planted duplicates, 3% forks, groups of 8 per task, "
                          "1-5 tokens per list, contexts of 20 calls", "cpus": os.cpu_count()}
    out["notes"] = [
        "ingest MB = MB (1e6 bytes) of Parquet written (executions + calls files; the manifest is not counted "
        "but its write is timed); ours = executions_table + calls_table + Lake.write_part (temp file, fsync, "
        "rename, manifest, stray check), pyarrow = pa.array per column from the same records + pq.write_table; "
        "best of reps x rounds, the two alternating in separate processes",
        "peak_mb = ru_maxrss of the measuring process (inputs included: ingest_inputs_mb is the RSS after the "
        "records were generated); dedup/summary peaks include DuckDB's buffers",
        "dedup_s_10m / summary_query_s_10m include connect() (listing manifests, checking each file once, "
        "building the views); *_query_only_* is the query alone; the handwritten side gets the file list for free",
        "handwritten = plain DuckDB over read_parquet of the same files (s3:// through a registered s3fs whose "
        "file objects are safe for DuckDB's concurrent seek+read pairs, PositionalReader); every answer of "
        "both is checked against the planted duplicates / the reference summary",
        "*_failed_runs / *_wrong_runs: attempts that raised a DuckDB error / gave an answer other than the "
        "reference (computed from the generated tables in memory), each retried and not timed; *_ok_runs: "
        "right answers timed (the figure is the best of them)",
    ] + (["quick mode: 1M call rows locally and 0.5M on S3 (not 10M), smaller ingest, one round"] if quick else [])
    out["bench_s"] = round(time.time() - t_start, 1)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    print(json.dumps(bench_lake(args.quick, s3=not args.no_s3), indent=1))


if __name__ == "__main__":
    main()
