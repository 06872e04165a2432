"""The gradient channel between training cells: process groups over prefixes of the cells' fixed order.

    store = host_store("127.0.0.1", timeout_s=300)        # the coordinator, before it starts the cells
    groups = PrefixGroups(store.address, rank=cell, world=K, timeout_s=300)   # each cell, once
    store.close()                                         # the coordinator, when the run ends
    groups.reduce_to_core(trainer, t)                     # every cell at positions [0, t), at the update

Cells join training in a fixed order (core first), so the cells that trained in a step are always a
prefix [0, t) of that order. Every prefix's group is built once, when the agents start: cell r takes part
in the groups of sizes max(r + 1, 2) .. K, built in increasing size so the rendezvous cannot deadlock.
Satellites keep accumulating their micro-steps' gradients on their own device; at the update the
coordinator names t and every cell of the prefix sums its gradient onto the core with one reduce, after
which the satellites start clean. Nothing passes through the coordinator.

The groups are gloo groups of their own over a rendezvous store the coordinator provides (a `PrefixStore`
per prefix). On one host (a loopback `elastic.coordinator_host`) that store is a file in a directory only
this user can open, and each group's gloo device binds to 127.0.0.1: nothing listens beyond loopback and no
other user's process can join. Across hosts it is torch's TCPStore, which listens on every interface and
checks nobody: such a fleet belongs on a private network (docs/operations.md, "Sockets"). The groups are
independent of the one-rank group each cell's DeepSpeed engine initialises, so a cell's trainer
is unchanged. Gradients travel as one flat float32 CPU tensor (on a GPU cell: copied to host and back).
A group with a dead member cannot reduce: the coordinator then falls back to shipping arrays through
itself for the rest of the run (`runtime.Coordinator._fall_back`).
"""
from __future__ import annotations

import datetime
import os
import shutil
import tempfile


class ReduceFailed(RuntimeError):
    """The reduce over a prefix did not complete (a member died or timed out); gradients were dropped."""


class GradStore:
    """The coordinator's side of the rendezvous: `address` is what cells pass to `PrefixGroups`
    ("file:PATH" on one host, "tcp:HOST:PORT" across hosts); `close()` when the run ends."""

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        from ..config import is_loopback

        self._dir = None
        if is_loopback(host):
            self._dir = tempfile.mkdtemp(prefix="gyre-grad-store-")      # mode 0700
            self.store = dist.FileStore(os.path.join(self._dir, "store"), -1)
            self.address = "file:" + os.path.join(self._dir, "store")
        else:
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
            self.address = f"tcp:{host}:{self.store.port}"

    def close(self) -> None:
        self.store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def host_store(host: str, timeout_s: float) -> GradStore:
    """The rendezvous store the cells' groups are built on (see the module's text for where it lives)."""
    return GradStore(host, timeout_s)


class PrefixGroups:
    def __init__(self, address: str, rank: int, world: int, timeout_s: float) -> None:
        """Join the store at `address` (`GradStore.address`) and build this rank's prefix groups; blocks
        until every member of each group has arrived (at most `timeout_s` per group)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        kind, _, where = address.partition(":")
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        if kind == "file":
            self._store = dist.FileStore(where, -1)
            self._store.set_timeout(timeout)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        elif kind == "tcp":
            host, port = where.rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        else:
            raise ValueError(f"not a gradient store address: {address!r} (file:PATH or tcp:HOST:PORT)")
        self.groups = {t: dist.ProcessGroupGloo(dist.PrefixStore(f"gyre/prefix{t}", self._store), rank, t, opts)
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
