"""One trainer's gradients computed over several devices of one host: data parallel inside a cell.

    replicas = DeviceReplicas(trainer, ["cuda:1", "cuda:2", "cuda:3"])
    replicas.follow(version)       # whenever the trainer's weights may have changed: a number per weights
    stats = replicas.micro_step(chunks, objective="decoupled", ...)    # the sum lands on `trainer`

The trainer (its model, optimizer and DeepSpeed engine) stays on its own device. Each other device holds a
plain copy of the model that only computes gradients. A micro-step's chunks are shared out by their padded
tokens (longest first, each to the least loaded device); each device runs its share, in a thread of its
own when they are GPUs (CUDA kernels run outside the interpreter lock; a packed chunk whose compiled
attention kernel is new on its GPU runs alone, as torch.compile is not thread-safe), and the copies'
gradients are added to the trainer's before `micro_step` returns. Everything after it — a satellite's
hand-over, the reduce between cells, the KL guard, the update — sees one trainer's gradient: the same sum
up to the order of the additions. The copies take the trainer's weights whenever `version` moves on.

What it does not do: partition the weights or the optimizer state over the devices (ZeRO 2/3 inside a
cell). The model and its optimizer must fit on the trainer's device; the other devices hold a copy of the
weights and their gradient.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from .losses import collate
from .packing import PackedTree
from .trainer import _reproducible, ensure_tree_attention, policy_loss
from .tree_attention import flex_length


def padded_tokens(chunk) -> int:
    """What a chunk costs to train: rows × the longest row (a packed tree is one row)."""
    return len(chunk) * max((len(x.input_ids) for x in chunk), default=0)


def share_out(costs: list[int], n: int) -> list[list[int]]:
    """Indices of `costs` for each of `n` devices: longest first, each to the device with the least so far
    (ties to the lower device, so device 0 — the trainer's own — takes the first and largest)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        d = min(range(n), key=lambda d: (load[d], d))
        shares[d].append(i)
        load[d] += costs[i]
    return [sorted(s) for s in shares]


_FIRST_USE = threading.Lock()      # a packed chunk's first flex kernel per (length, device) compiles alone
_COMPILED: set[tuple[int, str]] = set()   # (length, device), as tree_attention's kernel cache


def _copy_to(model, device: torch.device):
    """A copy of `model` built directly on `device` (no second copy on the model's own device first): its
    parameters and buffers are cloned there and put in deepcopy's memo, so the structure is copied around
    them and tied weights stay tied. Module hooks (DeepSpeed's, which close over its engine) are dropped."""
    memo: dict = {}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = b.detach().to(device, copy=True)
    m = copy.deepcopy(model, memo)
    for mod in m.modules():
        for hooks in (mod._forward_pre_hooks, mod._forward_pre_hooks_with_kwargs, mod._forward_hooks,
                      mod._forward_hooks_with_kwargs, mod._forward_hooks_always_called, mod._backward_hooks):
            hooks.clear()
    return m


class DeviceReplicas:
    def __init__(self, trainer, devices: list[str], *, parallel: bool | None = None) -> None:
        """`devices`: the other devices of the trainer's cell (e.g. ``["cuda:1", "cuda:2"]``; ``"cpu"``
        works for tests). `parallel`: run the devices' shares in threads at once (default: when every
        device is a GPU; on CPU the shares would compete for the same cores)."""
        if not devices:
            raise ValueError("DeviceReplicas needs at least one other device")
        self.trainer = trainer
        self.devices = [torch.device(d) for d in devices]
        self.parallel = all(d.type == "cuda" for d in self.devices) if parallel is None else parallel
        # the trainer's mode: training where it checkpoints activations (HF recomputes only then; dropout
        # is off either way), eval otherwise
        self.copies = [_copy_to(trainer.model, d).train(trainer.model.training) for d in self.devices]
        self.version: int | None = None       # the trainer's weights the copies hold (None: not known)
        self.chunks_by_device: list[int] = [0] * (1 + len(self.devices))   # chunks trained (0: the trainer)
        self._pool = ThreadPoolExecutor(len(self.devices) + 1, thread_name_prefix="gyre-replica") \
            if self.parallel else None

    @property
    def n_devices(self) -> int:
        return 1 + len(self.devices)

    def follow(self, version: int | None) -> None:
        """Copy the trainer's weights to every device unless they already hold `version` (None: copy, and
        copy again before the next micro-step unless a version is given). Parameters only: the buffers
        (rotary frequencies) do not change in training."""
        if version is not None and version == self.version:
            return
        src = dict(self.trainer.model.named_parameters())
        with torch.no_grad():
            for m in self.copies:
                for name, p in m.named_parameters():
                    p.copy_(src[name], non_blocking=True)
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        self.version = version

    def micro_step(self, chunks, **loss_kw) -> dict[str, float]:
        """Forward + backward of one micro-step's `chunks` (each a list of `TrainSequence`s or one
        `PackedTree`) with normaliser 1 and no accumulation boundary, as `Trainer.micro_step(chunk, 1.0,
        last=False, ...)` on each; the gradient accumulates on the trainer. Returns the chunks' summed
        stats. The copies compute with the weights of the last `follow`."""
        if self.version is None:
            self.follow(None)
        shares = share_out([padded_tokens(c) for c in chunks], self.n_devices)
        jobs = [(d, [chunks[i] for i in share]) for d, share in enumerate(shares) if share]
        try:
            if self._pool is not None and len(jobs) > 1:
                futures = [self._pool.submit(self._run, d, share, loss_kw) for d, share in jobs]
                wait(futures)                 # every job ends before anything is read or cleared
                results = [f.result() for f in futures]
            else:
                results = [self._run(d, share, loss_kw) for d, share in jobs]
            for d, share in jobs:
                self.chunks_by_device[d] += len(share)
            self._gather()
        finally:
            self._clear()                     # a failed job leaves no gradient behind on the copies
        totals: dict[str, float] = {}
        for stats in results:
            for key, v in stats.items():
                totals[key] = totals.get(key, 0.0) + v
        return totals

    def _run(self, d: int, chunks, loss_kw: dict) -> dict[str, float]:
        device = self.trainer.device if d == 0 else self.devices[d - 1]
        scope = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        totals: dict[str, float] = {}
        with scope:                           # the thread's current GPU is the one it computes on
            for chunk in chunks:
                first = self._first_flex(device, chunk)
                with _FIRST_USE if first else contextlib.nullcontext():
                    if d == 0:
                        stats = self.trainer.micro_step(chunk, 1.0, last=False, **loss_kw)
                    else:
                        stats = self._replica_step(self.copies[d - 1], device, chunk, loss_kw)
                    if first:
                        _COMPILED.add(first)
                for key, v in stats.items():
                    totals[key] = totals.get(key, 0.0) + v
        return totals

    def _first_flex(self, device: torch.device, chunk) -> tuple[int, str] | None:
        """(length, device) when `chunk` is a packed tree whose compiled flex kernel has not run on
        `device` yet: torch.compile is not thread-safe, so that forward and backward run alone."""
        if not self.parallel or device.type != "cuda" or not isinstance(chunk[0], PackedTree):
            return None
        key = (flex_length(chunk[0].n_tokens), str(device))
        return None if key in _COMPILED else key

    def _replica_step(self, model, device: torch.device, chunk, loss_kw: dict) -> dict[str, float]:
        with _reproducible(device):
            c = collate(chunk, self.trainer.pad_id).to(device)
            if c.tree is not None:
                ensure_tree_attention(model)
            loss, stats = policy_loss(model, c, 1.0, **loss_kw)
            loss.backward()
        return stats

    def _gather(self) -> None:
        """The copies' gradients into the trainer's accumulation."""
        for m in self.copies:
            grads = {name: p.grad for name, p in m.named_parameters() if p.grad is not None}
            if grads:
                self.trainer.add_gradients(grads)

    def _clear(self) -> None:
        for m in self.copies:
            for p in m.parameters():
                p.grad = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
