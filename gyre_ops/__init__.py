"""Operations code that talks to a Prefect server: work pools and queues, workers, cell placement.

`gyre_core` never imports Prefect; this package is the Prefect-facing side of deployment
(`infra/` holds the data and scripts, this package the code they call):

- `gyre_ops.stack`  — `gyre up` / `gyre down`: a local stack (Prefect + MLflow servers, pool, workers);
- `gyre_ops.pools`  — the pools/queues spec (`infra/pools.yaml`), `ensure_pools`, `check_pool`;
- `gyre_ops.worker` — `gyre worker`: check the pool and queues, then exec `prefect worker start`;
- `gyre_ops.cells`  — `place_cell` / `move_cell`: a cell's queue, the queue limits, the retag history.
"""
