"""What a Prefect user sees of a training run: a table artifact per RL step, a markdown summary at the end,
and the links between the flow run and the run's one MLflow run.

Plain helpers, called inside the tasks of `tasks.rl` (artifacts attach to the task run and its flow run).
The figures come from `gyre_core.report`; the Prefect ids go to `gyre_core.phases.tag_run` as plain strings.
"""
from __future__ import annotations

import re

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.runtime import deployment, flow_run

from gyre_core import phases, report


def artifact_key(*parts: object) -> str:
    """An artifact key from `parts` ("My_Run.1", "step", 0 -> "my-run-1-step-0"): Prefect allows
    lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


def link_run(run_dir: str) -> dict[str, str]:
    """Tag the MLflow run with this flow run (id, name, deployment; every flow run that worked on the
    Gyre run in `prefect.flow_run_ids`), and link back from Prefect: a link artifact `<run-id>-mlflow`
    and the flow-run tags `gyre-run:<run id>`, `mlflow-run:<mlflow run id>`."""
    fid = str(flow_run.id) if flow_run.id else "none"
    info = phases.tag_run(run_dir, {"prefect.flow_run_id": fid, "prefect.flow_run_name": flow_run.name or "none",
                                    "prefect.deployment": deployment.name or "none",
                                    "prefect.flow_run_url": flow_run.ui_url or "none"},
                          append={"prefect.flow_run_ids": fid})
    hint = f" Serve the UI first: `{info['hint']}`." if info["hint"] else ""
    create_link_artifact(key=artifact_key(info["run_id"], "mlflow"), link=info["url"],
                         link_text=f"MLflow run {info['mlflow_run_id']}",
                         description=f"MLflow run of Gyre run `{info['run_id']}` (tracking URI `{info['uri']}`, "
                                     f"experiment {info['experiment_id']}).{hint}")
    if flow_run.id:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            tags = set(client.read_flow_run(flow_run.id).tags)
            client.update_flow_run(flow_run.id, tags=sorted(tags | {f"gyre-run:{info['run_id']}",
                                                                    f"mlflow-run:{info['mlflow_run_id']}"}))
    return info


def step_artifact(run_dir: str, step: int) -> str:
    """The step's figures (`report.step_row`) as a two-column table artifact `<run-id>-step-<n>`."""
    row = report.step_row(run_dir, step)
    return str(create_table_artifact(
        key=artifact_key(row["run_id"], "step", step), table=[{"figure": k, "value": v} for k, v in row.items()],
        description=f"Gyre run `{row['run_id']}`, RL step {step}: rolled out policy v{step}, published "
                    f"v{row['policy_version']}. [MLflow run]({row['mlflow_url']})"))


def summary_artifact(run_dir: str, summary: dict) -> str:
    """The run's summary (`report.summary_markdown`) as a markdown artifact `<run-id>-summary`."""
    return str(create_markdown_artifact(key=artifact_key(summary["run_id"], "summary"),
                                        markdown=report.summary_markdown(run_dir, summary),
                                        description=f"Gyre run `{summary['run_id']}`: held-out success before "
                                                    f"and after RL, control, time, per-step figures"))
