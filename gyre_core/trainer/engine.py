"""The training engine: DeepSpeed ZeRO around an HF causal LM, and the one micro-step function.

    trainer = Trainer(model, lr=1e-4, zero_stage=1, grad_clip=1.0)
    for chunk in chunks:                        # the normaliser is fixed when the batch closes
        trainer.micro_step(chunk, batch.normaliser, objective="ppo", ...)
    trainer.optimizer_step()

A micro-step takes plain sequences (padded rows) or packed trees from `packing.pack_branches` (one row
each, trained through tree attention; the model is switched to it on the first packed micro-step).

On this CPU machine DeepSpeed runs with `DS_ACCELERATOR=cpu` over gloo, the same code path that runs
on GPUs over NCCL. Gradients accumulate across micro-steps; only `optimizer_step()` updates, so the
update is identical however the batch is split.
"""
from __future__ import annotations

import os
import socket

import torch

from .losses import collate, nll_loss, ppo_clip_loss, token_logprobs


def ensure_tree_attention(model) -> None:
    """Packed trees need a tree attention implementation. sdpa/eager models switch to `gyre_tree` (which
    is sdpa for plain batches); a model already on a `gyre_tree*` one keeps it; anything else is refused."""
    from .tree_attention import NAMES, enable_tree_attention

    impl = model.config._attn_implementation
    if impl in NAMES.values():
        return
    if impl not in (None, "sdpa", "eager"):
        raise ValueError(f"packed trees need tree attention; the model uses {impl!r} "
                         "(load it with sdpa, or call tree_attention.enable_tree_attention(model))")
    enable_tree_attention(model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """One-process group on loopback unless a launcher already set one up."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


class Trainer:
    def __init__(self, model, *, lr: float, zero_stage: int = 1, grad_clip: float = 1.0,
                 weight_decay: float = 0.0, pad_id: int = 0):
        init_distributed()
        import deepspeed

        self.pad_id = pad_id
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        # Dropout off: the trainer's log-probs must be those of the policy the engine sampled from
        # (the PPO ratio and the behaviour/trainer mismatch metric assume it). Gradients flow as usual.
        self.engine.module.eval()
        self._pending = False

    @property
    def model(self):
        return self.engine.module

    def micro_step(self, seqs, normaliser: float, *, objective: str = "ppo", temperature: float = 1.0,
                   clip_low: float = 0.2, clip_high: float = 0.28, negative_scale: float = 1.0,
                   last: bool = False) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate until `optimizer_step()`.

        `last` marks the final micro-step of the batch (DeepSpeed reduces gradients on it). Returns sums
        over the micro-batch's scored tokens (divide by `tokens` for means).
        """
        c = self._collate(seqs)
        self.engine.set_gradient_accumulation_boundary(last)
        out = self.engine(**c.model_inputs())
        logp, entropy = token_logprobs(out.logits, c, temperature)
        if objective == "ppo":
            loss, stats = ppo_clip_loss(logp, c, clip_low, clip_high, normaliser, negative_scale)
        elif objective == "nll":
            loss, stats = nll_loss(logp, c, normaliser)
        else:
            raise ValueError(f"objective must be 'ppo' or 'nll', got {objective!r}")
        self.engine.backward(loss)
        self._pending = True
        stats.update(loss=loss.item(), tokens=float(c.tgt.numel()), entropy=entropy.detach().sum().item(),
                     nll=-logp.detach().sum().item())
        return stats

    @torch.no_grad()
    def policy_shift(self, seqs, *, temperature: float = 1.0, clip_low: float = 0.2,
                     clip_high: float = 0.28) -> dict[str, float]:
        """After an update: how far the policy moved from the behaviour policy on these sequences.

        Sums over scored tokens of the k3 estimate of KL(μ‖π) and of ratios outside the clip range.
        """
        c = self._collate(seqs)
        out = self.engine(**c.model_inputs())
        logp, _ = token_logprobs(out.logits, c, temperature)
        log_r = logp.double() - c.old_logprobs
        r = log_r.exp()
        return {"kl": ((r - 1) - log_r).sum().item(), "tokens": float(c.tgt.numel()),
                "clipped": ((r < 1 - clip_low) | (r > 1 + clip_high)).double().sum().item()}

    def _collate(self, seqs):
        """Plain sequences, or packed trees (the model is switched to tree attention on first sight)."""
        c = collate(seqs, self.pad_id)
        if c.tree is not None:
            ensure_tree_attention(self.model)
        return c

    def optimizer_step(self) -> float:
        """Apply the accumulated gradient (clipped); returns the gradient norm before clipping."""
        if not self._pending:
            return 0.0
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError("optimizer_step() before the micro-step marked last=True")
        self.engine.step()
        self._pending = False
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)

    def load(self, ckpt_dir: str, tag: str) -> dict:
        path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {ckpt_dir}")
        return client_state or {}
