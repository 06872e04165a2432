"""One cell agent as a Prefect flow run (`elastic.launch=prefect`; `gyre_ops.cell_runs`).

Not triggered by hand: the elastic coordinator creates one run of the `cell-agent` deployment per cell,
on queue `rollout`, named `<run id>-c<i>`; a cell worker (one per device set) runs it, and the run lasts
as long as the cell serves — rollout and train roles alike, switching inside this one process.
"""
from __future__ import annotations

from prefect import flow
from prefect.blocks.system import Secret

from gyre_ops.cell_runs import serve_cell


@flow(name="gyre-cell-agent", validate_parameters=True, retries=0)
def cell_agent(args: list[str], key_block: str) -> int:
    """Serve one cell until the coordinator says stop.

    Args:
        args: the agent's command line (`python -m gyre_core.elastic.agent ARGS`): cell, coordinator, mode.
        key_block: the Secret block holding the key the coordinator accepts.
    """
    return serve_cell(args, Secret.load(key_block).get())
