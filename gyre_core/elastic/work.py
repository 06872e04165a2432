"""What the coordinator's executions and cells actually do: the `Work` protocol, and its emulated kind.

Every kind of work answers the same questions, so the coordinator, router, controller and queues are one
code: how many bursts, what to start for burst s (one job per execution, run on its own thread by the
coordinator: it calls `router.call` and reports when it finishes), what a micro-step and an update cost
the cell, and the extra arguments a cell agent needs.

- `EmulatedWork(workload)` (here): each execution makes the workload's n calls (TOKENS_PER_CALL tokens each,
  `call_s` of emulated device time) with `env_s` of environment latency after each; a micro-step costs
  `train_s_per_call` per call of its executions; the cells wait instead of computing.
- `gyre_core.phases.rl_on_cells.HarnessWork`: the run's environment and agent harness, with model calls through
  the router to real cells that decode and train the run's model. It lives with the elastic phase, above
  this package: the scheduler knows work only through this protocol.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .messages import CallRequest
from .workload import Workload

TOKENS_PER_CALL = 8   # emulated calls: tokens generated per call (call_s is spread over them)

# Called once per finished execution: report(burst, items), items = what is now ready to stream, each
# (execution id, payload, behaviour versions of its trainable tokens, the executions it stands for in the
# normaliser, why it is not trained: "" when it is; empty versions: nothing to train).
Report = Callable[[int, list[tuple[str, object, list[int], int, str]]], None]


class Work(Protocol):
    """What a coordinator runs: `steps` bursts (one per policy version), from `first_step` on."""

    mode: str                    # "emulated" or "real": real cells decode and train a model
    steps: int
    first_step: int              # a resumed run starts at its newest published version
    switch_to_train_s: float     # emulated seconds a role switch costs (0 for real cells: they do the work)
    switch_to_rollout_s: float

    def cell_args(self) -> list[str]: ...         # the cell agent's extra command-line arguments

    def burst_size(self, s: int) -> int: ...      # executions in burst s

    def start_burst(self, s: int, router, report: Report) -> list[Callable[[], None]]: ...

    def micro_work(self, ms): ...                 # what a cell gets to compute one micro-step

    def optim_work(self, version: int, n_executions: int, payloads: list): ...   # ... and the core, to apply
    #                                           the update (`payloads`: the step's, for a KL probe)


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
        self.steps, self.first_step = workload.steps, 0
        self.switch_to_train_s, self.switch_to_rollout_s = workload.switch_to_train_s, workload.switch_to_rollout_s
        self.logs: list[ExecutionLog] = []

    def cell_args(self) -> list[str]:
        return ["--mode", "emulated", "--decode-slowdown", repr(self.w.decode_slowdown),
                "--weight-sync-s", repr(self.w.weight_sync_s)]

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
        report(log.burst, [(log.execution_id, n_calls, [v for _, _, vs in log.calls for v in vs], 1, "")])

    def burst_size(self, s: int) -> int:
        return self.w.executions_per_step

    def micro_work(self, ms) -> float:
        return sum(self.w.train_s(n) for n in ms.payloads)

    def optim_work(self, version: int, n_executions: int, payloads: list) -> float:
        return self.w.optimizer_s + self.w.publish_s
