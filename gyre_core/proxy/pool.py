"""Rollout cells behind the proxy: calls bound to a cell by context, generated in chunks, movable mid-call.

    pool = CellPool([engine_a, engine_b], chunk_tokens=16)
    job = pool.submit(Job(key, prompt_ids, max_new_tokens, temperature, on_tokens=emit))
    result = job.future.result()        # JobResult: ids, logprobs, versions (per token), finish_reason, moves
    pool.close_cell(0)                  # cell 0 leaves rollout: its calls continue on cell 1
    pool.open_cell(0); pool.release(key); pool.stop()

    pool = RouterPool(router)           # the elastic phase's router to cell processes instead (same interface)
    pool = ExpertPool(tokenizer, stop_id)  # the environment's expert as the model (demonstrations)

Each cell is an engine (`gyre_core.engine`: local or vLLM) driven by one thread. A call is bound to the
cell that served its context before (its K/V cache is there) while that cell is open, else to the open
cell with the fewest calls. A cell's thread batches all its calls and generates `chunk_tokens` tokens of
each per round (calls that arrive meanwhile join the next round), then hands the new tokens to the
caller (`on_tokens`: streaming). A cell that closes lets its calls go between rounds: each continues on
another open cell from its prompt plus the tokens so far, so a streaming client sees one response and the
record one completion, each token with the policy version that produced it. With no cell open, calls wait
until one opens.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True)
class JobResult:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str          # "stop" (a stop token or stop text), "length" (max_new_tokens)
    moves: int                  # times the call moved to another cell


@dataclass(slots=True, eq=False)
class Job:
    key: str                    # the context (cache affinity); one call of a key generates at a time per cell
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    on_tokens: Callable[[list[int]], None] | None = None      # new ids after each round (a cell's thread)
    stop_at: Callable[[list[int]], int | None] | None = None  # ids so far -> keep this many and stop, or None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    moves: int = 0
    cancelled: bool = False     # the caller went away (or its execution ended): dropped at the next round
    owner: str = ""             # the execution it belongs to (the elastic router binds executions to cells)
    request: dict | None = None  # a chat request's {"messages", "tools"}: what a scripted pool answers from
    future: Future = field(default_factory=Future)


class _Cell:
    def __init__(self, index: int, engine) -> None:
        self.index, self.engine = index, engine
        self.open = True
        self.queue: list[Job] = []
        self.running: list[Job] = []
        self.releases: list[str] = []     # context keys whose cache the cell's thread drops between rounds
        self.rounds = 0


class PoolStopped(RuntimeError):
    """The pool was stopped while a call waited."""


class CallDropped(RuntimeError):
    """The call was let go before it finished: its client went away, or its execution ended."""


def resolve(job: Job, result: JobResult | None = None, exc: BaseException | None = None) -> None:
    """Settle a job's future once; a future already settled (or cancelled by its waiter) is left alone."""
    if job.future.done():
        return
    try:
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
    except Exception:  # noqa: BLE001 - settled meanwhile by its waiter's cancellation
        pass


class CellPool:
    def __init__(self, engines: list, chunk_tokens: int = 16, max_batch: int = 256) -> None:
        if not engines:
            raise ValueError("CellPool: no engines")
        if chunk_tokens < 1:
            raise ValueError("CellPool: chunk_tokens must be >= 1")
        self.chunk_tokens, self.max_batch = chunk_tokens, max_batch
        self._cells = [_Cell(i, e) for i, e in enumerate(engines)]
        self._cv = threading.Condition()
        self._waiting: list[Job] = []          # no cell open
        self._affinity: dict[str, int] = {}    # context key -> the cell that served it last
        self._stopped = False
        self.moves = 0
        self._threads = [threading.Thread(target=self._serve, args=(c,), name=f"gyre-cell-{c.index}", daemon=True)
                         for c in self._cells]
        for t in self._threads:
            t.start()

    @property
    def engines(self) -> list:
        return [c.engine for c in self._cells]

    @property
    def stop_ids(self) -> list[int]:
        return self._cells[0].engine.stop_ids

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._stopped:
                raise PoolStopped("the proxy's engines are stopped")
            self._place(job)
            self._cv.notify_all()
        return job

    def close_cell(self, index: int) -> int:
        """Cell `index` leaves rollout: its queued calls move now, its running ones after their round.
        Returns how many calls it had."""
        with self._cv:
            cell = self._cells[index]
            cell.open = False
            queued, cell.queue = cell.queue, []
            for job in queued:
                self._move(job)
            self._cv.notify_all()
            return len(queued) + len(cell.running)

    def open_cell(self, index: int) -> None:
        with self._cv:
            self._cells[index].open = True
            waiting, self._waiting = self._waiting, []
            for job in waiting:
                self._place(job)
            self._cv.notify_all()

    def release(self, key: str) -> None:
        """A context is finished: the cell that holds its cache drops it (on its own thread, between rounds:
        an engine is driven by one thread)."""
        with self._cv:
            cell = self._affinity.pop(key, None)
            if cell is not None:
                self._cells[cell].releases.append(key)
                self._cv.notify_all()

    def load(self) -> list[int]:
        """Calls bound to each cell (queued + running)."""
        with self._cv:
            return [len(c.queue) + len(c.running) for c in self._cells]

    def stop(self) -> None:
        """Stop the cells' threads; calls still waiting fail with `PoolStopped`."""
        with self._cv:
            self._stopped = True
            left = self._waiting + [j for c in self._cells for j in c.queue]
            self._waiting = []
            for c in self._cells:
                c.queue = []
            self._cv.notify_all()
        for job in left:
            resolve(job, exc=PoolStopped("the proxy's engines were stopped"))
        for t in self._threads:
            t.join(timeout=30)

    # -- placement (the condition's lock held) ---------------------------------------------------------
    def _place(self, job: Job) -> None:
        open_cells = [c for c in self._cells if c.open]
        if not open_cells:
            self._waiting.append(job)
            return
        bound = self._affinity.get(job.key)
        if bound is None or not self._cells[bound].open:
            bound = min(open_cells, key=lambda c: (len(c.queue) + len(c.running), c.index)).index
        self._affinity[job.key] = bound
        self._cells[bound].queue.append(job)

    def _move(self, job: Job) -> None:
        job.moves += 1
        self.moves += 1
        self._affinity.pop(job.key, None)
        self._place(job)

    # -- a cell's thread -------------------------------------------------------------------------------
    def _serve(self, cell: _Cell) -> None:
        from ..engine import GenRequest

        while True:
            with self._cv:
                while not self._stopped and not cell.releases and not (cell.open and cell.queue):
                    self._cv.wait()
                if self._stopped:
                    return
                releases, cell.releases = cell.releases, []
                batch, keys, rest = [], set(), []
                for job in (cell.queue if cell.open else []):   # one call per context key per round (cache key)
                    if job.key in keys or len(batch) >= self.max_batch:
                        rest.append(job)
                    else:
                        batch.append(job)
                        keys.add(job.key)
                if cell.open:
                    cell.queue, cell.running = rest, batch
            for key in releases:
                cell.engine.release(key)      # engines ignore unknown keys
            live = []
            for j in batch:
                # a waiter that gave up before the call started: drop it (once running, it cannot be cancelled)
                if j.cancelled or (not j.future.running() and not j.future.set_running_or_notify_cancel()):
                    resolve(j, exc=CallDropped("the call was let go"))
                else:
                    live.append(j)
            try:
                reqs = [GenRequest(j.key, j.prompt_ids + j.ids, min(self.chunk_tokens, j.max_new_tokens - len(j.ids)),
                                   j.temperature) for j in live]
                outs = cell.engine.generate(reqs) if reqs else []
                version = cell.engine.version
            except BaseException as exc:  # noqa: BLE001 - the callers get the engine's error
                with self._cv:
                    cell.running = []
                for j in live:
                    resolve(j, exc=exc)
                continue
            cell.rounds += 1
            unfinished = []
            for j, out in zip(live, outs):
                if self._advance(j, out, version):
                    unfinished.append(j)
            with self._cv:
                cell.running = []
                for j in unfinished:
                    if cell.open and not self._stopped:
                        cell.queue.append(j)
                    else:
                        self._move(j)
                if self._stopped:
                    for j in unfinished:
                        resolve(j, exc=PoolStopped("the proxy's engines were stopped"))
                self._cv.notify_all()

    def _advance(self, job: Job, out, version: int) -> bool:
        """Take one round's tokens; True while the call goes on."""
        start = len(job.ids)
        job.ids += out.completion_ids
        job.logprobs += out.logprobs
        job.versions += [version] * len(out.completion_ids)
        finish = None
        if job.stop_at is not None and (keep := job.stop_at(job.ids)) is not None:
            del job.ids[keep:], job.logprobs[keep:], job.versions[keep:]
            finish = "stop"
        elif out.finish_reason == "stop":
            finish = "stop"
        elif len(job.ids) >= job.max_new_tokens:
            finish = "length"
        if job.on_tokens is not None and len(job.ids) > start:
            try:
                job.on_tokens(job.ids[start:])
            except Exception:  # noqa: BLE001 - a gone client must not stop the cell
                job.cancelled = True
        if finish is None and not job.cancelled:
            return True
        if finish is None:
            resolve(job, exc=CallDropped("the call was let go"))
        else:
            resolve(job, JobResult(job.ids, job.logprobs, job.versions, finish, job.moves))
        return False


class RouterPool:
    """The proxy's calls through the elastic phase's router (`gyre_core.elastic.router.Router`) to the cell
    agents: the router binds each execution to a rollout cell (session affinity), and when a cell leaves
    rollout it continues the execution's calls on another with the tokens so far, each token with the version
    that made it. The cells report whole completions, so a streaming client gets a call in one piece; stop
    texts are cut once it is back. Same interface as `CellPool` (`submit`, `release`, `stop`)."""

    def __init__(self, router, max_calls: int = 1024) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.router, self.moves = router, 0
        self._calls = ThreadPoolExecutor(max_workers=max_calls, thread_name_prefix="gyre-router-call")

    def submit(self, job: Job) -> Job:
        self._calls.submit(self._run, job)
        return job

    def _run(self, job: Job) -> None:
        from ..elastic.messages import CallRequest

        try:
            out = self.router.call(job.owner, CallRequest(job.key, list(job.prompt_ids), job.max_new_tokens,
                                                          job.temperature))
        except BaseException as exc:  # noqa: BLE001 - the caller gets the router's error (e.g. the run ended)
            resolve(job, exc=exc)
            return
        ids, logprobs, versions, finish = list(out.ids), list(out.logprobs), list(out.versions), out.finish_reason
        if job.stop_at is not None and (keep := job.stop_at(ids)) is not None:
            ids, logprobs, versions, finish = ids[:keep], logprobs[:keep], versions[:keep], "stop"
        self.moves += out.reroutes
        if job.on_tokens is not None and ids:
            try:
                job.on_tokens(ids)
            except Exception:  # noqa: BLE001 - a gone client
                pass
        resolve(job, JobResult(ids, logprobs, versions, finish, out.reroutes))

    def release(self, key: str) -> None:
        self.router.forget(key)

    def stop(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


class ExpertPool:
    """The environment's expert behind the proxy, as if it were the model: each chat call of an execution is
    answered by that execution's environment (`expert_reply(messages, tools)`, bound with `bind`) — or, with
    probability `epsilon`, by its `random_action` (an imperfect demonstrator, drawn from the execution's seed
    and call number) — tokenised as a completion the model could have written, the stop token appended. An
    unmodified agent program thus records demonstrations as the exact tokens RL will see: its own system
    prompt, its tool schemas, its compaction and sub-agents. Same interface as `CellPool`."""

    version = -1           # scripted: no policy version

    def __init__(self, tokenizer, stop_id: int, epsilon: float = 0.0, seed: int = 0) -> None:
        self.tokenizer, self.stop_id, self.epsilon, self.seed = tokenizer, stop_id, epsilon, seed
        self.moves = 0
        self._envs: dict[str, tuple[object, int]] = {}
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def bind(self, owner: str, env, seed: int) -> None:
        """Calls of execution `owner` are answered by `env` (reset to `seed`)."""
        with self._lock:
            self._envs[owner], self._calls[owner] = (env, seed), 0

    def submit(self, job: Job) -> Job:
        import random

        from ..envs.protocol import has_random_action, random_action

        try:
            with self._lock:
                env, seed = self._envs[job.owner]
                n = self._calls[job.owner] = self._calls[job.owner] + 1
            if job.request is None or job.request.get("messages") is None:
                raise ValueError("the expert answers chat requests only (/v1/chat/completions)")
            rng = random.Random(f"{self.seed}:{seed}:{n}")
            if self.epsilon > 0 and rng.random() < self.epsilon and has_random_action(env):
                text = random_action(env, rng)
            else:
                text = env.expert_reply(job.request["messages"], job.request.get("tools"))
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.stop_id]
        except BaseException as exc:  # noqa: BLE001 - the agent's request fails with the expert's error
            resolve(job, exc=exc)
            return job
        if job.on_tokens is not None:
            job.on_tokens(ids)
        resolve(job, JobResult(ids, [0.0] * len(ids), [self.version] * len(ids), "stop", 0))
        return job

    def release(self, key: str) -> None:
        pass

    def stop(self) -> None:
        with self._lock:
            self._envs.clear()
