"""Exact tree packing against independent references: hand-built layouts, per-branch training, dense masks.

    .venv/bin/python -m pytest -q tests/core/test_packing.py
"""
import copy
import math
import random
import warnings

import pytest
import torch

from bench.processor_packing import exact_float64
from gyre_core.processor.batch import TrainSequence
from gyre_core.trainer import tree_attention
from gyre_core.trainer.losses import collate, ppo_clip_loss, token_logprobs
from gyre_core.trainer.packing import pack_branches, packing_stats
from gyre_core.trainer.tree_attention import TreeMask, enable_tree_attention


def _branch(ids, weights, old=None, adv=None, name="e"):
    L = len(ids)
    old = old or [-0.5 - 0.1 * j for j in range(L)]
    adv = adv or [1.0] * L
    return TrainSequence(name, 0, list(ids), [j - 1 for j in range(L)], old, adv, list(weights))


# ------------------------------------------------------------------ layout by hand

def test_layout_by_hand_scores_a_fork_from_its_parent_not_the_previous_token():
    A = _branch([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], adv=[0.0, 1.0, 1.0, 1.0, 1.0])
    B = _branch([1, 2, 3, 6, 7], [0, 1, 0, 2, 2], adv=[0.0, -1.0, 0.0, -1.0, -1.0])
    C = _branch([1, 2, 8], [0, 3, 3])
    D = _branch([1, 2, 3, 4, 5, 9, 9], [0, 0, 0, 0, 4, 0, 0])   # tail after its last weighted token: dropped
    (t,) = pack_branches([A, B, C, D])
    assert t.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert t.parent.tolist() == [-1, 0, 1, 2, 3, 2, 5, 1]
    assert t.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 2]
    assert t.subtree_end.tolist() == [8, 8, 7, 5, 5, 7, 7, 8]
    entries = sorted(zip(t.branch.tolist(), t.token.tolist(), t.src.tolist(), t.tgt.tolist(), t.weights.tolist(),
                         t.advantages.tolist()))
    assert entries == [
        (0, 1, 0, 2, 1.0, 1.0), (0, 2, 1, 3, 1.0, 1.0), (0, 3, 2, 4, 1.0, 1.0), (0, 4, 3, 5, 1.0, 1.0),
        (1, 1, 0, 2, 1.0, -1.0), (1, 5, 2, 6, 2.0, -1.0), (1, 6, 5, 7, 2.0, -1.0),   # token 6: from 3, not 5
        (2, 1, 0, 2, 3.0, 1.0), (2, 7, 1, 8, 3.0, 1.0),                               # token 8: from 2, not 7
        (3, 4, 3, 5, 4.0, 1.0),
    ]
    # behaviour log-probs travel with their branch
    assert t.old_logprobs[(t.branch == 1) & (t.token == 5)].item() == pytest.approx(-0.8)
    assert t.n_owned == 8
    assert packing_stats([A, B, C, D], [t])["tokens_flat"] == 5 + 5 + 3 + 7


def test_split_recomputes_exactly_the_ancestors_of_a_piece_start():
    A = _branch([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])
    B = _branch([1, 2, 3, 6, 7], [0, 1, 1, 1, 1])
    C = _branch([1, 2, 8], [0, 1, 1])
    p1, p2 = pack_branches([A, B, C], max_tokens=6)
    # pre-order 1 2 3 4 5 | 6 7 8 ; the cut goes at the shallowest token of the window (6, depth 3),
    # so the second piece recomputes 6's ancestors 1 2 3
    assert p1.input_ids.tolist() == [1, 2, 3, 4, 5] and p1.n_owned == 5
    assert p2.input_ids.tolist() == [1, 2, 3, 6, 7, 8] and p2.n_owned == 3
    assert p2.parent.tolist() == [-1, 0, 1, 2, 3, 1]
    assert p2.position_ids.tolist() == [0, 1, 2, 3, 4, 2]
    assert p2.subtree_end.tolist() == [6, 6, 5, 5, 5, 6]
    # each (token, branch) is scored exactly once, in the piece that owns the token
    assert sorted(zip(p2.branch.tolist(), p2.tgt.tolist(), p2.src.tolist())) == [(1, 6, 2), (1, 7, 3), (2, 8, 1)]
    assert p1.tgt.numel() + p2.tgt.numel() == 4 + 4 + 2
    st = packing_stats([A, B, C], [p1, p2])
    assert (st["tokens_unique"], st["tokens_computed"]) == (8, 11)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="root-to-leaf"):
        pack_branches([TrainSequence("e", 0, [1, 2, 3], [-1, 0, 0], [0.0] * 3, [1.0] * 3, [0, 1, 1])])
    with pytest.raises(ValueError, match="max_tokens"):
        pack_branches([_branch([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])], max_tokens=3)
    assert pack_branches([_branch([1, 2, 3], [1, 0, 0])]) == []     # nothing scored: nothing to pack


# ------------------------------------------------------------------ random forests, float64 models

def random_forest(seed: int, weighting: str, vocab: int = 40):
    """Several trees; prefixes shared at random depths; identical paths with other mu/A/w; masked tokens."""
    rng = random.Random(seed)
    branches = []
    for tree in range(3):
        root = [3 + tree] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 6))]
        paths = [root + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]]
        for _ in range(rng.randint(2, 5)):
            base = rng.choice(paths)
            cut = rng.randint(1, len(base))
            tail = [] if rng.random() < 0.25 else [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
            paths.append(base[:cut] + tail)            # a fork, a strict prefix, or an identical path
        for ids in paths:
            L = len(ids)
            w = [rng.choice([0.0, 0.0, 0.5, 1.0, 2.0]) if j else 0.0 for j in range(L)]
            branches.append(TrainSequence(f"t{tree}", 0, ids, [j - 1 for j in range(L)],
                                          [-rng.uniform(0.05, 4.0) for _ in range(L)],
                                          [rng.uniform(-2, 2) for _ in range(L)], w))
    if weighting == "loss_once":                        # a shared token's weight is carried by one branch
        seen = set()
        for b in branches:
            for j in range(len(b.input_ids)):
                key = tuple(b.input_ids[:j + 1])
                if b.weights[j] and key in seen:
                    b.weights[j] = 0.0
                elif b.weights[j]:
                    seen.add(key)
    rng.shuffle(branches)
    return branches


def f64_model(seed=0, vocab=40, layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return exact_float64(Qwen2ForCausalLM(cfg).double().eval())


def _loss(model, items, norm):
    c = collate(items, 0)
    logp, _ = token_logprobs(model(**c.model_inputs()).logits, c)
    return ppo_clip_loss(logp, c, 0.2, 0.28, norm)[0]


@pytest.fixture(scope="module")
def model64():
    return f64_model()


@pytest.mark.parametrize("weighting", ["per_branch", "loss_once"])
@pytest.mark.parametrize("max_tokens", [None, 24])
@pytest.mark.parametrize("blocks", [(32, 512), (2, 5)])
def test_packed_gradient_equals_per_branch_training_float64(model64, weighting, max_tokens, blocks, monkeypatch):
    # default query blocks (short spans merged), and tiny ones (chains cut, gathered ancestors everywhere)
    monkeypatch.setattr(tree_attention, "MIN_BLOCK", blocks[0])
    monkeypatch.setattr(tree_attention, "MAX_BLOCK", blocks[1])
    branches = random_forest(seed=7, weighting=weighting)
    ref, packed = copy.deepcopy(model64), copy.deepcopy(model64)
    enable_tree_attention(packed, "sparse")
    l_ref = _loss(ref, branches, 3.0)        # the plain path: every branch its own (padded) row
    l_ref.backward()
    trees = pack_branches(branches, max_tokens=max_tokens)
    if max_tokens:
        assert len(trees) > 1 and all(t.n_tokens <= max_tokens for t in trees)
    l_pk = 0.0
    for t in trees:                          # micro-steps: gradients accumulate
        loss = _loss(packed, [t], 3.0)
        loss.backward()
        l_pk += loss.item()
    assert abs(l_pk - l_ref.item()) <= 1e-12
    for (name, p), q in zip(packed.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-10 * q.grad.norm(), name
    st = packing_stats(branches, trees)
    assert st["tokens_unique"] < st["tokens_flat"]


def test_split_and_unsplit_packs_give_the_same_gradient(model64):
    branches = random_forest(seed=11, weighting="per_branch")
    grads = []
    for mt in (None, 20):
        m = copy.deepcopy(model64)
        enable_tree_attention(m, "sparse")
        trees = pack_branches(branches, max_tokens=mt)
        sum(_loss(m, [t], 1.0) for t in trees).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for g0, g1 in zip(*grads):
        assert (g0 - g1).norm() <= 1e-10 * g0.norm()


def test_several_packed_trees_in_one_row_equal_separate_micro_steps(model64):
    trees = pack_branches(random_forest(seed=3, weighting="per_branch"), max_tokens=24)
    a, b = copy.deepcopy(model64), copy.deepcopy(model64)
    enable_tree_attention(a, "sparse"); enable_tree_attention(b, "sparse")
    _loss(a, trees, 1.0).backward()
    sum(_loss(b, [t], 1.0) for t in trees).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-10 * q.grad.norm()


def test_restarting_positions_without_the_tree_are_not_enough(model64):
    """The reason the tree travels to the attention: plain sdpa with depth position ids is wrong."""
    branches = random_forest(seed=5, weighting="per_branch")
    (t,) = pack_branches(branches)
    c = collate([t], 0)
    with torch.no_grad():
        good = _loss(enable_and_copy(model64, "sparse"), [t], 1.0)
        plain = copy.deepcopy(model64)
        logits = plain(input_ids=c.input_ids, position_ids=c.position_ids, use_cache=False).logits
        bad = ppo_clip_loss(token_logprobs(logits, c)[0], c, 0.2, 0.28, 1.0)[0]
        ref = _loss(copy.deepcopy(model64), branches, 1.0)
    assert good.item() == pytest.approx(ref.item(), abs=1e-12)
    assert abs(bad.item() - ref.item()) > 1e-6


def enable_and_copy(model, kind):
    m = copy.deepcopy(model)
    enable_tree_attention(m, kind)
    return m


# ------------------------------------------------------------------ the attention paths

def _random_tree_mask(seed, n_roots=3, n=60):
    rng = random.Random(seed)
    paths = []
    for r in range(n_roots):
        paths.append([100 * r] + [rng.randrange(3) for _ in range(rng.randint(2, n // n_roots))])
    for _ in range(6):
        base = rng.choice(paths)
        paths.append(base[:rng.randint(1, len(base))] + [rng.randrange(3, 6) for _ in range(rng.randint(1, 12))])
    (t,) = pack_branches([_branch(p, [0] + [1] * (len(p) - 1)) for p in paths])
    return TreeMask(t.parent, t.subtree_end)


def _brute_force(q, k, v, tree, scale):
    """Per query: softmax over exactly its ancestors and itself, found by walking parent pointers."""
    H, Hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    par = tree.parent.tolist()
    for i in range(q.shape[2]):
        keys, j = [], i
        while j >= 0:
            keys.append(j); j = par[j]
        idx = torch.tensor(keys)
        for h in range(H):
            kk, vv = k[0, h // (H // Hkv), idx], v[0, h // (H // Hkv), idx]
            out[0, h, i] = torch.softmax(q[0, h, i] @ kk.T * scale, -1) @ vv
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_attention_equals_dense_mask_outputs_and_grads(seed, monkeypatch):
    monkeypatch.setattr(tree_attention, "MAX_BLOCK", 7)      # exercise long chains cut into blocks
    monkeypatch.setattr(tree_attention, "MIN_BLOCK", 4)      # and short spans merged into one block
    tree = _random_tree_mask(seed)
    N = tree.n
    g = torch.Generator().manual_seed(seed)
    q0, k0, v0 = (torch.randn(1, h, N, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    grads = {}
    for kind in ("sparse", "dense"):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        fn = tree_attention._make(kind)
        module = torch.nn.Module(); module.num_key_value_groups = 2; module.is_causal = True
        out, _ = fn(module, q, k, v, None, scaling=0.3, gyre_tree=TreeMask(tree.parent, tree.subtree_end))
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[kind] = (out.detach(), q.grad, k.grad, v.grad)
    ref = _brute_force(q0, k0, v0, tree, 0.3).transpose(1, 2)
    assert torch.allclose(grads["dense"][0], ref, atol=1e-13)
    for a, b in zip(grads["sparse"], grads["dense"]):
        assert torch.allclose(a, b, atol=1e-13, rtol=0)
    done, needed = TreeMask(tree.parent, tree.subtree_end).key_pairs()
    assert needed <= done < N * N              # sparse: far fewer than the N^2 pairs of the dense mask


def test_flex_block_mask_equals_dense_forward_on_cpu():
    """FlexAttention runs uncompiled (forward only) on CPU; the GPU path compiles the same mask_mod."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    tree = _random_tree_mask(4, n=150)
    N = tree.n
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, 16, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module(); module.num_key_value_groups = 2; module.is_causal = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "flex_attention called without torch.compile()": intended here
        flex, _ = tree_attention._make("flex")(module, q, k, v, None, scaling=0.25, gyre_tree=tree)
        dense, _ = tree_attention._make("dense")(module, q, k, v, None, scaling=0.25, gyre_tree=tree)
    assert torch.allclose(flex, dense, atol=1e-5)


def test_flex_rows_are_padded_to_a_few_compiled_lengths_and_small_heads_are_refused():
    # whole 128-token blocks, a power of two of them: one compiled kernel per length
    assert [tree_attention.flex_length(n) for n in (1, 128, 129, 256, 300, 513, 5000)] == \
        [128, 128, 256, 256, 512, 1024, 8192]
    tree = _random_tree_mask(1, n=40)
    q, k, v = (torch.randn(1, h, tree.n, 8) for h in (4, 2, 2))
    module = torch.nn.Module(); module.num_key_value_groups = 2; module.is_causal = True
    with pytest.raises(NotImplementedError, match="at least 16"):
        tree_attention._make("flex")(module, q, k, v, None, scaling=0.25, gyre_tree=tree)


def test_a_tree_enabled_model_runs_plain_batches_exactly_as_sdpa(model64):
    branches = random_forest(seed=2, weighting="per_branch")
    c = collate(branches, 0)
    with torch.no_grad():
        a = copy.deepcopy(model64)(**c.model_inputs()).logits
        b = enable_and_copy(model64, "auto")(**c.model_inputs()).logits
    assert torch.equal(a, b)


# ------------------------------------------------------------------ through the production micro-step

def test_trainer_micro_step_on_packed_trees_matches_per_branch_sequences():
    from gyre_core.model import build_tiny_model, train_tokenizer
    from gyre_core.trainer.trainer import Trainer

    tok = train_tokenizer(["go left go right pick up the red ball"] * 20, vocab_size=280)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=64,
                             max_positions=64, seed=0)
    branches = random_forest(seed=9, weighting="loss_once", vocab=250)
    norms, params = [], []
    for packed in (False, True):
        trainer = Trainer(copy.deepcopy(model), lr=1e-3, zero_stage=1, grad_clip=1e9)
        parts = [[t] for t in pack_branches(branches, max_tokens=30)] if packed else [branches[:5], branches[5:]]
        for k, part in enumerate(parts):
            trainer.micro_step(part, 3.0, objective="ppo", last=k == len(parts) - 1)
        norms.append(trainer.optimizer_step())
        params.append([p.detach().clone() for p in trainer.model.parameters()])
        if packed:
            assert trainer.model.config._attn_implementation == "gyre_tree"
            shift = trainer.policy_shift(parts[0])          # the no-grad path takes packed trees too
            assert shift["tokens"] == parts[0][0].tgt.numel()
    assert norms[0] > 0 and math.isclose(norms[1], norms[0], rel_tol=1e-5)
    # Adam's first step is lr·g/(|g|+ε): float32 rounding in a component with |g| near ε moves it by a
    # few 1e-6, while a wrong gradient moves components by about lr = 1e-3
    for p, q in zip(*params):
        assert torch.allclose(p, q, atol=2e-5)
