"""A cell agent: one long-lived process per cell that switches role without restarting.

    python -m gyre_core.elastic.agent --cell 3 --coordinator 127.0.0.1:PORT --authkey-env GYRE_CELL_KEY

(a fleet's process manager can wrap it, and with `elastic.launch=prefect` the `cell-agent` flow run,
`flows/cell_agent.py`, runs it on a cell worker.) The agent connects to the coordinator, says `Hello`,
and then serves the coordinator's messages (`messages`: a call to start or cancel, a role to take, a
micro-step to train, an update to apply, ...) until told to `Stop`; it answers each call with `Done`
and beats (`Beat`) from its own thread.
Gradients between training cells: real cells started with `--grad-store` build the prefix process groups
of `collective` before they say hello, keep their micro-steps' gradients, and sum them onto the core at
the update; without it (or after a cell loss) a satellite returns each micro-step's gradient as arrays,
which the coordinator forwards to the core (`Grads`).
Device work is done by a backend: `EmulatedDevice` replaces it by calibrated waits (to show a K = 8
fleet on a 2-core machine, clearly labelled as emulated); the real backend runs the engine and trainer.
A rollout cell serves many calls at once, one token at a time across all of them (batched decoding),
and reads its connection between tokens, so a cancel or a role change takes effect within one token.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection

from .messages import (BecomeCore, Beat, CallRequest, Cancel, Done, FromCell, Gen, Grads, Hello, Micro, MicroDone,
                       Optim, OptimDone, OptimFailed, Reduce, Release, Role, RoleDone, Stop, ToCell, UseArrays,
                       Weights)

HEARTBEAT_S = 1.0


@dataclass(slots=True)
class _LiveCall:
    call_id: int
    req: CallRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    next_t: float = 0.0          # emulated: when its next token is due


def emulated_token(position: int) -> int:
    """The token an emulated cell emits at absolute position `position` of a context: a fixed function,
    so a rerouted call's tokens can be checked for gaps or repeats."""
    return (position * 7 + 3) % 101


class EmulatedDevice:
    """Device work replaced by waits: a token every `token_s` for each live call, concurrently
    (batched decoding does not slow one call down for another), a micro-step or an optimizer step
    for the seconds the coordinator computed from the calibrated workload."""

    label = "emulated"

    def __init__(self) -> None:
        self.version = 0

    def start(self, g: _LiveCall, now: float) -> None:
        g.next_t = now + g.req.token_s

    def due(self, gens: list[_LiveCall]) -> float | None:
        return min((g.next_t for g in gens), default=None)

    def advance(self, gens: list[_LiveCall], now: float) -> list[_LiveCall]:
        """Emit every token that is due; return the calls that are complete."""
        finished = []
        for g in gens:
            while g.next_t <= now and len(g.ids) < g.req.max_new_tokens:
                g.ids.append(emulated_token(len(g.req.prompt_ids) + len(g.ids)))
                g.logprobs.append(0.0)
                g.versions.append(self.version)
                g.next_t += g.req.token_s
            if len(g.ids) >= g.req.max_new_tokens:
                finished.append(g)
        return finished

    def finish_reason(self, g: _LiveCall) -> str:
        return "length"

    def release(self, key: str) -> None:
        pass

    def switch(self, role: str, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    def micro(self, seconds: float):
        time.sleep(max(seconds, 0.0))
        return None, {}                  # no gradient to hand over, no training statistics

    def optim(self, version: int, seconds: float, t: int = 1) -> float | None:
        time.sleep(max(seconds, 0.0))
        self.version = version + 1
        return None

    def reduce(self, t: int) -> float:
        return 0.0

    def use_arrays(self) -> None:
        pass

    def add_grads(self, grads) -> None:
        pass

    def become_core(self) -> None:
        pass

    def set_version(self, version: int) -> None:
        self.version = version


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
        from ..engine import LocalEngine
        from ..model import load_policy, stop_token_ids
        from ..seeds import cell_stream

        self.cell, self.weights_root, self.train_kw = cell, weights_root.rstrip("/"), dict(train)
        self.groups = groups
        model, tok = load_policy(policy_dir, device=self.train_kw.get("device", "cpu"))
        self.label = f"real/{next(model.parameters()).device}"    # sent in the hello (result.cell_devices)
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
                                   optimizer=kw.get("optimizer", "adamw"),
                                   grad_clip=kw["grad_clip"], pad_id=self.pad_id)
        return self.trainer

    # -- rollout ---------------------------------------------------------------------------------
    def start(self, g: "_LiveCall", now: float) -> None:
        pass

    def due(self, gens: list["_LiveCall"]) -> float | None:
        return 0.0 if gens else None     # always ready for the next token

    def advance(self, gens: list["_LiveCall"], now: float) -> list["_LiveCall"]:
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

    def finish_reason(self, g: "_LiveCall") -> str:
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
        stats = train_micro_step(tr, ms, max_tokens=kw["micro_batch_tokens"], objective="decoupled",
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

    def optim(self, version: int, n_executions: int, t: int = 1) -> float | None:
        """Reduce the satellites' gradients over [0, t) onto this core (t > 1), apply the update and
        publish version+1; returns the reduce's seconds (None: no reduce). Raises `collective.ReduceFailed`."""
        from ..trainer.publish import publish_weights, version_uri
        from .stream import finish_step

        tr = self._trainer()
        t0 = time.monotonic()
        if t > 1:
            self.groups.reduce_to_core(tr, t)
        reduce_s = time.monotonic() - t0 if t > 1 else None
        finish_step(tr, n_executions)
        publish_weights(tr.state_dict(), version_uri(self.weights_root, version + 1))
        self.engine._contexts.clear()
        self.engine.version = self.version = self.published = version + 1
        return reduce_s


class Agent:
    def __init__(self, cell: int, conn: Connection, device) -> None:
        self.cell, self.conn, self.device = cell, conn, device
        self.role = "rollout"
        self.gens: dict[int, _LiveCall] = {}
        self._send_lock = threading.Lock()
        self._stopped = threading.Event()
        self.busy_since: float | None = None    # when the main loop started its current piece of work

    def send(self, msg: FromCell) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _heartbeat(self) -> None:
        """Beats from their own thread, so a long micro-step or update does not look like a dead cell;
        each beat says how long the main loop has been inside its current piece of work (0 when idle),
        so a loop that hangs there does not hide behind the beats (`elastic.stuck_timeout_s`)."""
        while not self._stopped.wait(HEARTBEAT_S):
            t0 = self.busy_since
            try:
                self.send(Beat(time.time(), 0.0 if t0 is None else time.monotonic() - t0))
            except (OSError, EOFError):
                return

    def _finish(self, g: _LiveCall, reason: str) -> None:
        self.gens.pop(g.call_id, None)
        if reason == "cancelled":        # the context moves to another cell: its K/V here are dead weight
            self.device.release(g.req.key)
        self.send(Done(g.call_id, g.ids, g.logprobs, g.versions, reason))

    def serve(self) -> None:
        self.send(Hello(self.cell, os.getpid(), self.device.label))
        threading.Thread(target=self._heartbeat, daemon=True).start()
        try:
            self._loop()
        finally:
            self._stopped.set()

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            due = self.device.due(list(self.gens.values()))
            timeout = HEARTBEAT_S if due is None else max(0.0, min(due - now, HEARTBEAT_S))
            if self.conn.poll(timeout):
                msg = self.conn.recv()
                self.busy_since = time.monotonic()
                if not self._handle(msg):
                    return
            self.busy_since = time.monotonic()
            for g in self.device.advance(list(self.gens.values()), time.monotonic()):
                self._finish(g, self.device.finish_reason(g))
            self.busy_since = None

    def _handle(self, msg: ToCell) -> bool:
        """Act on one message of the coordinator's; False: stop serving."""
        t0 = time.monotonic()
        match msg:
            case Gen(call_id, req):
                if self.role != "rollout":   # raced with a role change: hand it straight back
                    self.send(Done(call_id, [], [], [], "cancelled"))
                    return True
                g = _LiveCall(call_id, req)
                self.gens[call_id] = g
                self.device.start(g, t0)
            case Cancel(call_id):
                g = self.gens.get(call_id)
                if g is not None:
                    self._finish(g, "cancelled")
            case Role(role, switch_s):
                for g in list(self.gens.values()):   # drain: calls still here go back to the router
                    self._finish(g, "cancelled")
                self.device.switch(role, switch_s)
                self.role = role
                self.send(RoleDone(role, time.monotonic() - t0))
            case Micro(ms_id, work):
                grads, stats = self.device.micro(work)
                self.send(MicroDone(ms_id, time.monotonic() - t0, grads, stats))
            case Grads(grads):               # the core: a satellite's gradient for this step
                self.device.add_grads(grads)
            case Reduce(_, t):               # a satellite: its part of the update's reduce
                self.device.reduce(t)
            case Optim(version, work, t):
                from .collective import ReduceFailed

                try:
                    reduce_s = self.device.optim(version, work, t)
                except ReduceFailed as e:
                    self.send(OptimFailed(version, str(e)))
                    return True
                self.send(OptimDone(version + 1, time.monotonic() - t0, reduce_s))
            case UseArrays():                # a cell was lost: gradients go as arrays from now on
                self.device.use_arrays()
            case Weights(version):
                self.device.set_version(version)
            case Release(key):               # the harness is done with this context: free its K/V
                self.device.release(key)
            case BecomeCore():               # this cell now holds the optimizer (the old core was lost)
                self.device.become_core()
            case Stop():
                return False
            case _:
                raise ValueError(f"cell {self.cell}: unknown message {msg!r}")
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one Gyre cell agent (connects to a coordinator).")
    ap.add_argument("--cell", type=int, required=True)
    ap.add_argument("--coordinator", required=True, help="HOST:PORT the coordinator listens on")
    ap.add_argument("--authkey-env", default="GYRE_CELL_KEY", help="environment variable holding the key")
    ap.add_argument("--mode", choices=["emulated", "real"], default="emulated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a CPU cell's device budget)")
    ap.add_argument("--policy", help="real: the HF model directory the cell starts from")
    ap.add_argument("--weights", help="real: where versions are published (v<N>.safetensors)")
    ap.add_argument("--train-json", default="{}", help="real: trainer settings (lr, clip, ...) as JSON")
    ap.add_argument("--engine-json", default="", help="real: a vLLM server's settings (engine.kind=vllm) as JSON; "
                                                       "empty: the in-process engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-version", type=int, default=0, help="real: start from this published version")
    ap.add_argument("--grad-store", help="real: HOST:PORT of the store the cells' gradient groups are built on")
    ap.add_argument("--world", type=int, default=1, help="real, with --grad-store: the number of cells")
    ap.add_argument("--group-timeout", type=float, default=300.0, help="seconds to wait for the other cells")
    args = ap.parse_args(argv)
    host, port = args.coordinator.rsplit(":", 1)
    key = os.environ.get(args.authkey_env, "").encode()
    if not key:
        print(f"gyre cell: ${args.authkey_env} is empty; the coordinator sets it", file=sys.stderr)
        return 2
    groups = None
    if args.mode == "real":
        import json

        import torch

        torch.set_num_threads(args.threads)
        if not (args.policy and args.weights):
            print("gyre cell: --mode real needs --policy and --weights", file=sys.stderr)
            return 2
        if args.grad_store and args.world > 1:   # before the hello: the coordinator waits for every cell
            from .collective import PrefixGroups

            groups = PrefixGroups(args.grad_store, args.cell, args.world, args.group_timeout)
        if args.engine_json:
            from .vllm_cell import VLLMCellDevice

            device = VLLMCellDevice(args.cell, args.policy, args.weights, json.loads(args.train_json), args.seed,
                                    args.start_version, groups, engine=json.loads(args.engine_json))
        else:
            device = RealDevice(args.cell, args.policy, args.weights, json.loads(args.train_json), args.seed,
                                args.start_version, groups)
        device.cell_is_core = args.cell == 0
    else:
        device = EmulatedDevice()
    conn = Client((host, int(port)), authkey=key)
    try:
        Agent(args.cell, conn, device).serve()
    finally:
        conn.close()
        if groups is not None:
            groups.close()
        if hasattr(device, "close"):
            device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
