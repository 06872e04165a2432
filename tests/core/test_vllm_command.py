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


def test_cpu_cells_of_two_cores_serve_on_cores_of_their_own_without_tensor_parallel(monkeypatch, cell_engine):
    from gyre_core.elastic.vllm_cell import first_core

    server = _server(monkeypatch, cell_engine, cuda=False)
    assert "--tensor-parallel-size" not in server.command()
    binds = []
    for cell in range(3):                           # on a machine of 4 cores, as VLLMCellDevice places them
        server.spec.first_core = first_core(cell, server.spec.threads, 4)
        env = server.environment()
        assert env["OMP_NUM_THREADS"] == "2"
        binds.append(env["VLLM_CPU_OMP_THREADS_BIND"])
    assert binds == ["0-1", "2-3", "0-1"]           # the third wraps round
    assert first_core(1, 1, 2) == 1 and first_core(1, 3, 4) == 1 and first_core(2, 3, 4) == 1   # never past the last
