"""Token-in/token-out (TITO) records: the one vocabulary every layer shares.

A model call is recorded with the exact prompt and completion token ids the engine saw and produced,
the behaviour log-probs and the policy version of every generated token. Nothing is ever re-tokenised.

In the lake a call's prompt is not stored whole: it is (parent call, shared prefix length, new ids),
where the parent's prompt + completion supplies the first `prefix_len` tokens. Over a long execution
this keeps storage linear instead of quadratic. `CallRecord.prompt_ids` is the full prompt in memory;
`delta()` gives the stored form and `rebuild_prompts()` inverts it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_VERSION = 6      # 2: calls gained tool_call_ids and payload_uri; 3: progress; 4: tool_parse, tool_spans;
#                         5: rerender_drift; 6: executions.evaluator_s
#                         (older lakes still read)

# Roles of a model-call context, highest training priority first (the processor may reorder).
ROLES = ("main", "main-summary", "sub-agent", "sub-agent-summary")

# Execution statuses. Anything but "failed" is trainable and scored on what it left behind.
STATUS_DONE = "done"            # the environment said the episode is over
STATUS_TURN_LIMIT = "turn_limit"
STATUS_TOKEN_LIMIT = "token_limit"
STATUS_TIMEOUT = "timeout"      # optional wall-clock limit (real sandboxes)
STATUS_FAILED = "failed"        # an exception in the environment or harness; reason in `error`
STATUSES = (STATUS_DONE, STATUS_TURN_LIMIT, STATUS_TOKEN_LIMIT, STATUS_TIMEOUT, STATUS_FAILED)


@dataclass(slots=True)
class CallRecord:
    """One model call of one execution."""

    execution_id: str
    call_index: int
    context_index: int            # which conversation of the execution (bumps at compaction)
    role: str                     # one of ROLES
    prompt_ids: list[int]         # the full prompt, exactly as the engine saw it
    completion_ids: list[int]     # exactly as generated (stop token included when it stopped)
    logprobs: list[float]         # behaviour log-prob of each completion token
    versions: list[int]           # policy version that produced each completion token
    finish_reason: str = "stop"   # "stop" (a stop token) or "length" (max_new_tokens)
    parent_call: int = -1         # call whose prompt+completion the prompt extends; -1: none
    prefix_len: int = 0           # how many leading prompt tokens come from the parent
    t_start: float = 0.0
    t_end: float = 0.0
    tool_call_ids: list[str] = field(default_factory=list)   # tool invocations this completion made
    progress: float | None = None  # the env's progress() when the call was made (None: the env has no such hook)
    tool_parse: str = ""          # tool-call parse of the completion: "" (env has no tools), none, ok, malformed
    tool_spans: list[list[int]] = field(default_factory=list)  # [first, end) completion token index per tool call
    rerender_drift: bool | None = None  # proxy calls extending a served context: would re-rendering the request's
    #                                     messages from scratch have given other prompt ids? (None: not measured)

    def delta(self) -> list[int]:
        """Prompt tokens not supplied by the parent (what the lake stores)."""
        return self.prompt_ids[self.prefix_len:]


@dataclass(slots=True)
class ExecutionRecord:
    """One execution (an episode of one task) and its scores."""

    run_id: str
    step: int                     # RL step (-1 warm start demonstrations, -2.. evaluations)
    execution_id: str
    task_id: str                  # executions of one task share it (the group key)
    seed: int                     # environment seed
    split: str                    # "train", "eval", "demo"
    env: str                      # environment name (level)
    status: str = STATUS_DONE
    error: str = ""
    reward: float = 0.0
    success: bool = False
    partial: float = 0.0
    turns: int = 0
    invalid_actions: int = 0
    compactions: int = 0
    policy_version: int = 0       # version at dispatch
    fork_of: str = ""             # a forked continuation: the execution it was copied from
    fork_call: int = 0            # ... and how many of its first calls it shares with that execution
    t_start: float = 0.0
    t_end: float = 0.0            # the last model call or tool (the evaluator's time is evaluator_s)
    evaluator_s: float = 0.0      # the evaluator's wall seconds, retries included
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def tokens_generated(self) -> int:
        """Tokens this execution generated itself (a fork's shared calls count with its parent)."""
        return sum(len(c.completion_ids) for c in self.calls[self.fork_call:])

    @property
    def trainable(self) -> bool:
        return self.status != STATUS_FAILED


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists, by bisection over C-speed slice compares (the
    engine matches a context's cache with every new prompt; the proxy a new context with every served one)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def rebuild_prompts(rows: list[tuple[int, int, list[int], list[int]]]) -> list[list[int]]:
    """Rebuild full prompts from stored (parent_call, prefix_len, delta, completion) rows.

    Rows are indexed by call_index and ordered so a parent precedes its children.
    """
    prompts: list[list[int]] = []
    for parent, prefix_len, delta, _ in rows:
        if parent < 0:
            prefix: list[int] = []
        else:
            p_prompt, p_completion = prompts[parent], rows[parent][3]
            prefix = (p_prompt + list(p_completion))[:prefix_len]
            if len(prefix) != prefix_len:
                raise ValueError(f"prefix_len {prefix_len} exceeds parent call {parent}'s length")
        prompts.append(prefix + list(delta))
    return prompts
