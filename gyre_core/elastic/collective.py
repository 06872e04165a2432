"""The gradient channel between training cells: process groups over prefixes of the cells' fixed order.

    store = host_store("127.0.0.1", timeout_s=300)        # the coordinator, before it starts the cells
    groups = PrefixGroups(f"{host}:{store.port}", rank=cell, world=K, timeout_s=300)   # each cell, once
    groups.reduce_to_core(trainer, t)                     # every cell at positions [0, t), at the update

Cells join training in a fixed order (core first), so the cells that trained in a step are always a
prefix [0, t) of that order. Every prefix's group is built once, when the agents start: cell r takes part
in the groups of sizes max(r + 1, 2) .. K, built in increasing size so the rendezvous cannot deadlock.
Satellites keep accumulating their micro-steps' gradients on their own device; at the update the
coordinator names t and every cell of the prefix sums its gradient onto the core with one reduce, after
which the satellites start clean. Nothing passes through the coordinator.

The groups are gloo groups of their own over a TCPStore the coordinator hosts (a `PrefixStore` per
prefix), independent of the one-rank group each cell's DeepSpeed engine initialises, so a cell's trainer
is unchanged. Gradients travel as one flat float32 CPU tensor (on a GPU cell: copied to host and back).
A group with a dead member cannot reduce: the coordinator then falls back to shipping arrays through
itself for the rest of the run (`runtime.Coordinator._fall_back`).
"""
from __future__ import annotations

import datetime


class ReduceFailed(RuntimeError):
    """The reduce over a prefix did not complete (a member died or timed out); gradients were dropped."""


def host_store(host: str, timeout_s: float):
    """The rendezvous store the cells' groups are built on, listening on a free port of `host`."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class PrefixGroups:
    def __init__(self, address: str, rank: int, world: int, timeout_s: float) -> None:
        """Join the store at `address` (HOST:PORT) and build this rank's prefix groups; blocks until
        every member of each group has arrived (at most `timeout_s` per group)."""
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.groups = {t: dist.ProcessGroupGloo(dist.PrefixStore(f"gyre/prefix{t}", self._store), rank, t, timeout)
                       for t in range(max(rank + 1, 2), world + 1)}

    def close(self) -> None:
        """Release the groups and the store connection while the interpreter still runs, not in exit-time
        teardown (where cell agents were seen, now and then, to print "terminate called without an active
        exception" after their work was done)."""
        self.groups.clear()
        self._store = None

    def reduce_to_core(self, trainer, t: int) -> None:
        """Sum the gradients of ranks [0, t) into rank 0's trainer; every rank of the prefix calls it.

        A satellite's gradient is zeroed once sent. On rank 0 the trainer's gradient is replaced by the
        sum, ready for `finish_accumulation`. Raises `ReduceFailed` (the gradient dropped on every rank
        that saw the failure) when the group cannot complete."""
        import torch
        import torch.distributed as dist

        if not (self.rank < t <= self.world) or t < 2:
            raise ValueError(f"rank {self.rank} is not in the prefix group of size {t} (world {self.world})")
        grads = trainer.gradients()
        names = list(grads)
        flat = torch.cat([grads[n].detach().reshape(-1).to("cpu", torch.float32) for n in names])
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
        try:
            self.groups[t].reduce([flat], opts).wait()
        except Exception as e:   # noqa: BLE001 — gloo raises RuntimeError subclasses of its own
            trainer.zero_gradients()
            raise ReduceFailed(f"the gradient reduce over cells [0, {t}) failed: {type(e).__name__}: {e}") from e
        trainer.zero_gradients()
        if self.rank != 0:
            return
        out, at = {}, 0
        for n in names:
            g = grads[n]
            out[n] = flat[at:at + g.numel()].view(g.shape)
            at += g.numel()
        trainer.add_gradients(out)
