"""A real cell whose rollout role runs on a vLLM server (`engine.kind=vllm`), its training role on the
cell's own trainer, as `RealDevice` does.

The server runs on the cell's devices (it inherits the agent's CUDA_VISIBLE_DEVICES) from the cell's
policy directory. Each live call is one streamed request read by its own thread; the agent's loop
collects the tokens that arrived. Per-token versions stay exact across a weight update: when a newer
version is published, every stream is closed (the server aborts those requests), the tokens received so
far keep the version that generated them, the server reloads in place (checked against the cell's own
copy of the new weights), and each call continues from its prompt plus the tokens so far. A call the
coordinator takes away (a cancel, a role change) is aborted the same way, and the router continues it on
another cell with the tokens so far.
"""
from __future__ import annotations

import os
import threading
import time

from .devices import LiveCall, RealDevice


class _Stream:
    """One call's request on the server, read by its own thread into `pending`."""

    def __init__(self, engine, g: LiveCall, version: int, seed: int):
        from ..engine.interface import GenRequest

        self.key, self.version = g.req.key, version
        self.cancel = threading.Event()
        self.pending: list[tuple[int, float]] = []
        self.lock = threading.Lock()
        self.ended = False            # the reader is done: the request finished, failed or was let go
        self.aborted = False          # let go by this cell before the request finished
        self.error: BaseException | None = None
        req = GenRequest(g.req.key, g.req.prompt_ids + g.ids, g.req.max_new_tokens - len(g.ids), g.req.temperature)
        self.thread = threading.Thread(target=self._read, args=(engine, req, seed), daemon=True)
        self.thread.start()

    def _read(self, engine, req, seed: int) -> None:
        try:
            for pair in engine.stream(req, seed=seed, cancel=self.cancel):
                with self.lock:
                    self.pending.append(pair)
        except BaseException as e:  # noqa: BLE001 - handed to the agent's loop, which raises it there
            self.error = e
        finally:
            self.ended = True

    def take(self) -> list[tuple[int, float]]:
        with self.lock:
            got, self.pending = self.pending, []
        return got

    def let_go(self) -> None:
        """Ask the reader to drop the connection (the server aborts the request at its next token)."""
        self.aborted = not self.ended
        self.cancel.set()


def stop_all(streams) -> None:
    """Let go of every stream first, then wait for the readers (each within about one token)."""
    streams = list(streams)
    for s in streams:
        s.let_go()
    for s in streams:
        s.thread.join(timeout=30)


def first_core(cell: int, threads: int, cores: int) -> int:
    """The first of the `threads` consecutive cores cell `cell`'s vLLM-CPU server binds to: cell i takes
    i·threads onwards, wrapping round (cells then share cores) and never past the last core."""
    first = (cell * threads) % cores
    return first if first + threads <= cores else max(0, cores - threads)


class VLLMCellDevice(RealDevice):
    def __init__(self, cell: int, policy_dir: str, weights_root: str, train: dict, seed: int,
                 start_version: int = 0, groups=None, engine: dict | None = None) -> None:
        """`engine`: the run's `EngineConfig` as a dict (its `concurrency`: the cell's capacity)."""
        super().__init__(cell, policy_dir, weights_root, train, seed, start_version, groups)
        from ..engine.vllm import ServerSpec, VLLMEngine, VLLMServer
        from ..seeds import cell_stream

        kw = dict(engine or {})
        spec = ServerSpec.from_config(kw, policy_dir, cell_stream(seed, cell))
        if spec.threads:                  # CPU: each cell's server on cores of its own
            spec.first_core = first_core(cell, spec.threads, os.cpu_count() or 1)
        self.reload_tol = kw.get("reload_check_tol")      # None: the served dtype's default
        self.vllm = VLLMEngine(VLLMServer(spec).start(), self.engine.stop_ids, seed=cell_stream(seed, cell),
                               concurrency=kw.get("concurrency", 64), owns_server=True)
        self.label = f"vllm/{self.label.split('/', 1)[1]}"
        if spec.tensor_parallel_size > 1:
            from ..engine.vllm import cuda_host

            self.label += (f", serves tensor-parallel on {spec.tensor_parallel_size} GPUs" if cuda_host()
                           else f", serves on {spec.threads} CPU threads (vLLM-CPU: no tensor parallel)")
        self.served = -1                  # the version the server holds (its start-up weights: the policy dir)
        self.streams: dict[int, _Stream] = {}
        self._opened = 0
        self._serve_newest()

    # -- weights on the server --------------------------------------------------------------------
    def _serve_newest(self) -> None:
        """Load the newest published version into the server (no stream may be open), checked against
        this cell's own copy of it."""
        from ..engine.vllm import VLLMError
        from ..trainer.publish import version_uri

        assert not self.streams, "a reload under open streams would mislabel their tokens' versions"
        self._sync()                      # the cell's model (shared with its trainer) holds it too
        if self.served == self.version:
            return
        self.served = -1
        try:
            self.vllm.load_checked(version_uri(self.weights_root, self.version), self.version, self.engine.model,
                                   self.vocab_size, self.reload_tol)
        except VLLMError as e:
            raise VLLMError(f"cell {self.cell}: {e}") from None
        self.served = self.version

    # -- rollout ---------------------------------------------------------------------------------
    def _open(self, g: LiveCall) -> None:
        from ..engine.interface import mix_seed

        self._opened += 1
        self.streams[g.call_id] = _Stream(self.vllm, g, self.served, mix_seed(self.vllm.seed, self._opened, 0))

    def start(self, g: LiveCall, now: float) -> None:
        if self.published > self.served and not self.streams:
            self._serve_newest()      # nothing in flight: take the new version now (else `advance` does)
        self._open(g)

    def due(self, gens: list[LiveCall]) -> float | None:
        if not self.streams:
            return None
        ready = any(s.pending or s.ended for s in self.streams.values()) or self.published > self.served
        return time.monotonic() + (0.0 if ready else 0.002)

    def advance(self, gens: list[LiveCall], now: float) -> list[LiveCall]:
        if not self.streams:          # e.g. a training cell: new versions reach its server when it rolls out
            return []
        finished = []
        if self.published > self.served:      # a new version: stop every stream, reload, continue each
            stop_all(self.streams.values())
            finished = self._collect(gens)    # what the old version finished; the rest stays in `streams`
            live = [g for g in gens if g.call_id in self.streams]
            self.streams.clear()
            self._serve_newest()
            for g in live:
                self._open(g)
        return finished + self._collect(gens)

    def _collect(self, gens: list[LiveCall]) -> list[LiveCall]:
        finished = []
        for g in gens:
            s = self.streams.get(g.call_id)
            if s is None:
                continue
            ended = s.ended               # read before taking: tokens that arrive later stay pending
            got = s.take()
            g.ids += [t for t, _ in got]
            g.logprobs += [lp for _, lp in got]
            g.versions += [s.version] * len(got)
            if s.error is not None and not s.aborted:
                raise s.error
            if self._complete(g) or (ended and not s.pending and not s.aborted):
                s.let_go()
                del self.streams[g.call_id]
                finished.append(g)
        return finished

    def _complete(self, g: LiveCall) -> bool:
        return bool(g.ids) and (g.ids[-1] in self.stops or len(g.ids) >= g.req.max_new_tokens)

    def release(self, key: str) -> None:
        """The call went elsewhere (a cancel, a role change) or its context is done: abort its request."""
        gone = [cid for cid, s in self.streams.items() if s.key == key]
        stop_all(self.streams.pop(cid) for cid in gone)
        super().release(key)

    def close(self) -> None:
        stop_all(self.streams.values())
        self.vllm.close()
        super().close()
