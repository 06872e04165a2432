"""What the coordinator and its cell agents say to each other: one typed record per message.

    conn.send(Gen(call_id, CallRequest(key, prompt_ids, 8)))       # coordinator -> a rollout cell
    match conn.recv():
        case Done(call_id, ids, logprobs, versions, reason): ...   # the cell's answer

The records travel pickled over `multiprocessing.connection` (slotted dataclasses pickle as they are), so
both sides dispatch on the class (`match` / `isinstance`), never on a position in a tuple. The last
three records here never leave the coordinator: its reader, writer and harness threads put them on its
event queue next to the cells' own messages.

To a cell (the agent answers where noted):
- `Gen`: start a model call (rollout role only); answered by `Done`.
- `Cancel`: stop a call now; `Done` with the tokens made so far, reason "cancelled".
- `Role`: drain and take the role; `RoleDone`.
- `Micro`: compute one streamed micro-step (train role); `MicroDone`.
- `Grads`: to the core: a satellite's gradient for this step (the arrays channel).
- `Reduce`: to a satellite in the prefix [0, t): sum its gradient (or zeros) onto the core.
- `Optim`: to the core: reduce over [0, t) (t > 1), apply the update, publish version + 1; `OptimDone`, or
  `OptimFailed` when the reduce failed.
- `UseArrays`: stop using the process groups (a cell was lost): drop the gradient held here and from now
  on hand each micro-step's gradient over as arrays.
- `Weights`: a newer policy was published (read it at the next call / micro-step).
- `Release`: the harness is done with a context: drop its K/V cache.
- `BecomeCore`: this cell now holds the optimizer (the old core was lost).
- `Stop`.

From a cell: `Hello` once, on connecting; `Beat` every `agent.HEARTBEAT_S`; the answers above.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CallRequest:
    """A model call as the router sends it (a continuation after a reroute carries the tokens so far)."""

    key: str                     # the live context (KV-cache key)
    prompt_ids: list[int]        # full prompt, plus the tokens already generated on another cell
    max_new_tokens: int          # what is left to generate
    temperature: float = 1.0
    token_s: float = 0.0         # emulated device seconds per token (ignored by real devices)


# -- coordinator -> cell ---------------------------------------------------------------------------
@dataclass(slots=True)
class Gen:
    call_id: int
    request: CallRequest


@dataclass(slots=True)
class Cancel:
    call_id: int


@dataclass(slots=True)
class Role:
    role: str                    # rollout | train
    switch_s: float              # emulated seconds the switch costs (real cells do the work instead)


@dataclass(slots=True)
class Micro:
    ms_id: int
    work: object                 # `Work.micro_work`: emulated seconds, or the micro-step to train


@dataclass(slots=True)
class Grads:
    grads: dict                  # parameter name -> numpy array


@dataclass(slots=True)
class Reduce:
    version: int
    t: int                       # the prefix of cells whose gradients are summed


@dataclass(slots=True)
class Optim:
    version: int                 # the weights trained from: the core publishes version + 1
    work: object                 # `Work.optim_work`: emulated seconds, or the executions trained
    t: int = 1


@dataclass(slots=True)
class UseArrays:
    pass


@dataclass(slots=True)
class Weights:
    version: int


@dataclass(slots=True)
class Release:
    key: str


@dataclass(slots=True)
class BecomeCore:
    pass


@dataclass(slots=True)
class Stop:
    pass


# -- cell -> coordinator ---------------------------------------------------------------------------
@dataclass(slots=True)
class Hello:
    cell: int
    pid: int
    device: str                  # what it computes on: "emulated", "real/cuda:0", ...


@dataclass(slots=True)
class Beat:
    t: float                     # the agent's wall clock
    busy_s: float = 0.0          # how long its main loop has been inside its current piece of work


@dataclass(slots=True)
class Done:
    call_id: int
    ids: list[int]
    logprobs: list[float]
    versions: list[int]          # per token
    reason: str                  # stop | length | cancelled


@dataclass(slots=True)
class RoleDone:
    role: str
    seconds: float


@dataclass(slots=True)
class MicroDone:
    ms_id: int
    seconds: float
    grads: dict | None           # a satellite's gradient as arrays; None: kept on the cell (or none)
    stats: dict                  # training statistics, summed by the coordinator per version


@dataclass(slots=True)
class OptimDone:
    version: int                 # the version just published
    seconds: float
    reduce_s: float | None = None   # the core's wait in the reduce (None: no reduce)
    stats: dict | None = None       # the KL guard's: kl, kl_backtracks, lr (None: no guard)


@dataclass(slots=True)
class OptimFailed:
    version: int                 # the weights it trained from: nothing was published
    why: str


# -- the coordinator's own events (never sent over a connection) -------------------------------------
@dataclass(slots=True)
class CellLost:
    why: str                     # its connection dropped, or it is stuck in one piece of work


@dataclass(slots=True)
class RunError:
    message: str                 # a harness thread or a landing failed: the run stops with it


@dataclass(slots=True)
class ExecutionFinished:
    burst: int
    items: list                  # `work.Report`'s items: (execution id, payload, versions, count, why not)


ToCell = Gen | Cancel | Role | Micro | Grads | Reduce | Optim | UseArrays | Weights | Release | BecomeCore | Stop
FromCell = Hello | Beat | Done | RoleDone | MicroDone | OptimDone | OptimFailed
