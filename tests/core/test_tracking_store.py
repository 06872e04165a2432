"""A local MLflow store is created whole or not at all (a process killed while MLflow migrated its schema
once left a half-created `mlflow.db` that every later run in the directory failed on)."""
import os
import sqlite3

import pytest

from gyre_core import tracking


def _tables(path) -> set[str]:
    with sqlite3.connect(path) as con:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.mark.fault("SIGKILL while the MLflow database is created", "nothing half-made is left; the next start makes it whole")
def test_a_store_killed_while_being_created_leaves_nothing_and_the_next_start_makes_it_whole(tmp_path, monkeypatch):
    db = tmp_path / "mlflow" / "mlflow.db"

    def killed(src, dst):                  # the process dies after the schema, before the store takes its name
        raise KeyboardInterrupt
    monkeypatch.setattr(tracking.os, "link", killed)
    with pytest.raises(KeyboardInterrupt):
        tracking.create_sqlite_store(db)
    assert not db.exists() and os.listdir(db.parent) == []      # no half store, no leftover
    monkeypatch.undo()
    tracking.create_sqlite_store(db)
    assert {"experiments", "runs", "metrics", "params", "alembic_version"} <= _tables(db)
    before = db.stat().st_mtime_ns
    tracking.create_sqlite_store(db)                            # an existing store is left as it is
    assert db.stat().st_mtime_ns == before and os.listdir(db.parent) == ["mlflow.db"]
