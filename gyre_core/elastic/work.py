"""What the coordinator's executions and cells actually do: emulated, or the real harness and model.

Both kinds answer the same questions, so the coordinator, router, controller and queues are one code:
how many bursts, what to start for burst s (one job per execution, run on its own thread by the
coordinator: it calls `router.call` and reports when it finishes), what a micro-step and an update cost the cell, and the extra arguments a cell agent needs.

- `EmulatedWork(workload)`: each execution makes the workload's n calls (TOKENS_PER_CALL tokens each,
  `call_s` of emulated device time) with `env_s` of environment latency after each; a micro-step costs
  `train_s_per_call` per call of its executions; the cells wait instead of computing.
- `HarnessWork(run_dir, ...)`: the run's environment and agent harness, with model calls through the
  router to real cells that decode and train the run's model; finished groups are scored (group-relative
  advantages) and streamed as training sequences; the cells publish versions into the run's weights.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .cells import CallRequest
from .workload import Workload

TOKENS_PER_CALL = 8   # emulated calls: tokens generated per call (call_s is spread over them)

# Called once per finished execution: report(burst, items), items = what is now ready to stream, each
# (execution id, payload, behaviour versions of its trainable tokens; empty: nothing to train).
Report = Callable[[int, list[tuple[str, object, list[int]]]], None]


@dataclass(slots=True)
class ExecutionLog:
    """What one emulated execution got back: its calls' tokens and per-token versions (TITO)."""

    execution_id: str
    burst: int
    calls: list[tuple[int, list[int], list[int]]] = field(default_factory=list)   # (prompt_len, ids, versions)
    reroutes: int = 0
    times: list[tuple[float, float]] = field(default_factory=list)   # each call's (start, end), monotonic s


class EmulatedWork:
    mode = "emulated"

    def __init__(self, workload: Workload) -> None:
        self.w = workload
        self.steps = workload.steps
        self.switch_to_train_s, self.switch_to_rollout_s = workload.switch_to_train_s, workload.switch_to_rollout_s
        self.logs: list[ExecutionLog] = []

    def cell_args(self) -> list[str]:
        return ["--mode", "emulated"]

    def start_burst(self, s: int, router, report: Report) -> list[Callable[[], None]]:
        jobs = []
        for i, n in enumerate(self.w.calls(s)):
            log = ExecutionLog(f"b{s}/e{i}", s)
            self.logs.append(log)
            jobs.append(functools.partial(self._execution, log, n, router, report))
        return jobs

    def _execution(self, log: ExecutionLog, n_calls: int, router, report: Report) -> None:
        prompt: list[int] = [0] * 4
        token_s = self.w.call_s / TOKENS_PER_CALL
        for _ in range(n_calls):
            t0 = time.monotonic()
            out = router.call(log.execution_id, CallRequest(f"{log.execution_id}/c0", list(prompt),
                                                            TOKENS_PER_CALL, 1.0, token_s))
            log.times.append((t0, time.monotonic()))
            log.calls.append((len(prompt), out.ids, out.versions))
            log.reroutes += out.reroutes
            prompt += out.ids + [0] * 2          # the completion, then a short observation
            time.sleep(self.w.env_s)
        router.forget(f"{log.execution_id}/c0")
        router.release(log.execution_id)
        report(log.burst, [(log.execution_id, n_calls, [v for _, _, vs in log.calls for v in vs])])

    def burst_size(self, s: int) -> int:
        return self.w.executions_per_step

    def micro_work(self, ms) -> float:
        return sum(self.w.train_s(n) for n in ms.payloads)

    def optim_work(self, version: int, n_executions: int) -> float:
        return self.w.optimizer_s + self.w.publish_s


class RouterPolicy:
    """The harness's `Policy` over the router: a round's calls go out concurrently, each to the
    execution's rollout cell; tokens carry the version that made them."""

    def __init__(self, router, temperature: float, max_new_tokens: int) -> None:
        self.router, self.temperature, self.max_new = router, temperature, max_new_tokens

    def complete(self, calls):
        from ..harness.loop import Completion

        outs: list = [None] * len(calls)

        def one(i, c):
            ex_id = c.execution.record.execution_id
            outs[i] = self.router.call(ex_id, CallRequest(c.key, list(c.prompt_ids), c.max_new_tokens,
                                                          self.temperature))
        if len(calls) == 1:       # one execution per thread (HarnessWork): no helper thread needed
            one(0, calls[0])
        else:
            threads = [threading.Thread(target=one, args=(i, c), daemon=True) for i, c in enumerate(calls)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        return [Completion(o.ids, o.logprobs, o.finish_reason, min(o.versions, default=0), 0.0, list(o.versions))
                for o in outs]

    def release(self, key: str) -> None:
        self.router.forget(key)   # the serving cell drops the context's K/V (the slot: HarnessWork frees it)


class HarnessWork:
    """The run's real environment, harness and model (`gyre_core.steps` seeds and rewards)."""

    mode = "real"

    def __init__(self, run_dir: str, steps: int, first_step: int = 0) -> None:
        """Bursts `first_step` .. `steps` − 1; a resumed run starts at its newest published version."""
        from ..run import RunDir

        self.run = RunDir.open(run_dir)
        self.cfg = self.run.cfg
        self.steps, self.first_step, self.threads = steps, first_step, self.cfg.elastic.devices_per_cell
        self.switch_to_train_s = self.switch_to_rollout_s = 0.0    # real cells do the real work
        self.records: list = []
        self._groups: dict[str, list] = {}
        self._lock = threading.Lock()

    def cell_args(self) -> list[str]:
        cfg, rl = self.cfg, self.cfg.rl
        train = {"lr": rl.lr, "zero_stage": cfg.trainer.zero_stage, "grad_clip": rl.grad_clip,
                 "temperature": cfg.rollout.temperature, "clip_low": rl.clip_low, "clip_high": rl.clip_high,
                 "is_cap": cfg.elastic.is_cap, "negative_scale": rl.negative_scale,
                 "micro_batch_tokens": rl.micro_batch_tokens, "entropy_coef": rl.entropy_coef,
                 "optimizer": rl.optimizer,
                 "device": cfg.model.device}
        return ["--mode", "real", "--policy", str(self.run.warm), "--weights",
                self.cfg.trainer.publish_root or str(self.run.path / "weights"),
                "--start-version", str(self.first_step),
                "--train-json", json.dumps(train), "--seed", str(cfg.run.seed), "--threads", str(self.threads)]

    def take_records(self, step: int) -> list:
        """The finished executions of `step`, handed over once (its version is published: all are in)."""
        with self._lock:
            mine = [r for r in self.records if r.step == step]
            self.records = [r for r in self.records if r.step != step]
        return mine

    def burst_size(self, s: int) -> int:
        return self.cfg.rollout.tasks_per_step * self.cfg.rollout.group_size

    def start_burst(self, s: int, router, report: Report) -> list[Callable[[], None]]:
        from .. import steps as st
        from ..harness.loop import ExecutionSpec

        run, ro = self.run, self.cfg.rollout
        specs = []
        for b in range(ro.tasks_per_step):
            seed = self.cfg.env.train_seed_start + s * ro.tasks_per_step + b
            specs += [ExecutionSpec(run.run_id, s, f"{run.run_id}/s{s}/t{b}/g{g}", f"seed{seed}", seed, "train", s)
                      for g in range(ro.group_size)]
        st._policy(self.run)          # the tokenizer and chat format, loaded once before the threads share it
        return [functools.partial(self._execution, spec, router, report) for spec in specs]

    def _execution(self, spec, router, report: Report) -> None:
        """One execution on its own thread: a model call, then its environment turn, at its own pace
        (a real harness does not wait for the other executions of a round)."""
        from .. import steps as st
        from ..harness.loop import run_executions

        _, _, fmt, stop_texts = st._policy(self.run)

        def finished(rec) -> None:
            router.release(rec.execution_id)
            self._finished(rec, report)

        policy = RouterPolicy(router, self.cfg.rollout.temperature, self.cfg.harness.max_new_tokens)
        run_executions([spec], policy, self.cfg.harness, st._env_factory(self.run, rollout=True), fmt, stop_texts, 1, finished)

    def _finished(self, rec, report: Report) -> None:
        """Score a task's group once all of it is in; stream each execution's sequences."""
        from ..processor.batch import RecordMismatch, execution_sequences, group_advantages, reward_of

        rl = self.cfg.rl
        rec.reward = reward_of(rec.success, rec.partial, rl.partial_reward) if rec.status != "failed" else 0.0
        with self._lock:
            self.records.append(rec)
            group = self._groups.setdefault(rec.task_id, [])
            group.append(rec)
            if len(group) < self.cfg.rollout.group_size:
                report(rec.step, [])          # finished; it trains with its group (advantages need all of it)
                return
            del self._groups[rec.task_id]
        ok = [r for r in group if r.status != "failed"]
        adv = group_advantages({r.execution_id: r.reward for r in ok}, {rec.task_id: [r.execution_id for r in ok]},
                               rl.advantage_norm, std_floor=rl.advantage_std_floor)
        items = []
        for r in group:
            try:
                seqs = (execution_sequences(r, adv[r.execution_id], rl.progress_credit)
                        if r.execution_id in adv else [])
            except RecordMismatch:   # a record whose calls do not line up is not trained (as in build_batch)
                seqs = []
            items.append((r.execution_id, seqs, [v for sq in seqs for v, w in zip(sq.versions, sq.weights) if w]))
        report(rec.step, items)

    def micro_work(self, ms):
        return ms

    def optim_work(self, version: int, n_executions: int) -> int:
        return n_executions
