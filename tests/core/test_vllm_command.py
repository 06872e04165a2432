"""A cell's vLLM server spans all the cell's devices: tensor-parallel over its GPUs on a CUDA host, that many
CPU threads (and no tensor parallelism) on vLLM-CPU. Checked on the command and environment Gyre builds."""
import json

import pytest

from gyre_core.config import load_config
from gyre_core.engine import vllm as v


@pytest.fixture(scope="module")
def cell_engine(tmp_path_factory) -> dict:
    """The engine settings a run of 2 devices per cell hands its vLLM cells (`HarnessWork.cell_args`)."""
    from gyre_core.phases import prepare
    from gyre_core.phases.rl_on_cells import HarnessWork

    tmp = tmp_path_factory.mktemp("cells")
    cfg = load_config("smoke", [f"run.out_root={tmp}/runs", f"lake.root={tmp}/lake",
                                f"tracking.uri=sqlite:///{tmp}/m.db", "engine.kind=vllm",
                                "elastic.enabled=true", "elastic.devices_per_cell=2", "elastic.devices=4"])
    args = HarnessWork(prepare(cfg), steps=1).cell_args()
    return json.loads(args[args.index("--engine-json") + 1])


def _server(monkeypatch, engine: dict, cuda: bool) -> v.VLLMServer:
    monkeypatch.setattr(v, "cuda_host", lambda: cuda)
    monkeypatch.setattr(v, "vllm_python", lambda: "python-of-vllm")
    return v.VLLMServer(v.ServerSpec.from_config(engine, "model-dir", seed=3))


def test_a_cell_of_two_gpus_serves_tensor_parallel_over_both(monkeypatch, cell_engine):
    cmd = _server(monkeypatch, cell_engine, cuda=True).command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[0] == "python-of-vllm" and "--gpu-memory-utilization" in cmd


def test_a_cpu_cell_of_two_cores_serves_on_two_threads_without_tensor_parallel(monkeypatch, cell_engine):
    server = _server(monkeypatch, cell_engine, cuda=False)
    assert "--tensor-parallel-size" not in server.command()
    env = server.environment()
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "0-1")
