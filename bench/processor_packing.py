"""Exact tree-packed training vs training every branch as its own sequence: exactness and speed.

    python -m bench.processor_packing          # prints JSON figures
    bench_packing()                            # the same dict (merged into `gyre bench processor --json`)

Exactness: the gradient of the packed loss against the per-branch loss on the same branches with the
same per-(token, branch) weights, in float64 (RMSNorm computed in float64, see `exact_float64`) and in
float32, as the largest per-tensor ||g_packed - g_branch|| / ||g_branch||.

Speed: a branching workload shaped like the BabyAI agent runs (a stand-in until the synthetic generator
lands): G executions of one task share a prompt; each turn appends ~40 context tokens and generates 2;
the executions of a deterministic environment share a prefix for as long as they take the same actions;
at a few turns K continuations are forked from the saved state. The same production `Trainer.micro_step`
trains the flattened branches (micro-batches of <= max_tokens padded tokens, the existing path) and the
packed trees (pieces of <= max_tokens tokens); both are timed side by side, median of `repeats`.
`ideal_speedup` is the analytic FLOP ratio (linear layers per token + attention key pairs per token).
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import statistics
import time
import types

import torch

from gyre_core.processor.batch import TrainSequence, micro_batches
from gyre_core.trainer.losses import collate, ppo_clip_loss, token_logprobs
from gyre_core.trainer.packing import pack_branches, packing_stats
from gyre_core.trainer.tree_attention import TreeMask, enable_tree_attention

# the default preset's tiny model
MODEL_DIMS = {"hidden_size": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 384,
              "vocab_size": 512}


def tiny_model(dims: dict = MODEL_DIMS, dtype=torch.float32, seed: int = 0, max_positions: int = 8192):
    """A Qwen2ForCausalLM with `dims` (no tokenizer needed: the workload is token ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
                      intermediate_size=dims["ffn_size"], num_hidden_layers=dims["num_layers"],
                      num_attention_heads=dims["num_heads"], num_key_value_heads=dims["num_kv_heads"],
                      max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model.eval()


def _rmsnorm_float64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def exact_float64(model):
    """HF's RMSNorm computes in float32 even in a float64 model, which alone caps any float64 comparison
    near 1e-7; this computes it in the input dtype (same formula) so the comparison sees packing alone."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_rmsnorm_float64, mod)
    return model


# ---------------------------------------------------------------- workload


def _tokens(key: str, n: int, vocab: int) -> list[int]:
    """Deterministic token ids for a piece of context (same history -> same observation)."""
    out, i = [], 0
    while len(out) < n:
        h = hashlib.blake2b(f"{key}/{i}".encode(), digest_size=32).digest()
        out.extend(3 + b % (vocab - 3) for b in h)
        i += 1
    return out[:n]


def branching_workload(G: int = 8, prompt_tokens: int = 300, turns: tuple[int, int] = (16, 28),
                       obs_tokens: tuple[int, int] = (34, 46), gen_tokens: int = 2, n_actions: int = 6,
                       K: int = 4, fork_turns: tuple[int, ...] = (10, 14, 18), p_expert: float = 0.75,
                       vocab: int = 512, weighting: str = "per_branch", seed: int = 0) -> list[TrainSequence]:
    """Root-to-leaf branches of G executions of one task (see the module doc).

    Each execution's trunk runs to its own length; at each fork turn K continuations restart from the
    state after that turn with their own action draws. `per_branch` weights: 1/(trainable tokens of the
    execution's branches) on every generated token of every branch; `loss_once`: a token shared by several
    branches of an execution keeps its weight on the first branch only. Advantages: one per execution.
    """
    rng = random.Random(seed)
    prompt = _tokens(f"prompt{seed}", prompt_tokens, vocab)
    branches: list[TrainSequence] = []
    for g in range(G):
        length = rng.randint(*turns)
        adv = rng.choice([-1.0, -0.5, 0.5, 1.0])

        def run(history: list[int], start: int, stream: random.Random):
            ids, gen, acts = list(history[0]), list(history[1]), list(history[2])
            for t in range(start, length):
                # a warm-started policy: the expert's action (a function of the history) most of the time
                expert = _tokens(f"expert{seed}/{'.'.join(map(str, acts))}", 1, 1 << 20)[0] % n_actions
                a = expert if stream.random() < p_expert else stream.randrange(n_actions)
                acts.append(a)
                act_ids = _tokens(f"act{a}", gen_tokens, vocab)
                gen.extend(range(len(ids), len(ids) + gen_tokens))
                ids.extend(act_ids)
                if t < length - 1:      # the environment's reply, a function of the action history
                    key = f"obs{seed}/{'.'.join(map(str, acts))}"
                    n_obs = obs_tokens[0] + _tokens(key + "/n", 1, 1 << 20)[0] % (obs_tokens[1] - obs_tokens[0] + 1)
                    ids.extend(_tokens(key, n_obs, vocab))
                yield t, (ids, gen, acts)

        paths, saved = [], {}
        trunk = None
        for t, state in run((prompt, [], []), 0, random.Random(rng.random())):
            if t + 1 in fork_turns and t + 1 < length:
                saved[t + 1] = (list(state[0]), list(state[1]), list(state[2]))
            trunk = state
        paths.append(trunk)
        for ft in fork_turns:
            if ft in saved:
                for _ in range(K):
                    for _, state in run(saved[ft], ft, random.Random(rng.random())):
                        pass
                    paths.append(state)
        n_train = sum(len(p[1]) for p in paths)
        seen: set[tuple[int, ...]] = set()
        for p_i, (ids, gen, _) in enumerate(paths):
            L = len(ids)
            w, old = [0.0] * L, [0.0] * L
            for j in gen:
                key = tuple(ids[:j + 1])
                if weighting == "loss_once":
                    if key in seen:
                        continue
                    seen.add(key)
                w[j] = 1.0 / n_train
                old[j] = -rng.uniform(0.05, 2.0)
            branches.append(TrainSequence(f"e{g}", p_i, ids, [j - 1 for j in range(L)], old,
                                          [adv if w[j] else 0.0 for j in range(L)], w))
    return branches


# ---------------------------------------------------------------- exactness


def ppo_loss(model, items, normaliser: float = 1.0):
    c = collate(items, 0).to(next(model.parameters()).device)
    logp, _ = token_logprobs(model(**c.model_inputs()).logits, c)
    return ppo_clip_loss(logp, c, 0.2, 0.28, normaliser)[0]


def grad_errors(model, branches, max_tokens: int | None, kind: str = "sparse", normaliser: float = 1.0):
    """(largest per-tensor relative gradient error, loss abs error) of packed vs per-branch training.

    The reference trains each branch as its own sequence (the existing padded path), one backward per
    micro-batch, same weights and normaliser; the packed side accumulates over the pieces.
    """
    ref, packed = copy.deepcopy(model), copy.deepcopy(model)
    enable_tree_attention(packed, kind)
    l_ref = sum(ppo_loss(ref, [b], normaliser) for b in branches)
    l_ref.backward()
    l_pk = 0.0
    for piece in pack_branches(branches, max_tokens=max_tokens):
        loss = ppo_loss(packed, [piece], normaliser)
        loss.backward()
        l_pk += loss.item()
    err = 0.0
    for p, q in zip(packed.parameters(), ref.parameters()):
        if q.grad is not None and q.grad.norm() > 0:
            err = max(err, ((p.grad - q.grad).norm() / q.grad.norm()).item())
    return err, abs(l_pk - l_ref.item())


# ---------------------------------------------------------------- speed


def flop_model(dims: dict) -> tuple[float, float]:
    """(FLOPs per token in the linear layers, FLOPs per attention key pair), forward; backward ~2x both."""
    h, L, Hq, Hkv, f, V = (dims[k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                              "ffn_size", "vocab_size"))
    dh = h // Hq
    linear = 2 * (L * (h * Hq * dh + 2 * h * Hkv * dh + Hq * dh * h + 3 * h * f) + h * V)
    attn = 2 * L * Hq * dh * 2
    return float(linear), float(attn)


def _depths(tree) -> torch.Tensor:
    return tree.position_ids.double()


def ideal_speedup(branches, trees, dims: dict) -> tuple[float, dict]:
    lin, att = flop_model(dims)
    lens = [len(b.input_ids) for b in branches]
    pairs_flat = sum(n * (n + 1) / 2 for n in lens)
    pairs_tree = sum(float((_depths(t) + 1).sum()) for t in trees)
    flat = lin * sum(lens) + att * pairs_flat
    packed = lin * sum(t.n_tokens for t in trees) + att * pairs_tree
    return flat / packed, {"attn_pairs_flat": pairs_flat, "attn_pairs_tree": pairs_tree,
                           "attn_share_flat": att * pairs_flat / flat, "attn_share_packed": att * pairs_tree / packed}


def _train_pass(trainer, parts, normaliser: float) -> float:
    t0 = time.perf_counter()
    for k, part in enumerate(parts):
        trainer.micro_step(part, normaliser, objective="ppo", last=k == len(parts) - 1)
    dt = time.perf_counter() - t0
    trainer.engine.zero_grad()
    trainer._pending = False
    return dt


def _time_share(trainer, part, normaliser: float) -> dict[str, float]:
    """Where a packed micro-step spends its CPU time (torch profiler, self time by operator family)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_pass(trainer, [part], normaliser)
    fam = {"attention": ("scaled_dot_product", "flash_attention"), "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
           "gather_scatter": ("index_select", "index_add", "index", "gather", "scatter")}
    total, share = 0.0, dict.fromkeys(fam, 0.0)
    for ev in prof.key_averages():
        total += ev.self_cpu_time_total
        for k, keys in fam.items():
            if any(x in ev.key for x in keys):
                share[k] += ev.self_cpu_time_total
                break
    share = {k: v / total for k, v in share.items()}
    share["other"] = 1 - sum(share.values())
    return share


def bench_packing(G: int = 8, K: int = 4, fork_turns: tuple[int, ...] = (10, 14, 18), max_tokens: int = 8192,
                  repeats: int = 3, dims: dict = MODEL_DIMS, threads: int | None = None, seed: int = 0,
                  exact_G: int = 3, with_dense: bool = True, with_unpadded: bool = True,
                  with_exact: bool = True) -> dict:
    """All figures as one flat dict (see the module doc); `with_exact=False` skips the exactness part
    (it runs on the CPU in float64, slow for wide models)."""
    from gyre_core.trainer.trainer import Trainer

    if threads:
        torch.set_num_threads(threads)
    out: dict = {}
    # exactness: a smaller forest of the same shape, both weightings, split and unsplit
    small = dict(G=exact_G, K=2, turns=(5, 9), fork_turns=(2, 4), prompt_tokens=40, obs_tokens=(6, 10),
                 vocab=dims["vocab_size"], seed=seed + 1)
    m64 = exact_float64(tiny_model(dims, torch.float64, seed)) if with_exact else None
    m32 = tiny_model(dims, torch.float32, seed) if with_exact else None
    errs64, loss64, errs32 = [], [], []
    for weighting in ("per_branch", "loss_once") if with_exact else ():
        br = branching_workload(weighting=weighting, **small)
        split = max(len(b.input_ids) for b in br) + 8      # forces pieces that recompute ancestors
        for mt in (None, split):
            e, dl = grad_errors(m64, br, mt)
            errs64.append(e); loss64.append(dl)
        errs32.append(grad_errors(m32, br, split)[0])
    if with_exact:
        out["grad_max_rel_err_fp64"] = max(errs64)
        out["loss_abs_err_fp64"] = max(loss64)
        out["grad_max_rel_err_fp32"] = max(errs32)

    # the branching workload
    t0 = time.perf_counter()
    branches = branching_workload(G=G, K=K, fork_turns=fork_turns, vocab=dims["vocab_size"], seed=seed)
    trees = pack_branches(branches, max_tokens=max_tokens)
    out["pack_s"] = time.perf_counter() - t0
    stats = packing_stats(branches, trees)
    out.update({k: stats[k] for k in ("tokens_flat", "tokens_unique", "tokens_computed", "token_ratio")})
    out["n_branches"] = len(branches)
    out["branch_tokens_max"] = max(len(b.input_ids) for b in branches)
    ideal, parts = ideal_speedup(branches, trees, dims)
    out["ideal_speedup"] = ideal
    out.update(parts)
    flat_parts = micro_batches(branches, max_tokens)
    out["flat_padding_frac"] = 1 - stats["tokens_flat"] / sum(len(p) * max(len(s.input_ids) for s in p)
                                                              for p in flat_parts)
    done = needed = 0
    for t in trees:
        d, n = TreeMask(t.parent, t.subtree_end, t.position_ids).key_pairs()
        done += d; needed += n
    out["sparse_key_pair_overhead"] = done / needed

    trainer = Trainer(tiny_model(dims, torch.float32, seed), lr=1e-4, zero_stage=1, grad_clip=1.0)
    packed_parts = [[t] for t in trees]
    norm = float(G)
    _train_pass(trainer, packed_parts[:1], norm)         # warm up both paths once
    _train_pass(trainer, flat_parts[:1], norm)
    t_flat, t_packed, t_dense = [], [], []
    for _ in range(repeats):
        t_flat.append(_train_pass(trainer, flat_parts, norm))
        t_packed.append(_train_pass(trainer, packed_parts, norm))
    out["time_flat_s"] = statistics.median(t_flat)
    out["time_packed_s"] = statistics.median(t_packed)
    out["measured_speedup"] = out["time_flat_s"] / out["time_packed_s"]
    out["efficiency"] = out["measured_speedup"] / ideal
    if with_unpadded:        # the flat branches one per micro-step: no padding, sdpa's causal kernel
        t_unp = [_train_pass(trainer, [[b] for b in branches], norm) for _ in range(max(1, repeats // 2))]
        out["time_flat_unpadded_s"] = statistics.median(t_unp)
        out["measured_speedup_vs_unpadded"] = out["time_flat_unpadded_s"] / out["time_packed_s"]
        out["efficiency_vs_unpadded"] = out["measured_speedup_vs_unpadded"] / ideal
    out["packed_time_share"] = _time_share(trainer, packed_parts[0], norm)
    if with_dense:                                       # the same packed trees through an N x N mask
        enable_tree_attention(trainer.model, "dense")
        for _ in range(max(1, repeats // 2)):
            t_dense.append(_train_pass(trainer, packed_parts, norm))
        out["time_packed_dense_mask_s"] = statistics.median(t_dense)
        out["measured_speedup_dense_mask"] = out["time_flat_s"] / out["time_packed_dense_mask_s"]
    out["threads"] = torch.get_num_threads()
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--G", type=int, default=8)
    a = ap.parse_args()
    print(json.dumps(bench_packing(G=a.G, repeats=a.repeats, threads=a.threads), indent=1))
