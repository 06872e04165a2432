"""A cell agent: one long-lived process per cell that switches role without restarting.

    python -m gyre_core.elastic.cells --cell 3 --coordinator 127.0.0.1:PORT --authkey-env GYRE_CELL_KEY

(`gyre cell ...` is the same command; a Prefect worker or a fleet's process manager wraps it.) The agent
connects to the coordinator, says hello, and then serves messages until told to stop:

    ("gen", call_id, request)        start a model call (rollout role only)
    ("cancel", call_id)              stop it now; answer with the tokens made so far, reason "cancelled"
    ("role", role, switch_s)         drain and take the role; answer ("role_done", role, seconds)
    ("micro", ms_id, work)           compute one streamed micro-step (train role); answer ("micro_done", ...)
    ("optim", version, work)         the core only: apply the step's update and publish version+1
    ("weights", version)             a newer policy was published (read it at the next call / micro-step)
    ("stop",)

and sends ("done", call_id, ids, logprobs, versions, reason) per call, plus ("beat", t) heartbeats.
Device work is done by a backend: `EmulatedDevice` replaces it by calibrated waits (to show a K = 8
fleet on a 2-core machine, clearly labelled as emulated); the real backend runs the engine and trainer.
A rollout cell serves many calls at once, one token at a time across all of them (batched decoding),
and reads its connection between tokens, so a cancel or a role change takes effect within one token.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection

HEARTBEAT_S = 1.0


@dataclass(slots=True)
class CallRequest:
    """A model call as the router sends it (a continuation after a reroute carries the tokens so far)."""

    key: str                     # the live context (KV-cache key)
    prompt_ids: list[int]        # full prompt, plus the tokens already generated on another cell
    max_new_tokens: int          # what is left to generate
    temperature: float = 1.0
    token_s: float = 0.0         # emulated device seconds per token (ignored by real devices)


@dataclass(slots=True)
class _Gen:
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

    def start(self, g: _Gen, now: float) -> None:
        g.next_t = now + g.req.token_s

    def due(self, gens: list[_Gen]) -> float | None:
        return min((g.next_t for g in gens), default=None)

    def advance(self, gens: list[_Gen], now: float) -> list[_Gen]:
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

    def work(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))


class Agent:
    def __init__(self, cell: int, conn: Connection, device) -> None:
        self.cell, self.conn, self.device = cell, conn, device
        self.role = "rollout"
        self.gens: dict[int, _Gen] = {}
        self.last_beat = 0.0

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def _finish(self, g: _Gen, reason: str) -> None:
        self.gens.pop(g.call_id, None)
        self.send("done", g.call_id, g.ids, g.logprobs, g.versions, reason)

    def serve(self) -> None:
        self.send("hello", self.cell, os.getpid(), self.device.label)
        while True:
            now = time.monotonic()
            if now - self.last_beat >= HEARTBEAT_S:
                self.send("beat", time.time())
                self.last_beat = now
            due = self.device.due(list(self.gens.values()))
            timeout = HEARTBEAT_S if due is None else max(0.0, min(due - now, HEARTBEAT_S))
            if self.conn.poll(timeout):
                if not self._handle(self.conn.recv()):
                    return
            for g in self.device.advance(list(self.gens.values()), time.monotonic()):
                self._finish(g, "length")

    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "gen":
            _, call_id, req = msg
            if self.role != "rollout":   # raced with a role change: hand it straight back
                self.send("done", call_id, [], [], [], "cancelled")
                return True
            g = _Gen(call_id, req)
            self.gens[call_id] = g
            self.device.start(g, time.monotonic())
        elif kind == "cancel":
            g = self.gens.get(msg[1])
            if g is not None:
                self.device.advance([g], time.monotonic())
                self._finish(g, "cancelled")
        elif kind == "role":
            _, role, switch_s = msg
            t0 = time.monotonic()
            for g in list(self.gens.values()):   # drain: calls still here go back to the router
                self._finish(g, "cancelled")
            self.device.work(switch_s)
            self.role = role
            self.send("role_done", role, time.monotonic() - t0)
        elif kind == "micro":
            _, ms_id, seconds = msg
            t0 = time.monotonic()
            self.device.work(seconds)
            self.send("micro_done", ms_id, time.monotonic() - t0)
        elif kind == "optim":
            _, version, seconds = msg
            t0 = time.monotonic()
            self.device.work(seconds)
            self.device.version = version + 1
            self.send("optim_done", version + 1, time.monotonic() - t0)
        elif kind == "weights":
            self.device.version = msg[1]
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"cell {self.cell}: unknown message {kind!r}")
        return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one Gyre cell agent (connects to a coordinator).")
    ap.add_argument("--cell", type=int, required=True)
    ap.add_argument("--coordinator", required=True, help="HOST:PORT the coordinator listens on")
    ap.add_argument("--authkey-env", default="GYRE_CELL_KEY", help="environment variable holding the key")
    ap.add_argument("--mode", choices=["emulated"], default="emulated")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    host, port = args.coordinator.rsplit(":", 1)
    key = os.environ.get(args.authkey_env, "").encode()
    if not key:
        print(f"gyre cell: ${args.authkey_env} is empty; the coordinator sets it", file=sys.stderr)
        return 2
    conn = Client((host, int(port)), authkey=key)
    Agent(args.cell, conn, EmulatedDevice()).serve()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
