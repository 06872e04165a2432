"""The GPU path, checked and timed: `gyre bench gpu --json` (or `python -m bench.gpu`) where torch sees a GPU.

Every section runs on its own (a failure is reported with its error; the others still run) and prints
numbers, not verdicts. `--sections` picks some; `--out DIR` also writes each section's JSON there.

- `tree_attention`: gradients of tree-packed training against training each branch as its own
  sequence, on the GPU through the compiled FlexAttention kernel. fp32: packed vs per-branch directly.
  bf16: packed bf16 and per-branch bf16 each against the fp32 per-branch reference (packing must not
  add error beyond bf16's own), and the flex kernel against the dense-mask path in bf16.
- `trainer`: one DeepSpeed step (ZeRO 1, NCCL) on the GPU against a plain-torch AdamW step on the CPU
  from the same weights and batch: gradient error, gradient norm, and the update in units of lr.
- `engine`: the KV-reusing engine on the GPU against the CPU from the same weights, greedy, same
  prompts over several turns: tokens that agree, and generated tokens/s of each.
- `packing_speed`: `bench.processor_packing` (flat vs tree-packed training through the production
  `Trainer`) on the GPU, for the presets' tiny model and a wider one.
- `elastic`: the pipeline on the GPU: `prepare` + warm start (supervised steps on the GPU), then real
  K = 2 cells sharing the one GPU (`elastic.devices=2`) under `colocated` and `elastic`.
- `cell_devices`: a cell's trainer over its GPUs (`trainer.replicas.DeviceReplicas`): one burst of packed
  micro-steps shared out over every GPU torch sees (on a one-GPU host, two threads on the same GPU) against
  the same burst on the trainer's GPU alone: gradient error, and seconds of each.
- `kernels`: forward + backward of the same packed pieces with each tree-attention kernel (flex, sparse,
  dense mask) beside the flat batches, for both models — to see where packed training spends its time.
  Minutes: the sparse kernel is the CPU's design (many small launches) and each flex length compiles.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback

import torch

from bench.processor_packing import MODEL_DIMS, bench_packing, branching_workload, ppo_loss, tiny_model

WIDE_DIMS = {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "ffn_size": 4096,
             "vocab_size": 512}
SECTIONS = ("tree_attention", "trainer", "engine", "elastic", "cell_devices", "packing_speed", "kernels")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _grads(model, parts) -> tuple[dict[str, torch.Tensor], float]:
    """Accumulated gradients (float64, on the CPU) of the summed loss over `parts`, and that loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for items in parts:
        loss = ppo_loss(model, items)
        loss.backward()
        total += loss.item()
    return {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}, total


def _rel_err(g: dict, ref: dict) -> float:
    """Largest per-tensor ||g − ref|| / ||ref|| over tensors whose reference gradient is not zero."""
    return max(((g[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref if ref[k].norm() > 0)


def check_tree_attention(device: str = "cuda") -> dict:
    from gyre_core.trainer.packing import pack_branches
    from gyre_core.trainer.tree_attention import enable_tree_attention

    kind = "flex" if torch.device(device).type == "cuda" else "sparse"    # flex has no CPU backward
    out: dict = {"kernel": kind}
    for weighting in ("per_branch", "loss_once"):
        br = branching_workload(G=3, K=2, turns=(5, 9), fork_turns=(2, 4), prompt_tokens=40, obs_tokens=(6, 10),
                                vocab=MODEL_DIMS["vocab_size"], weighting=weighting, seed=1)
        split = max(len(b.input_ids) for b in br) + 8       # pieces that recompute ancestors
        per_branch = [[b] for b in br]
        ref32 = tiny_model(MODEL_DIMS, torch.float32, 0).to(device)
        g_ref, l_ref = _grads(ref32, per_branch)
        row = {"branches": len(br), "tokens_flat": sum(len(b.input_ids) for b in br)}
        for max_tokens, tag in ((None, "whole"), (split, "split")):
            trees = [[t] for t in pack_branches(br, max_tokens=max_tokens)]
            m = copy.deepcopy(ref32)
            enable_tree_attention(m, kind)
            g, l_pk = _grads(m, trees)
            row[f"fp32_packed_{tag}_grad_rel_err"] = _rel_err(g, g_ref)
            row[f"fp32_packed_{tag}_loss_abs_err"] = abs(l_pk - l_ref)
            row[f"pieces_{tag}"] = len(trees)
        bf = tiny_model(MODEL_DIMS, torch.float32, 0).to(torch.bfloat16).to(device)
        g_bf_branch, _ = _grads(bf, per_branch)
        row["bf16_branch_grad_rel_err"] = _rel_err(g_bf_branch, g_ref)
        trees = [[t] for t in pack_branches(br, max_tokens=split)]
        g_bf = {}
        for how in (kind, "dense"):
            m = copy.deepcopy(bf)
            enable_tree_attention(m, how)
            g_bf[how], _ = _grads(m, trees)
        row["bf16_packed_split_grad_rel_err"] = _rel_err(g_bf[kind], g_ref)
        row["bf16_dense_mask_split_grad_rel_err"] = _rel_err(g_bf["dense"], g_ref)
        row["bf16_kernel_vs_dense_mask_grad_rel_err"] = _rel_err(g_bf[kind], g_bf["dense"])
        row["bf16_packing_error_ratio"] = row["bf16_packed_split_grad_rel_err"] / row["bf16_branch_grad_rel_err"]
        out[weighting] = row
    return out


def check_trainer(device: str = "cuda", lr: float = 1e-3) -> dict:
    """DeepSpeed on the GPU (NCCL) vs plain torch on the CPU: one PPO step on the same flat batch."""
    import torch.distributed as dist

    from gyre_core.trainer.trainer import Trainer

    seqs = branching_workload(G=4, K=2, turns=(6, 10), fork_turns=(3,), prompt_tokens=60, obs_tokens=(8, 12),
                              vocab=MODEL_DIMS["vocab_size"], seed=2)
    norm = 4.0
    cpu = tiny_model(MODEL_DIMS, torch.float32, 3)
    w0 = {n: p.detach().clone() for n, p in cpu.named_parameters()}
    # reference: plain torch on the CPU, the trainer's loss, clipping and AdamW settings
    loss = ppo_loss(cpu, seqs, norm)
    loss.backward()
    g_ref = {n: p.grad.detach().double().clone() for n, p in cpu.named_parameters()}
    ref_norm = float(torch.nn.utils.clip_grad_norm_(cpu.parameters(), 1.0))
    opt = torch.optim.AdamW(cpu.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    opt.step()
    d_ref = {n: (p.detach() - w0[n]).double() for n, p in cpu.named_parameters()}

    gpu = tiny_model(MODEL_DIMS, torch.float32, 3).to(device)
    tr = Trainer(gpu, lr=lr, zero_stage=1, grad_clip=1.0)
    stats = tr.micro_step(seqs, norm, objective="ppo", last=True)
    g = {n: t.double().cpu() for n, t in tr.gradients().items()}
    gnorm = tr.optimizer_step()
    d = {n: (p.detach().cpu() - w0[n]).double() for n, p in tr.model.named_parameters()}
    sat = {n: g_ref[n].abs() >= 1e-6 for n in g_ref}       # where Adam's first step is ±lr (not ~0/0)
    upd_err = max(((d[n] - d_ref[n]).abs()[sat[n]].max().item() if sat[n].any() else 0.0) for n in d)
    return {"backend": dist.get_backend(), "model_device": str(tr.device), "loss_gpu": stats["loss"],
            "loss_cpu": loss.item(), "grad_rel_err": _rel_err(g, g_ref), "grad_norm_gpu": gnorm,
            "grad_norm_cpu": ref_norm, "update_max_abs_err_over_lr": upd_err / lr,
            "saturated_frac": sum(int(s.sum()) for s in sat.values()) / sum(s.numel() for s in sat.values())}


def check_cell_devices(device: str = "cuda", repeats: int = 3) -> dict:
    """A cell's trainer with gradient replicas on its other GPUs vs the trainer alone, same packed chunks."""
    from gyre_core.elastic.devices import other_devices
    from gyre_core.trainer.packing import pack_branches
    from gyre_core.trainer.replicas import DeviceReplicas
    from gyre_core.trainer.trainer import Trainer

    dims = WIDE_DIMS if device.startswith("cuda") else MODEL_DIMS    # CPU: the tests' quick path
    seqs = branching_workload(G=8, K=2, turns=(6, 10), fork_turns=(3,), prompt_tokens=60, obs_tokens=(8, 12),
                              vocab=dims["vocab_size"], seed=5)
    chunks = [[t] for t in pack_branches(seqs, max_tokens=512)]
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    # the other GPUs a cell would train on; with one GPU (or the CPU) a second copy on the same device
    others = other_devices(torch.device("cuda", 0)) if gpus > 1 else [device]
    kw = dict(objective="ppo", clip_low=0.2, clip_high=0.28)

    def burst(tr, reps) -> tuple[dict, float]:
        best = float("inf")
        for _ in range(repeats):
            tr.zero_gradients()
            _sync()
            t0 = time.perf_counter()
            if reps is None:
                for c in chunks:
                    tr.micro_step(c, 1.0, last=False, **kw)
            else:
                reps.micro_step(chunks, **kw)
            _sync()
            best = min(best, time.perf_counter() - t0)
        return {n: g.double().cpu() for n, g in tr.gradients().items()}, best

    model = tiny_model(dims, torch.float32, 4).to(device)
    one = Trainer(copy.deepcopy(model), lr=1e-4, zero_stage=1)
    g_one, s_one = burst(one, None)
    wide = Trainer(copy.deepcopy(model), lr=1e-4, zero_stage=1)
    reps = DeviceReplicas(wide, others)
    reps.follow(0)                    # the weights copied once, outside the timing
    g_wide, s_wide = burst(wide, reps)
    reps.close()
    return {"gpus": gpus, "replica_devices": others, "parallel": reps.parallel, "chunks": len(chunks),
            "chunks_by_device": reps.chunks_by_device, "grad_rel_err": _rel_err(g_wide, g_one),
            "one_device_s": s_one, "replicas_s": s_wide, "speedup": s_one / s_wide}


def check_engine(device: str = "cuda", n_prompts: int = 64, turns: int = 4, new_tokens: int = 16) -> dict:
    """Greedy multi-turn decoding on the GPU vs the CPU (same weights, prompts and observations)."""
    import random

    from gyre_core.engine.local import GenRequest, LocalEngine

    rng = random.Random(0)
    V = MODEL_DIMS["vocab_size"]
    prompts = [[rng.randrange(1, V) for _ in range(rng.randint(150, 300))] for _ in range(n_prompts)]
    obs = [[[rng.randrange(1, V) for _ in range(30)] for _ in range(turns)] for _ in range(n_prompts)]
    out: dict = {}
    gens: dict[str, list[list[int]]] = {}
    for dev in dict.fromkeys(("cpu", device)):
        model = tiny_model(MODEL_DIMS, torch.float32, 4).to(dev)
        eng = LocalEngine(model, [V - 1], seed=0, max_batch=n_prompts)
        ctx = [list(p) for p in prompts]
        eng.generate([GenRequest(f"w{i}", ctx[i][:20], 2, 0.0) for i in range(4)])      # warm-up
        _sync()
        t0, n_gen, got = time.perf_counter(), 0, [[] for _ in prompts]
        for t in range(turns):
            res = eng.generate([GenRequest(f"c{i}", ctx[i], new_tokens, 0.0) for i in range(n_prompts)])
            for i, r in enumerate(res):
                got[i] += r.completion_ids
                ctx[i] += r.completion_ids + obs[i][t]
                n_gen += len(r.completion_ids)
        _sync()
        dt = time.perf_counter() - t0
        out[f"tok_s_{'cpu' if dev == 'cpu' else 'gpu'}"] = n_gen / dt
        gens[dev] = got
    if device == "cpu":
        return out
    a, b = gens["cpu"], gens[device]
    out["identical_executions"] = sum(x == y for x, y in zip(a, b)) / len(a)
    out["tokens_agreeing_before_first_divergence"] = sum(
        next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))) for x, y in zip(a, b)
    ) / sum(len(x) for x in a)
    out["gpu_speedup"] = out["tok_s_gpu"] / out["tok_s_cpu"]
    out["cpu_threads"] = torch.get_num_threads()
    return out


def check_packing_speed(device: str = "cuda") -> dict:
    keep = ("tokens_flat", "tokens_computed", "token_ratio", "ideal_speedup", "time_flat_s", "time_packed_s",
            "measured_speedup", "efficiency", "time_flat_unpadded_s", "measured_speedup_vs_unpadded",
            "time_packed_dense_mask_s", "measured_speedup_dense_mask")
    out = {}
    for name, dims in (("tiny", MODEL_DIMS), ("wide", WIDE_DIMS)):
        # exactness is the tree_attention section's (on the GPU); this one times the production path
        r = bench_packing(G=8, repeats=3, dims=dims, with_dense=name == "tiny", with_exact=False)
        out[name] = {k: r.get(k) for k in keep}
        out[name]["dims"] = dims
    return out


def check_kernels(device: str = "cuda", repeats: int = 3, G: int = 8) -> dict:
    """Where packed training spends its time on the GPU: forward+backward of the same packed pieces with each
    tree-attention kernel (after warm-up), beside the flat padded batches, and building one block mask."""
    from gyre_core.processor.batch import micro_batches
    from gyre_core.trainer.packing import pack_branches
    from gyre_core.trainer.tree_attention import TreeMask, enable_tree_attention, flex_length

    out: dict = {}
    for name, dims in (("tiny", MODEL_DIMS), ("wide", WIDE_DIMS)):
        branches = branching_workload(G=G, K=4, fork_turns=(10, 14, 18), vocab=dims["vocab_size"], seed=0)
        trees = pack_branches(branches, max_tokens=8192)
        model = tiny_model(dims, torch.float32, 0).to(device)
        row: dict = {"pieces": [t.n_tokens for t in trees], "padded_to": [flex_length(t.n_tokens) for t in trees]}

        def timed(parts) -> float:
            ts = []
            for k in range(repeats + 2):
                _sync()
                t0 = time.perf_counter()
                for p in parts:
                    ppo_loss(model, p).backward()
                _sync()
                ts.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            return sorted(ts[2:])[len(ts[2:]) // 2]

        row["flat_padded_s"] = timed(micro_batches(branches, 8192))
        for kind in ("flex", "sparse", "dense") if torch.device(device).type == "cuda" else ("sparse", "dense"):
            enable_tree_attention(model, kind)
            row[f"packed_{kind}_s"] = timed([[t] for t in trees])
        t = trees[0]
        _sync()
        t0 = time.perf_counter()
        TreeMask(t.parent, t.subtree_end, t.position_ids).block_mask(device, flex_length(t.n_tokens))
        _sync()
        row["block_mask_s"] = time.perf_counter() - t0
        out[name] = row
    return out


def check_elastic(device: str = "cuda", steps: int = 3, root: str | None = None) -> dict:
    """prepare + warm start on the GPU, then real K = 2 cells on the one GPU, colocated and elastic."""
    from gyre_core import phases
    from gyre_core.config import load_config
    from gyre_core.elastic.runtime import run_elastic
    from gyre_core.phases.rl_on_cells import HarnessWork

    root = root or tempfile.mkdtemp(prefix="gyre-gpu-")
    out: dict = {}
    for policy in ("colocated", "elastic"):
        cfg = load_config("smoke", [
            f"run.out_root={root}/runs-{policy}", f"lake.root={root}/lake", f"model.device={device}",
            "elastic.enabled=true", "elastic.mode=real", "elastic.cells=2", "elastic.devices=2",
            f"elastic.policy={policy}", "elastic.capacity=8", "elastic.micro_step_executions=2",
            "rollout.tasks_per_step=4", f"rl.steps={steps}", "warmstart.episodes=80", "warmstart.steps=60"])
        t0 = time.perf_counter()
        run_dir = phases.prepare(cfg)
        phases.warm_start(run_dir)
        warm_s = time.perf_counter() - t0
        work = HarnessWork(run_dir, steps)
        res = run_elastic(cfg.elastic, work)
        d = res.to_dict()
        execs = [r for s in range(steps) for r in work.take_records(s)]
        published = sorted(os.listdir(os.path.join(run_dir, "weights")))
        out[policy] = {"prepare_warm_start_s": warm_s, "step_s": d["step_s"], "busy_frac": d["busy_frac"],
                       "switch_s_rollout_to_train": d["switch_s_rollout_to_train"],
                       "switch_s_train_to_rollout": d["switch_s_train_to_rollout"], "switches": d["switches"],
                       "cell_devices": d["cell_devices"], "dead_cells": d["dead_cells"], "notes": d["notes"],
                       "executions": len(execs), "failed": sum(r.status == "failed" for r in execs),
                       "success": sum(bool(r.success) for r in execs) / max(len(execs), 1),
                       "call_s_mean": d["call_s_mean"], "micro_steps": d["micro_steps"],
                       "published": published}
    return out


CHECKS = {"tree_attention": check_tree_attention, "trainer": check_trainer, "engine": check_engine,
          "cell_devices": check_cell_devices,
          "packing_speed": check_packing_speed, "elastic": check_elastic, "kernels": check_kernels}


def bench_gpu(sections=SECTIONS, device: str | None = None, out_dir: str | None = None) -> dict:
    """Run `sections`; each yields its figures, or {"error": ...} when it failed."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {"device": device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for name in sections:
        t0 = time.perf_counter()
        try:
            result[name] = CHECKS[name](device)
        except Exception as e:  # noqa: BLE001 - report and go on to the next section
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result[name]["wall_s"] = time.perf_counter() - t0
        print(f"gyre bench gpu: {name} done in {result[name]['wall_s']:.1f} s", file=sys.stderr, flush=True)
        if out_dir:
            with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                json.dump(result[name], f, indent=1, default=str)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--device", default=None, help="default: cuda when torch sees a GPU, else cpu")
    ap.add_argument("--out", default=None, help="also write each section's JSON into this folder")
    a = ap.parse_args(argv)
    print(json.dumps(bench_gpu(a.sections, a.device, a.out), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
