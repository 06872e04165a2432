"""`bench/gpu.py` on its CPU path (the same sections run against the same references on a GPU)."""
from __future__ import annotations

from bench.gpu import check_tree_attention


def test_the_tree_attention_check_measures_packing_against_per_branch_training():
    out = check_tree_attention("cpu")
    assert out["kernel"] == "sparse"          # flex has no backward on the CPU
    for row in (out["per_branch"], out["loss_once"]):
        assert row["pieces_whole"] == 1 and row["pieces_split"] > 1
        for tag in ("whole", "split"):        # fp32: packing is exact up to float32 rounding
            assert row[f"fp32_packed_{tag}_grad_rel_err"] < 1e-5
            assert row[f"fp32_packed_{tag}_loss_abs_err"] < 1e-6
        # bf16 errors are bf16's own (~1e-2), far above fp32's, and packing does not add to them
        assert 1e-3 < row["bf16_branch_grad_rel_err"] < 0.1
        assert 0.5 < row["bf16_packing_error_ratio"] < 1.5


def test_the_cell_devices_check_compares_replicas_with_one_device():
    from bench.gpu import check_cell_devices

    out = check_cell_devices("cpu", repeats=1)
    assert out["gpus"] == 0 and out["replica_devices"] == ["cpu"] and out["parallel"] is False
    assert sum(out["chunks_by_device"]) == out["chunks"] > 1 and min(out["chunks_by_device"]) > 0
    assert out["grad_rel_err"] < 1e-5            # the same gradient, summed in another order
