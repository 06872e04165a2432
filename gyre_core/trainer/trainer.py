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

Streaming (`gyre_core.elastic.stream`) does not know which micro-step is the last one, nor the step's
normaliser, until the burst is over: it runs every micro-step with `last=False` and normaliser 1, moves
satellite gradients in with `gradients()` / `add_gradients()`, and closes with
`finish_accumulation(scale=1/n_executions)`.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading

import torch

from .losses import collate, decoupled_ppo_loss, nll_loss, ppo_clip_loss, scored_logits, token_logprobs


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


def init_distributed() -> None:
    """The process group DeepSpeed needs. Set up by a launcher (MASTER_ADDR in the environment): that one.
    Otherwise one rank whose store lives in memory and whose gloo/NCCL sockets bind to loopback, so a
    training process listens on nothing another machine can reach (torch's TCPStore, the default, listens
    on every interface and checks nobody)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        lo = loopback_interface()
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:                                   # a launcher's group: what it left out, as torch's env init needs
        os.environ.setdefault("MASTER_PORT", "29500")
        for k in ("RANK", "LOCAL_RANK"):
            os.environ.setdefault(k, "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def loopback_interface() -> str | None:
    """The loopback network interface's name ("lo" on Linux, "lo0" on macOS), if this host has one."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


_DETERMINISTIC = {"lock": threading.Lock(), "depth": 0, "saved": None}


@contextlib.contextmanager
def _reproducible(device: torch.device):
    """Deterministic kernels for one CPU forward + backward, then the process's own setting back.

    With several threads the backward of tree attention's `index_select` adds into the key gradient in a
    thread-dependent order: two runs of one update differed by ~1 ulp, so a resumed or replayed run drifted
    from the original. The cost is ~1% of an update (`bench/deterministic_update.py`). Scoped, not
    process-wide: set process-wide, the test suite's process grew to 21 GB; the flag also fills every
    `torch.empty` (the likely cause), so that filling stays off here. The flag is the process's: when
    several threads train at once (`replicas.DeviceReplicas`), the first to enter sets it and the last to
    leave puts the process's own setting back."""
    if device.type != "cpu":
        yield
        return
    import torch.utils.deterministic as det

    state = _DETERMINISTIC
    with state["lock"]:
        if state["depth"] == 0:
            state["saved"] = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
            torch.use_deterministic_algorithms(True, warn_only=True)
            det.fill_uninitialized_memory = False
        state["depth"] += 1
    try:
        yield
    finally:
        with state["lock"]:
            state["depth"] -= 1
            if state["depth"] == 0:
                was, warn_only, fill = state["saved"]
                torch.use_deterministic_algorithms(was, warn_only=warn_only)
                det.fill_uninitialized_memory = fill


def _checkpoint_without_dropout(model) -> None:
    """HF recomputes activations only in training mode, which would turn dropout on: zero every dropout
    rate first, then switch checkpointing and training mode on (log-probs stay those of the eval model)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    cfg = model.config.get_text_config(decoder=True)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if getattr(cfg, name, 0):
            setattr(cfg, name, 0.0)
    enable = getattr(model, "activation_checkpointing_enable", None)   # transformers ≥ 5.2x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def policy_loss(forward, c, normaliser: float, *, objective: str = "ppo", temperature: float = 1.0,
                clip_low: float = 0.2, clip_high: float = 0.28, negative_scale: float = 1.0, is_cap: float = 2.0,
                prox_logprobs=None, entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one collated micro-batch `c` under `forward` (a model, or DeepSpeed's engine around it)
    and its sums over the scored tokens; the caller back-propagates it (`Trainer.micro_step`, or a gradient
    replica on another device, `replicas.DeviceReplicas`). Arguments as `Trainer.micro_step`'s."""
    logp, entropy = token_logprobs(scored_logits(forward, c), c, temperature)
    if objective == "ppo":
        loss, stats = ppo_clip_loss(logp, c, clip_low, clip_high, normaliser, negative_scale)
    elif objective == "decoupled":
        prox = None if prox_logprobs is None else torch.as_tensor(prox_logprobs, dtype=torch.float64,
                                                                      device=logp.device)
        loss, stats = decoupled_ppo_loss(logp, c, clip_low, clip_high, normaliser, is_cap=is_cap,
                                         prox_logprobs=prox, negative_scale=negative_scale)
    elif objective == "nll":
        loss, stats = nll_loss(logp, c, normaliser)
    else:
        raise ValueError(f"objective must be 'ppo', 'decoupled' or 'nll', got {objective!r}")
    if entropy_coef:
        loss = loss - entropy_coef * (c.weights * entropy.to(c.weights.dtype)).sum() / normaliser
    stats.update(loss=loss.item(), tokens=float(c.tgt.numel()), entropy=entropy.detach().sum().item(),
                 nll=-logp.detach().sum().item())
    return loss, stats


class Trainer:
    def __init__(self, model, *, lr: float, zero_stage: int = 1, grad_clip: float = 1.0,
                 weight_decay: float = 0.0, pad_id: int = 0, optimizer: str = "adamw",
                 gradient_checkpointing: bool = False):
        """`optimizer`: `adamw` (betas 0.9, 0.99) or `sgd` (plain: the step is −lr × the clipped gradient).
        `gradient_checkpointing`: recompute each layer's activations in the backward pass."""
        init_distributed()
        import deepspeed

        self.pad_id = pad_id
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        elif optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
        else:
            raise ValueError(f"optimizer {optimizer!r}: expected 'adamw' or 'sgd'")
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": optimizer != "adamw",   # plain SGD: ZeRO partitions it as any other
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        # Dropout off: the trainer's log-probs must be those of the policy the engine sampled from
        # (the PPO ratio and the behaviour/trainer mismatch metric assume it). Gradients flow as usual.
        self.engine.module.eval()
        if gradient_checkpointing:
            _checkpoint_without_dropout(self.engine.module)
        self._pending = False
        self._closed = False     # a micro-step ran at the accumulation boundary (gradients were reduced)

    @property
    def model(self):
        return self.engine.module

    def micro_step(self, seqs, normaliser: float, *, objective: str = "ppo", temperature: float = 1.0,
                   clip_low: float = 0.2, clip_high: float = 0.28, negative_scale: float = 1.0,
                   last: bool = False, is_cap: float = 2.0, prox_logprobs=None,
                   entropy_coef: float = 0.0) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients accumulate until `optimizer_step()`.

        `last` marks the final micro-step of the batch (DeepSpeed reduces gradients on it). Returns sums
        over the micro-batch's scored tokens (divide by `tokens` for means).

        `objective="decoupled"` is decoupled PPO (`losses.decoupled_ppo_loss`): clip against the proximal
        policy, weight by min(π_prox/μ, `is_cap`). `prox_logprobs` (aligned with the scored entries of
        `seqs`, e.g. from `logprobs(seqs)` before the step's first update) is needed only when a step runs
        more than one epoch; otherwise π_prox is this forward's own log-probs, detached.

        `entropy_coef` > 0 subtracts coef · Σ_t w_t H_t / normaliser (the policy's entropy at each scored
        token, weighted as the policy loss is): a bonus that keeps the sampling distribution from
        collapsing faster than the reward justifies.
        """
        with _reproducible(self.device):
            c = self._collate(seqs)
            self.engine.set_gradient_accumulation_boundary(last)
            loss, stats = policy_loss(self.engine, c, normaliser, objective=objective, temperature=temperature,
                                      clip_low=clip_low, clip_high=clip_high, negative_scale=negative_scale,
                                      is_cap=is_cap, prox_logprobs=prox_logprobs, entropy_coef=entropy_coef)
            self.engine.backward(loss)
            self._pending = True
            self._closed = self._closed or last
            return stats

    @torch.no_grad()
    def logprobs(self, seqs, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs of the scored entries of `seqs` under the current weights, in `collate` order: the
        proximal policy of decoupled PPO when a step runs several epochs (compute it before the first)."""
        c = self._collate(seqs)
        return token_logprobs(scored_logits(self.engine, c), c, temperature)[0].double()

    @torch.no_grad()
    def policy_shift(self, seqs, *, temperature: float = 1.0, clip_low: float = 0.2,
                     clip_high: float = 0.28, reference: torch.Tensor | None = None) -> dict[str, float]:
        """After an update: how far the policy moved from the behaviour policy on these sequences (or from
        `reference`, log-probs of the same entries from `logprobs()`, e.g. the weights before the update).

        Sums over scored tokens of the k3 estimate of KL(μ‖π) and of ratios outside the clip range.
        """
        c = self._collate(seqs)
        logp, _ = token_logprobs(scored_logits(self.engine, c), c, temperature)
        log_r = logp.double() - (c.old_logprobs if reference is None else reference.to(logp.device))
        r = log_r.exp()
        return {"kl": ((r - 1) - log_r).sum().item(), "tokens": float(c.tgt.numel()),
                "clipped": ((r < 1 - clip_low) | (r > 1 + clip_high)).double().sum().item()}

    def _collate(self, seqs):
        """Plain sequences, or packed trees (the model is switched to tree attention on first sight)."""
        c = collate(seqs, self.pad_id).to(self.device)
        if c.tree is not None:
            ensure_tree_attention(self.model)
        return c

    @property
    def device(self) -> torch.device:
        """Where the model lives (DeepSpeed moves it to this rank's GPU when there is one)."""
        return next(self.model.parameters()).device

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next optimizer steps (schedules are the caller's)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> float:
        """Apply the accumulated gradient (clipped); returns the gradient norm before clipping."""
        if not self._pending:
            return 0.0
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError("optimizer_step() before the micro-step marked last=True")
        self.engine.step()
        self._pending = self._closed = False
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    # -- streaming: an accumulation closed late, gradients moved between trainers ------------------
    def gradients(self) -> dict[str, torch.Tensor]:
        """Copies of the gradient accumulated so far, by parameter name (zeros where none arrived).

        Before the boundary, ZeRO 0/1 keep it in `param.grad`; after a `last=True` micro-step, ZeRO 1 has
        moved it into its flat partitions, which `safe_get_full_grad` reads. A satellite hands these to
        the core (`add_gradients`) and then calls `zero_gradients()`.
        """
        from deepspeed.utils import safe_get_full_grad

        self._check_grad_layout()
        out = {}
        for name, p in self.model.named_parameters():
            g = safe_get_full_grad(p) if self._closed and p.requires_grad else p.grad
            out[name] = torch.zeros_like(p) if g is None else g.detach().clone()
        return out

    def add_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        """Add another trainer's accumulated gradients (same parameter names) to this one's.

        Only while the accumulation is open (no `last=True` micro-step yet): the sum then goes through
        the boundary reduction, clipping and the optimizer exactly as if computed here.
        """
        self._require_open("add_gradients")
        self._check_grad_layout()
        params = dict(self.model.named_parameters())
        if set(grads) - set(params):
            raise KeyError(f"unknown parameters: {sorted(set(grads) - set(params))[:5]}")
        with torch.no_grad():
            for name, g in grads.items():
                p = params[name]
                g = g.to(device=p.device, dtype=p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
        self._pending = True

    def zero_gradients(self) -> None:
        """Drop the accumulated gradient (a satellite after handing it over; a burst being redone)."""
        self._require_open("zero_gradients")
        for p in self.model.parameters():
            p.grad = None
        self.engine.optimizer.zero_grad()
        self._pending = self._closed = False

    def finish_accumulation(self, scale: float = 1.0) -> float:
        """Close an accumulation whose micro-steps all ran with `last=False`: multiply the gradient by
        `scale` (streaming: 1 / executions trained, known only now), pass DeepSpeed's accumulation
        boundary, and apply the update. Returns the gradient norm before clipping, after scaling (as
        `optimizer_step`: 0.0 where DeepSpeed reports none, ZeRO 0).

        Scaling before the boundary means clipping and the optimizer see exactly the gradient a
        one-batch step with normaliser 1/scale would have produced.
        """
        if not self._pending:
            return 0.0
        self._require_open("finish_accumulation")
        self._check_grad_layout()
        if scale != 1.0:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self._close_boundary()
        return self.optimizer_step()

    def _close_boundary(self) -> None:
        """A micro-step that adds nothing: a one-token forward whose loss is 0 · Σ logits, back-propagated
        at the boundary so DeepSpeed runs its own reduction path (ZeRO 1: into its partitions; several
        ranks: the all-reduce) without a real micro-step to attach it to."""
        self.engine.set_gradient_accumulation_boundary(True)
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        out = self.engine(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        self.engine.backward(out.logits.sum() * 0.0)
        self._closed = True

    def _check_grad_layout(self) -> None:
        """The streaming methods read and write `param.grad`. ZeRO 2/3 do not keep the sum there, nor does
        ZeRO 1 with an accumulation dtype other than the parameters' (bf16 weights, fp32 accumulation: it
        uses `param.grad_accum`); refuse those rather than silently miss the gradient."""
        if self.engine.zero_optimization_partition_gradients():
            raise NotImplementedError("streamed gradients need ZeRO stage 0 or 1: stage 2/3 partition the "
                                      "gradient at every backward, so param.grad does not hold the sum")
        if getattr(self.engine.optimizer, "use_grad_accum_attribute", False):
            raise NotImplementedError("streamed gradients need the accumulation dtype to equal the parameters' "
                                      "(ZeRO 1 with a separate grad_accum dtype is not supported)")

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}() after a micro-step marked last=True: the gradients are already "
                               "reduced; stream with last=False and close with finish_accumulation()")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)

    def load(self, ckpt_dir: str, tag: str) -> dict:
        path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{tag}' under {ckpt_dir}")
        return client_state or {}
