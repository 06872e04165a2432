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
Device work is done by a backend (`devices`): `EmulatedDevice` replaces it by calibrated waits (to show a K = 8
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
from multiprocessing.connection import Client, Connection

from .devices import EmulatedDevice, LiveCall, RealDevice
from .messages import (BecomeCore, Beat, Cancel, Done, FromCell, Gen, Grads, Hello, Micro, MicroDone,
                       Optim, OptimDone, OptimFailed, Reduce, Release, Role, RoleDone, Stop, ToCell, UseArrays,
                       Weights)

HEARTBEAT_S = 1.0


class Agent:
    def __init__(self, cell: int, conn: Connection, device) -> None:
        self.cell, self.conn, self.device = cell, conn, device
        self.role = "rollout"
        self.gens: dict[int, LiveCall] = {}
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

    def _finish(self, g: LiveCall, reason: str) -> None:
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
                g = LiveCall(call_id, req)
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
                    reduce_s, stats = self.device.optim(version, work, t)
                except ReduceFailed as e:
                    self.send(OptimFailed(version, str(e)))
                    return True
                self.send(OptimDone(version + 1, time.monotonic() - t0, reduce_s, stats))
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
    ap.add_argument("--decode-slowdown", type=float, default=0.0,
                    help="emulated: each other live call adds this fraction to a token's time")
    ap.add_argument("--weight-sync-s", type=float, default=0.0,
                    help="emulated: seconds a rolling-out cell pauses to load each published version")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-version", type=int, default=0, help="real: start from this published version")
    ap.add_argument("--grad-store", help="real: the store the cells' gradient groups are built on (file:PATH or tcp:HOST:PORT)")
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
        device = EmulatedDevice(args.decode_slowdown, args.weight_sync_s)
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
