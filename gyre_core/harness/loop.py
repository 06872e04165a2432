"""The multi-turn agent loop, written as a state machine so many executions share one batched engine.

    results = run_executions(specs, policy, cfg.harness, make_env, fmt, progress=bar)

Each `Execution` alternates `request()` (the next model call, or None when finished) and
`deliver(result)`. The history is the context; when the next call would exceed the context budget the
harness compacts: it opens a fresh context (a new model-call context of the same execution, role
`main-summary`) from the environment's summary of the state. Turn and token limits are deterministic;
an optional wall-clock limit exists for real sandboxes. An execution that hits a limit is scored on
what it left behind; an exception in its environment marks it failed, with the reason, and the others
go on.
"""
from __future__ import annotations

import copy
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..config import HarnessConfig
from ..envs import close_env, reset_env
from ..envs.protocol import StepResult, supports
from ..records import (CallRecord, ExecutionRecord, STATUS_DONE, STATUS_FAILED, STATUS_TIMEOUT,
                       STATUS_TOKEN_LIMIT, STATUS_TURN_LIMIT)
from .conversation import ChatFormat


@dataclass(slots=True)
class ModelCall:
    """What an execution asks of the policy: the engine's request plus who is asking."""

    key: str
    prompt_ids: list[int]
    max_new_tokens: int
    execution: "Execution"


@dataclass(slots=True)
class Completion:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    entropy: float = 0.0     # of the first token's distribution (0 when the policy does not say)
    versions: list[int] | None = None   # per token, when they differ (a call rerouted across an update)


class Policy(Protocol):
    """Anything that answers a batch of model calls (the LLM engine, the expert, a random policy). It may also
    have `ended(execution_id)`: called as an execution makes its last call, before its evaluator runs (the
    elastic phase's router frees the execution's slot there)."""

    def complete(self, calls: list[ModelCall]) -> list[Completion]: ...
    def release(self, key: str) -> None: ...


@dataclass(slots=True)
class ForkEvent:
    """Before call `turn`, continue `children` from a copy of the state (they share every earlier call).

    With `entropy` set, fork instead at the first call in [turn, until] whose first-token entropy (how
    unsure the policy was) reaches it, and at `until` if none does.
    """

    turn: int
    children: list["ExecutionSpec"]
    until: int = 0
    entropy: float | None = None

    def due(self, turn: int, entropy: float) -> bool:
        if turn < self.turn:
            return False
        return self.entropy is None or entropy >= self.entropy or turn >= self.until


@dataclass(slots=True)
class ExecutionSpec:
    run_id: str
    step: int
    execution_id: str
    task_id: str
    seed: int
    split: str
    policy_version: int = 0
    forks: list[ForkEvent] = field(default_factory=list)   # in call order


def fork_tree(group: list[ExecutionSpec], k: int, depth: int, window: tuple[int, int], rng,
              entropy: float | None = None) -> None:
    """Arrange a task's executions as trees of forks: each block of k**depth executions has one root;
    at each of `depth` levels every member so far forks k−1 new continuations. Level d forks between
    `window` calls after level d−1 (uniformly; or, with `entropy`, at the first unsure call there)."""
    size = k ** depth
    if len(group) % size:
        raise ValueError(f"fork_tree: {len(group)} executions are not whole trees of k**depth = {size}")
    for start in range(0, len(group), size):
        members, turn_of = [group[start]], {id(group[start]): 0}
        nxt = start + 1
        for _ in range(depth):
            for m in list(members):
                kids = group[nxt:nxt + k - 1]
                nxt += k - 1
                lo = turn_of[id(m)] + window[0]
                hi = turn_of[id(m)] + window[1]
                t = lo if entropy is not None else rng.randint(lo, hi)
                m.forks.append(ForkEvent(t, kids, hi, entropy))
                for c in kids:
                    turn_of[id(c)] = hi if entropy is not None else t
                turn_of[id(m)] = hi if entropy is not None else t
                members += kids


class Execution:
    def __init__(self, spec: ExecutionSpec, env, fmt: ChatFormat, cfg: HarnessConfig, stop_texts: dict[int, str]):
        self.env, self.fmt, self.cfg, self.stop_texts = env, fmt, cfg, stop_texts
        self._env_closed = False
        self._has_progress = supports(env, "progress")
        self.tools = None           # OpenAI function schemas, or None
        self.record = ExecutionRecord(
            run_id=spec.run_id, step=spec.step, execution_id=spec.execution_id, task_id=spec.task_id,
            seed=spec.seed, split=spec.split, env=getattr(env, "name", type(env).__name__),
            policy_version=spec.policy_version, t_start=time.time())
        self.finished = False
        self.to_score = False      # ended (not failed): the evaluator is still to run
        self._submitted = False    # a tool call ended the episode
        self.tokens_used = 0
        self._prompt: list[int] = []
        self._context_key = ""
        self._pending_obs: str | None = None
        try:
            self.tools = env.tools() if supports(env, "tools") else None
            obs = reset_env(env, spec.seed, spec.split)
            self.system = env.instructions()
            self._open_context(f"Mission: {env.mission()}\n{obs}", role="main")
        except Exception as exc:  # an environment that cannot even start
            self._fail(exc)
            return
        if len(self._prompt) + cfg.max_new_tokens > cfg.context_tokens:
            self._finish(STATUS_TOKEN_LIMIT)   # the first observation alone overflows the budget

    def fork(self, spec: ExecutionSpec, make_env: Callable[[], object]) -> "Execution":
        """A continuation from this execution's current state: the environment restored from a saved
        copy, the same history and the same pending prompt. The first `fork_call` calls are shared."""
        child = copy.copy(self)
        env = make_env()
        try:
            env.restore_state(self.env.save_state())
        except BaseException:
            close_env(env)
            raise
        child.env, child._env_closed = env, False
        rec = self.record
        child.record = copy.copy(rec)
        child.record.execution_id = spec.execution_id
        child.record.fork_of, child.record.fork_call = rec.execution_id, len(rec.calls)
        child.record.calls = list(rec.calls)   # shared CallRecords: never mutated after delivery
        child.record.t_start = time.time()
        child._context_key = f"{spec.execution_id}/c{self._context_index}"
        return child

    # -- context management -------------------------------------------------------------------
    def _open_context(self, user_text: str, role: str) -> None:
        self._context_index = getattr(self, "_context_index", -1) + 1
        self._role = role
        self._prompt = self.fmt.start(self.system, user_text, tools=self.tools)
        self._parent_call, self._prefix_len = -1, 0
        self._context_key = f"{self.record.execution_id}/c{self._context_index}"
        self._new_tokens = len(self._prompt)

    def _extend_context(self, user_text: str, last: CallRecord, tool_results: list[str] | None = None) -> None:
        """Append the next turn after `last`: a user message, or (`tool_results`) one tool message per result."""
        stopped = self.stop_texts.get(last.completion_ids[-1]) if last.finish_reason == "stop" and last.completion_ids else None
        base = last.prompt_ids + last.completion_ids
        extra = (self.fmt.continuation(user_text, stopped) if tool_results is None
                 else self.fmt.tool_continuation(tool_results, stopped))
        if len(base) + len(extra) + self.cfg.max_new_tokens > self.cfg.context_tokens:
            self.record.compactions += 1
            self._open_context(f"Mission: {self.env.mission()}\n{self.env.summary()}\n{user_text}",
                               role="main-summary")
            return
        self._prompt = base + extra
        self._parent_call, self._prefix_len = last.call_index, len(base)
        self._new_tokens = len(extra)

    # -- the two halves of a turn ---------------------------------------------------------------
    def request(self) -> ModelCall | None:
        if self.finished:
            return None
        return ModelCall(self._context_key, self._prompt, self.cfg.max_new_tokens, self)

    def deliver(self, out: Completion, t_start: float) -> None:
        rec = self.record
        call = CallRecord(
            execution_id=rec.execution_id, call_index=len(rec.calls), context_index=self._context_index,
            role=self._role, prompt_ids=self._prompt, completion_ids=list(out.completion_ids),
            logprobs=list(out.logprobs),
            versions=list(out.versions) if out.versions is not None else [out.version] * len(out.completion_ids),
            finish_reason=out.finish_reason, parent_call=self._parent_call, prefix_len=self._prefix_len,
            t_start=t_start, t_end=time.time())
        rec.calls.append(call)
        rec.turns += 1
        self.tokens_used += self._new_tokens + len(call.completion_ids)
        try:
            if self._has_progress:    # where the episode stood when the policy chose this action
                call.progress = float(self.env.progress())
            if self.tools is not None:
                tool_results, observation = self._tool_turn(call)
            else:
                tool_results, observation = None, None
            if tool_results is None and observation is None:     # a text action (or a final answer)
                text = self.fmt.tokenizer.decode(strip_stop(call.completion_ids, self.stop_texts),
                                                 skip_special_tokens=True)
                result = self.env.step(text)
        except Exception as exc:
            self._fail(exc)
            return
        if tool_results is not None or observation is not None:   # tools were called (or tried): next turn
            result = StepResult(observation or "", done=self._submitted, valid=observation is None)
        elif result.valid:  # the environment ran the action: one tool invocation, named after the call
            call.tool_call_ids = [f"{rec.execution_id}/{call.call_index}"]
        if not result.valid:
            rec.invalid_actions += 1
        if result.done:
            return self._finish(STATUS_DONE)
        if rec.turns >= self.cfg.max_turns:
            return self._finish(STATUS_TURN_LIMIT)
        if self.tokens_used >= self.cfg.max_execution_tokens:
            return self._finish(STATUS_TOKEN_LIMIT)
        if self.cfg.wall_clock_s is not None and time.time() - rec.t_start > self.cfg.wall_clock_s:
            return self._finish(STATUS_TIMEOUT)
        try:
            self._extend_context(result.observation, call, tool_results)
        except Exception as exc:   # e.g. the environment's summary() during compaction
            self._fail(exc)
            return
        if len(self._prompt) + self.cfg.max_new_tokens > self.cfg.context_tokens:
            # even a fresh context from the summary does not fit: stop here, scored on what it left
            self._finish(STATUS_TOKEN_LIMIT)

    def _tool_turn(self, call: CallRecord) -> tuple[list[str] | None, str | None]:
        """Parse the completion's tool calls (recording the parse and each call's token span) and run them:
        (results, None) when it called tools; (None, error text) when a call was malformed; (None, None)
        when it called none (the text then goes to `step`)."""
        from .tools import PARSE_MALFORMED, PARSE_NONE, parse_tool_calls, token_spans

        ids = strip_stop(call.completion_ids, self.stop_texts)
        text = self.fmt.tokenizer.decode(ids, skip_special_tokens=False)
        parsed = parse_tool_calls(text, {t["function"]["name"] for t in self.tools})
        call.tool_parse = parsed.status
        if parsed.status == PARSE_NONE:
            return None, None
        if parsed.status == PARSE_MALFORMED:
            return None, (f"Your tool call could not be run: {parsed.error}. Call a tool as "
                          '{"name": ..., "arguments": {...}} inside <tool_call></tool_call>.')
        call.tool_spans = token_spans(self.fmt.tokenizer, ids, [c.span for c in parsed.calls])
        call.tool_call_ids = [f"{self.record.execution_id}/{call.call_index}/{k}" for k in range(len(parsed.calls))]
        results = []
        for c in parsed.calls:
            try:
                out = self.env.call_tool(c.name, c.arguments)
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the agent's observation
                out = f"error: {type(exc).__name__}: {exc}"
            if isinstance(out, StepResult):       # a tool that may end the episode (submit)
                self._submitted = self._submitted or out.done
                out = out.observation
            results.append(str(out))
        return results, None

    def _finish(self, status: str) -> None:
        """Ended (not failed): the model's part is over; `evaluate()` scores what it left behind."""
        self.record.status = status
        self.to_score = True
        self._close()

    def evaluate(self) -> None:
        """The evaluator on what the execution left (run off the rollout's critical path by `run_executions`);
        then the environment's `close()`."""
        try:
            score_record(self.record, self.env.score, self.cfg.score_retries)
        finally:
            self.release_env()

    def release_env(self) -> None:
        """The environment's `close()`, once (whichever path ends the execution first)."""
        if not self._env_closed:
            self._env_closed = True
            close_env(self.env)

    def _fail(self, exc: BaseException) -> None:
        self.record.status = STATUS_FAILED
        self.record.error = f"{type(exc).__name__}: {exc}"[:2000]
        self._close()

    def _close(self) -> None:
        self.finished = True
        self.record.t_end = time.time()


def score_record(record: ExecutionRecord, score: Callable[[], object], retries: int) -> None:
    """Run the evaluator `score()` (up to `retries` more times when it raises) and put its success and partial
    score on `record` (None: nothing to score, the placeholder reward 0 stands). An evaluator failure is not a
    zero: after the retries the execution is marked failed, with why, and excluded from training."""
    attempts, t0 = retries + 1, time.time()
    for _ in range(attempts):
        try:
            result = score()
            break
        except Exception as exc:  # noqa: BLE001 - any evaluator failure is retried
            last = exc
    else:
        record.status = STATUS_FAILED
        record.error = f"score failed after {attempts} attempts: {type(last).__name__}: {last}"[:2000]
        record.evaluator_s = time.time() - t0
        return
    record.evaluator_s = time.time() - t0
    if result is not None:
        record.success, record.partial = bool(result.success), float(result.partial)


def strip_stop(ids: list[int], stop_texts: dict[int, str]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stop_texts else ids


class _Evaluators:
    """The evaluators of ended executions, on a thread pool so they run off the rollout's critical path:
    the others go on generating meanwhile. `collect` hands on the records whose evaluator has finished."""

    def __init__(self, workers: int, settle: Callable[[int, ExecutionRecord], None]) -> None:
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="gyre-evaluator")
        self.settle = settle
        self.running: dict[Future, tuple[int, Execution]] = {}

    def submit(self, i: int, ex: Execution) -> None:
        self.running[self.pool.submit(ex.evaluate)] = (i, ex)

    def collect(self, block: bool = False) -> None:
        if not self.running:
            return
        finished, _ = wait(list(self.running), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in finished:
            i, ex = self.running.pop(fut)
            fut.result()        # score_record catches the evaluator's failures: anything raised here is a bug
            self.settle(i, ex.record)

    def drain(self) -> None:
        while self.running:
            self.collect(block=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def run_executions(specs: list[ExecutionSpec], policy: Policy, cfg: HarnessConfig, make_env: Callable[[], object],
                   fmt: ChatFormat, stop_texts: dict[int, str], concurrency: int,
                   on_finish: Callable[[ExecutionRecord], None] | None = None) -> list[ExecutionRecord]:
    """Run executions with at most `concurrency` live at once, batching their model calls.

    Records come back in the order of `specs` (fork children included: list them in `specs` too,
    and in their parent's `forks`). `on_finish` is called as each one ends, scored (progress bars).
    Forked children join the live set at once, so with forks up to `concurrency` roots × their trees
    run. An ended execution's slot goes to the next pending one at once; its evaluator runs on one of
    `cfg.score_workers` threads meanwhile.
    """
    children = {id(c) for s in specs for ev in s.forks for c in ev.children}
    pending = [(i, s) for i, s in enumerate(specs) if id(s) not in children][::-1]
    live: list[tuple[int, Execution]] = []
    done: dict[int, ExecutionRecord] = {}

    def settle(i: int, record: ExecutionRecord) -> None:
        done[i] = record
        if on_finish:
            on_finish(record)

    evaluators = _Evaluators(cfg.score_workers, settle)

    ended = getattr(policy, "ended", None)

    def retire(i: int, ex: Execution) -> None:
        policy.release(ex._context_key)
        if ended is not None:
            ended(ex.record.execution_id)
        if ex.to_score:
            evaluators.submit(i, ex)          # (closes the environment once scored)
        else:
            ex.release_env()
            settle(i, ex.record)

    index = {id(s): i for i, s in enumerate(specs)}
    # every execution started and still referenced (live, or waiting for its evaluator): on a failure their
    # environments are closed; one that has ended and been settled drops out, its environment with it
    made: weakref.WeakSet[Execution] = weakref.WeakSet()
    forks_due: dict[int, list[ForkEvent]] = {}   # live index -> its fork events still to come

    try:
        while pending or live:
            evaluators.collect()
            while pending and len(live) < concurrency:
                i, spec = pending.pop()
                ex = Execution(spec, make_env(), fmt, cfg, stop_texts)
                made.add(ex)
                if spec.forks:
                    forks_due[i] = list(spec.forks)
                if ex.finished:   # could not even start: its fork children start afresh
                    for ev in forks_due.pop(i, []):
                        pending.extend((index[id(c)], c) for c in ev.children)
                    retire(i, ex)
                else:
                    live.append((i, ex))
            if not live:      # everything pending failed to start
                continue
            calls = [ex.request() for _, ex in live]
            t0 = time.time()
            outs = policy.complete(calls)
            still: list[tuple[int, Execution]] = []
            for (i, ex), out in zip(live, outs):
                events = forks_due.get(i)
                if events and events[0].due(ex.record.turns, out.entropy):
                    # fork before this call is applied: the children share every earlier call and sample
                    # this decision again from a copy of the same state (the parent keeps its own sample)
                    for c in events.pop(0).children:
                        child = ex.fork(c, make_env)
                        made.add(child)
                        still.append((index[id(c)], child))
                        if c.forks:
                            forks_due[index[id(c)]] = list(c.forks)
                key_before = ex._context_key
                ex.deliver(out, t0)
                if ex.finished:
                    for ev in forks_due.pop(i, []):   # ended before a fork: those children start afresh
                        pending.extend((index[id(c)], c) for c in ev.children)
                    retire(i, ex)
                else:
                    if ex._context_key != key_before:
                        policy.release(key_before)
                    still.append((i, ex))
            live = still
        evaluators.drain()
    finally:
        evaluators.close()
        for ex in list(made):        # a batch that failed leaves environments open: close them (once)
            ex.release_env()
    return [done[i] for i in range(len(specs))]
