"""What a cell agent computes with: a backend per kind of cell, behind one small interface the agent's loop
drives (`start`/`due`/`advance` for rollout calls, `switch`, `micro`/`optim`/`reduce` for training).

- `EmulatedDevice`: device work replaced by calibrated waits (a K = 8 fleet on a 2-core machine, clearly
  labelled as emulated);
- `RealDevice`: the cell's model, shared by its local engine (rollout) and its trainer (training);
- `vllm_cell.VLLMCellDevice`: a `RealDevice` whose rollout runs on the cell's own vLLM server.
"""
from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field

from .messages import CallRequest


@dataclass(slots=True)
class LiveCall:
    call_id: int
    req: CallRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    next_t: float = 0.0          # emulated: when its next token is due
    paused: int = 0              # emulated: the cell's weight loads this call has already waited through


def emulated_token(position: int) -> int:
    """The token an emulated cell emits at absolute position `position` of a context: a fixed function,
    so a rerouted call's tokens can be checked for gaps or repeats."""
    return (position * 7 + 3) % 101


class EmulatedDevice:
    """Device work replaced by waits: the live calls decode as one batch, a token every
    `token_s`·(1 + β·(other live calls)) for each (β = `decode_slowdown`: a fuller batch is slower per token,
    as measured on real cells); a micro-step or an optimizer step for the seconds the coordinator computed
    from the calibrated workload. A version published while the cell rolls out pauses its calls for
    `weight_sync_s` (loading the weights)."""

    label = "emulated"

    def __init__(self, decode_slowdown: float = 0.0, weight_sync_s: float = 0.0) -> None:
        self.version = 0
        self.beta, self.sync_s = decode_slowdown, weight_sync_s
        self.role = "rollout"
        self.live = 0                        # calls decoding here at the last advance
        self.loads = 0                       # weight loads so far
        self.pause = (0.0, 0.0)              # the newest load's [start, end)
        self.version_before = 0              # the version before it

    def _token_s(self, g: LiveCall, live: int) -> float:
        return g.req.token_s * (1.0 + self.beta * max(live - 1, 0))

    def start(self, g: LiveCall, now: float) -> None:
        g.paused = self.loads
        g.next_t = max(now, self.pause[1]) + self._token_s(g, self.live + 1)

    def due(self, gens: list[LiveCall]) -> float | None:
        return min((g.next_t for g in gens), default=None)

    def advance(self, gens: list[LiveCall], now: float) -> list[LiveCall]:
        """Emit every token that is due; return the calls that are complete."""
        self.live = len(gens)
        t0, t1 = self.pause
        finished = []
        for g in gens:
            if g.paused < self.loads:        # a load began since this call was last advanced:
                self._emit(g, min(now, t0), self.version_before)   # what was due before it, on the old weights,
                g.paused = self.loads
                g.next_t += t1 - t0          # then the token in progress waits the load out
            self._emit(g, now, self.version)
            if len(g.ids) >= g.req.max_new_tokens:
                finished.append(g)
        return finished

    def _emit(self, g: LiveCall, until: float, version: int) -> None:
        while g.next_t <= until and len(g.ids) < g.req.max_new_tokens:
            g.ids.append(emulated_token(len(g.req.prompt_ids) + len(g.ids)))
            g.logprobs.append(0.0)
            g.versions.append(version)
            g.next_t += self._token_s(g, self.live)

    def finish_reason(self, g: LiveCall) -> str:
        return "length"

    def release(self, key: str) -> None:
        pass

    def switch(self, role: str, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))
        self.role, self.live = role, 0       # (the agent hands back every call before a switch)
        self.pause = (0.0, 0.0)              # a switch to rollout loads the newest weights itself

    def micro(self, seconds: float):
        time.sleep(max(seconds, 0.0))
        return None, {}                  # no gradient to hand over, no training statistics

    def optim(self, version: int, seconds: float, t: int = 1) -> tuple[float | None, dict | None]:
        time.sleep(max(seconds, 0.0))
        self.version = version + 1
        return None, None

    def reduce(self, t: int) -> float:
        return 0.0

    def use_arrays(self) -> None:
        pass

    def add_grads(self, grads) -> None:
        pass

    def become_core(self) -> None:
        pass

    def set_version(self, version: int) -> None:
        if version > self.version and self.role == "rollout" and self.sync_s > 0:
            now = time.monotonic()
            t0, t1 = self.pause
            if now < t1:                     # a load still running: the next one follows it
                self.pause = (t0, t1 + self.sync_s)
            else:
                self.loads += 1
                self.pause, self.version_before = (now, now + self.sync_s), self.version
        self.version = version


def other_devices(device) -> list[str]:
    """The GPUs a cell trains on besides `device` (its model's): every other GPU it sees — a cell process
    sees its own slice (CUDA_VISIBLE_DEVICES). None on CPU: a CPU cell trains on one device with its
    `devices_per_cell` threads."""
    import torch

    if device.type != "cuda":
        return []
    return [f"cuda:{i}" for i in range(torch.cuda.device_count()) if i != (device.index or 0)]


class RealDevice:
    """The cell's model, shared by its engine (rollout) and its trainer (train) — one copy per device,
    as on a GPU. Rollout decodes one token for every live call per forward (with the engine's per-context
    KV cache); training runs streamed micro-steps with decoupled PPO. A satellite hands each micro-step's
    gradient to the coordinator, which forwards it to the core; the core applies the update and
    publishes the next version, which the others load at their next token or micro-step boundary."""

    label = "real"

    def __init__(self, cell: int, policy_dir: str, weights_root: str, train: dict, seed: int,
                 start_version: int = 0, groups=None) -> None:
        """`start_version` > 0: a resumed run; the cell starts from that published version's weights.
        `groups`: this cell's `collective.PrefixGroups` (None: gradients go as arrays)."""
        import torch

        from ..engine import LocalEngine
        from ..model import load_policy, stop_token_ids
        from ..seeds import cell_stream

        self.cell, self.weights_root, self.train_kw = cell, weights_root.rstrip("/"), dict(train)
        self.groups = groups
        model, tok = load_policy(policy_dir, dtype=getattr(torch, self.train_kw.get("dtype", "float32")),
                                 device=self.train_kw.get("device", "cpu"))
        # sent in the hello (result.cell_devices): where the cell computes, and on how many devices it trains
        device = next(model.parameters()).device
        self.replica_devices = other_devices(device)
        self.label = f"real/{device}"
        if self.replica_devices:
            self.label += f" (trains data-parallel on {1 + len(self.replica_devices)} GPUs)"
        elif device.type == "cpu" and torch.get_num_threads() > 1:   # devices_per_cell > 1 on a CPU host
            self.label += f" (one device, {torch.get_num_threads()} threads)"
        self.replicas = None
        self.pad_id = tok.pad_token_id or 0
        self.vocab_size = len(tok)
        self.engine = LocalEngine(model, stop_token_ids(model, tok), version=0, seed=cell_stream(seed, cell))
        self.stops = set(self.engine.stop_ids)
        self.version = 0          # the weights this cell computes with
        self.published = start_version   # the newest version the core has published
        self._sync()              # before the trainer: its optimizer copies the weights it starts from
        self.trainer = None
        self._trainer()           # both roles stay resident (as on a GPU): a switch moves no weights

    # -- weights ---------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        self.published = max(self.published, version)

    def _sync(self) -> None:
        """At a boundary: take the newest published weights (a consistent snapshot, read whole)."""
        if self.published <= self.version:
            return
        from ..trainer.publish import load_weights, version_uri

        state = load_weights(version_uri(self.weights_root, self.published))
        self.engine.set_weights(state, self.published)   # copies into the shared model; drops stale K/V
        self.version = self.published

    def _trainer(self):
        if self.trainer is None:
            from ..trainer.trainer import Trainer

            kw = self.train_kw
            self.trainer = Trainer(self.engine.model, lr=kw["lr"], zero_stage=kw["zero_stage"],
                                   optimizer=kw.get("optimizer", "adamw"), grad_clip=kw["grad_clip"],
                                   pad_id=self.pad_id,
                                   gradient_checkpointing=kw.get("gradient_checkpointing", False))
            if self.replica_devices:      # the cell's other GPUs compute gradients for this trainer
                from ..trainer.replicas import DeviceReplicas

                self._close_replicas()    # (a new core's trainer) the old copies go before the new ones
                self.replicas = DeviceReplicas(self.trainer, self.replica_devices)
        return self.trainer

    def _close_replicas(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None

    def close(self) -> None:
        self._close_replicas()

    # -- rollout ---------------------------------------------------------------------------------
    def start(self, g: "LiveCall", now: float) -> None:
        pass

    def due(self, gens: list["LiveCall"]) -> float | None:
        return 0.0 if gens else None     # always ready for the next token

    def advance(self, gens: list["LiveCall"], now: float) -> list["LiveCall"]:
        """One token for every live call (one batched forward)."""
        if not gens:
            return []
        from ..engine import GenRequest as EngineRequest

        self._sync()
        outs = self.engine.generate([EngineRequest(g.req.key, g.req.prompt_ids + g.ids, 1, g.req.temperature)
                                     for g in gens])
        finished = []
        for g, o in zip(gens, outs):
            g.ids += o.completion_ids
            g.logprobs += o.logprobs
            g.versions += [self.version] * len(o.completion_ids)
            if (g.ids and g.ids[-1] in self.stops) or len(g.ids) >= g.req.max_new_tokens:
                finished.append(g)
        return finished

    def finish_reason(self, g: "LiveCall") -> str:
        return "stop" if g.ids and g.ids[-1] in self.stops else "length"

    def release(self, key: str) -> None:
        self.engine.release(key)

    # -- roles and training -----------------------------------------------------------------------
    def switch(self, role: str, seconds: float) -> None:
        """Real work of a switch: to train, drop the KV caches and have the trainer ready; to rollout,
        take the newest weights (the caches are rebuilt on demand)."""
        if role == "train":
            self.engine._contexts.clear()
            self._trainer()
        self._sync()

    def micro(self, ms):
        from .stream import train_micro_step

        self._sync()
        tr, kw = self._trainer(), self.train_kw
        if self.replicas is not None:
            self.replicas.follow(self.version)
        stats = train_micro_step(tr, ms, max_tokens=kw["micro_batch_tokens"], packed=kw.get("packed", False),
                                 replicas=self.replicas, objective="decoupled",
                                 temperature=kw["temperature"], clip_low=kw["clip_low"], clip_high=kw["clip_high"],
                                 is_cap=kw["is_cap"], negative_scale=kw["negative_scale"],
                                 entropy_coef=kw.get("entropy_coef", 0.0))
        if self.cell_is_core or self.groups is not None:
            return None, stats          # kept here: the core's own, or a satellite's until the reduce
        grads = tr.gradients()          # a satellite without groups: hand the gradient over, start clean
        tr.zero_gradients()
        # plain arrays: torch's own pickling shares storage by file descriptor, which only works between
        # a process and its children, not between cells and a coordinator (or across hosts)
        return {k: g.float().cpu().numpy() for k, g in grads.items()}, stats

    cell_is_core = False

    def become_core(self) -> None:
        """The old core was lost: take the newest published weights and a fresh trainer over them (the
        optimizer keeps its own copy of the weights, which must not be the warm start's; Adam's moments
        restart — the coordinator says so in the run's notes)."""
        self._sync()
        self.trainer = None
        self._trainer()
        self.cell_is_core = True

    def add_grads(self, grads) -> None:
        import torch

        params = dict(self.engine.model.named_parameters())
        self._trainer().add_gradients({k: torch.from_numpy(g).to(params[k].device, params[k].dtype)
                                       for k, g in grads.items()})

    def reduce(self, t: int) -> float:
        """A satellite's part of the update's reduce over [0, t); returns its seconds. A failed reduce
        drops the gradient (the coordinator has the step's micro-steps trained again)."""
        from .collective import ReduceFailed

        t0 = time.monotonic()
        if self.groups is None:     # already on arrays: nothing is held here
            return 0.0
        try:
            self.groups.reduce_to_core(self._trainer(), t)
        except ReduceFailed as e:
            print(f"gyre cell {self.cell}: {e}", file=sys.stderr, flush=True)
        return time.monotonic() - t0

    def use_arrays(self) -> None:
        """A cell was lost: the groups are unusable. Drop the gradient held here (the coordinator has the
        burst trained again) and hand gradients over as arrays from now on."""
        self.groups = None
        self._trainer().zero_gradients()

    def optim(self, version: int, work, t: int = 1) -> tuple[float | None, dict | None]:
        """Reduce the satellites' gradients over [0, t) onto this core (t > 1), apply the update and
        publish version+1; returns the reduce's seconds (None: no reduce) and the KL guard's figures (None:
        no guard). `work`: the executions trained, or with `rl.max_kl` {"n", "probe", "max_kl",
        "backtracks"} (`HarnessWork.optim_work`). Raises `collective.ReduceFailed`."""
        from ..trainer.publish import publish_weights, version_uri
        from .stream import finish_step

        tr = self._trainer()
        t0 = time.monotonic()
        if t > 1:
            self.groups.reduce_to_core(tr, t)
        reduce_s = time.monotonic() - t0 if t > 1 else None
        stats = None
        if isinstance(work, dict):
            stats = self._update_within_kl(tr, version, work)
        else:
            finish_step(tr, work)
        publish_weights(tr.state_dict(), version_uri(self.weights_root, version + 1))
        self.engine._contexts.clear()
        self.engine.version = self.version = self.published = version + 1
        return reduce_s, stats

    def _update_within_kl(self, tr, version: int, work: dict) -> dict:
        """The update under the KL guard: the step's checkpoint (weights and optimizer state) saved first,
        and loaded back into the same trainer for a redo at a lower rate (`stream.finish_step_within_kl`)."""
        import tempfile

        from .stream import finish_step_within_kl

        kw = self.train_kw
        ckpt, tag = tempfile.mkdtemp(prefix=f"gyre-cell{self.cell}-kl-"), f"v{version}"
        try:
            tr.save(ckpt, tag, {"version": version})
            stats = finish_step_within_kl(
                tr, work["n"], work["probe"], max_kl=work["max_kl"], backtracks=work["backtracks"], lr=kw["lr"],
                restore=lambda: tr.load(ckpt, tag), max_tokens=kw["micro_batch_tokens"],
                temperature=kw["temperature"], clip_low=kw["clip_low"], clip_high=kw["clip_high"])
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        return stats
