"""The trajectory lake: Parquet tables committed by manifests (store), their schemas (schema),
and read-only SQL over them with DuckDB (sql). See docs/lake.md for the tables and layout."""
from gyre_core.lake.schema import (
    CALLS,
    EXECUTIONS,
    SCHEMAS,
    TRAIN_TOKENS,
    calls_table,
    executions_table,
    read_executions,
    train_tokens_table,
)
from gyre_core.lake.sql import SqlError, SqlRefused, connect, run_sql
from gyre_core.lake.store import MANIFEST, Lake, step_part

__all__ = [
    "CALLS", "EXECUTIONS", "MANIFEST", "SCHEMAS", "TRAIN_TOKENS", "Lake", "SqlError", "SqlRefused",
    "calls_table", "connect", "executions_table", "read_executions", "run_sql", "step_part",
    "train_tokens_table",
]
