"""What the proxy keeps of one execution: every context it served, as exact ids, and the record.

    exe = ProxyExecution(record, limits)
    p = exe.prepare_chat(chat, messages, tools, role)     # the prompt: exact ids + only the new messages
    call = exe.complete(p, result, reply, ...)             # -> CallRecord (appended to exe.record.calls)

**Token fidelity.** A harness sends its whole history on every request; re-rendering it would re-tokenise
text the model generated (and the template rewrites tool calls in its own JSON spacing), so the prompt
would drift from the tokens that were sampled and scored. Instead each served call is kept as a context:
its request messages and its reply, chained into one hash per message prefix, mapped to the exact ids
(prompt + completion as generated). A request is matched message by message against those chains; the
longest served context it extends is reused as its ids and only the messages after it are rendered
(`ChatFormat.after_assistant`). An assistant message with tool calls is recognised by its tool-call ids
(the proxy issued them), whatever the harness did to its text; one without by its text (trimmed).

**Contexts and roles.** A request that extends a served context continues that context. One that does not
(the first call, the harness's own compaction, a sub-agent with a fresh history) opens a new context; its
prompt is recorded against the earlier call it shares the most leading tokens with (`parent_call`,
`prefix_len`), so the processor's trees form from what the harness actually did. Its role: the one the
request declares (`X-Gyre-Role`); else that of the earlier call whose request messages it starts with,
continued otherwise than by that call's reply (a retry after a format error, an edited answer: a branch of
that context); else the key's (`main`, or
`sub-agent` for the sub-agent key), made a `-summary` role when an earlier context of that role began with
the same first message (a restart of the same agent from a summary: compaction).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass

from ..harness.conversation import message_text
from ..records import (ROLES, STATUS_TIMEOUT, STATUS_TOKEN_LIMIT, STATUS_TURN_LIMIT, CallRecord, ExecutionRecord,
                       common_prefix)


class ProxyError(Exception):
    """A request the proxy refuses: an OpenAI-style error (HTTP status, message, type, code, param)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class Limits:
    max_calls: int              # model calls of one execution
    max_tokens: int             # prompt tokens new to each call + completions, over the execution
    context_tokens: int         # prompt + completion of one call
    max_new_tokens: int         # longest completion (a request's max_tokens is capped to it)
    wall_clock_s: float | None = None

    @classmethod
    def of(cls, harness) -> "Limits":
        return cls(harness.max_turns, harness.max_execution_tokens, harness.context_tokens, harness.max_new_tokens,
                   harness.wall_clock_s)


@dataclass(slots=True)
class Served:
    """A finished call, as a context later requests may extend."""

    call_index: int
    context_index: int
    role: str
    ids: list[int]              # prompt + completion, exactly as served
    stopped_on: str | None      # text of the stop token the completion ended with (None: it did not)
    first: str                  # the context's first message, canonical (compaction is recognised by it)
    text: str = ""              # decoded ids (for /v1/completions prompts given as text)


@dataclass(slots=True)
class Prepared:
    prompt_ids: list[int]
    context_index: int
    role: str
    parent_call: int
    prefix_len: int
    first: str
    extends: bool               # continues a served context (only new messages were rendered)
    messages: list[dict] | None = None   # chat requests: to measure the drift a naive re-render would have had
    tools: list[dict] | None = None
    chain: list[bytes] | None = None     # hash of each message prefix of the request
    t_start: float = 0.0
    declared: bool = False               # the role was declared by the request (X-Gyre-Role)


def _canonical(msg: dict, known_tool_calls: dict[str, int]) -> str:
    """A message as one string that is equal exactly when the message counts as the same (fields length-prefixed;
    built without JSON: this runs for every message of every request)."""
    role = msg.get("role")
    if not isinstance(role, str):
        raise ProxyError(400, "each message needs a string 'role'", param="messages")
    content = msg.get("content")
    try:
        text = content if type(content) is str else message_text(content)
    except ValueError as exc:
        raise ProxyError(400, str(exc), param="messages") from None
    if role == "assistant":
        calls = msg.get("tool_calls") or ()
        ids = [c.get("id") for c in calls if isinstance(c, dict)]
        if calls and all(i in known_tool_calls for i in ids):
            return _fields("assistant-calls", *ids)
        fns = [repr(((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")))
               for c in calls if isinstance(c, dict)]
        return _fields("assistant", text.strip(), *fns)
    if role == "tool":
        return _fields("tool", str(msg.get("tool_call_id")), text)
    return _fields(role, str(msg.get("name")), text)


def _fields(*parts: str) -> str:
    return "".join(f"{len(x)}:{x}" for x in parts)


def reply_canonical(content: str, tool_call_ids: list[str]) -> str:
    """The canonical form of the assistant message the proxy answered with (as `_canonical` reads it back)."""
    if tool_call_ids:
        return _fields("assistant-calls", *tool_call_ids)
    return _fields("assistant", content.strip())


def _chain(seed: str, canon: list[str]) -> list[bytes]:
    h, out = hashlib.blake2b(seed.encode(), digest_size=16).digest(), []
    for c in canon:
        h = hashlib.blake2b(h + c.encode(), digest_size=16).digest()
        out.append(h)
    return out


class ProxyExecution:
    """One execution's capability at the proxy: its keys, its served contexts, its record."""

    def __init__(self, record: ExecutionRecord, limits: Limits) -> None:
        self.record, self.limits = record, limits
        self.lock = threading.Lock()
        self.inflight = 0
        self.jobs: set = set()                   # its calls being generated (let go when it ends)
        self.tokens_used = 0
        self.limit_status: str | None = None    # the limit it hit (the runner ends the harness)
        self.closed = False
        self._served: dict[bytes, Served] = {}   # chain hash of request messages + reply -> the call
        self._requests: dict[bytes, Served] = {}  # chain hash of a call's request messages -> the call
        self._by_call: dict[int, Served] = {}
        self._tool_calls: dict[str, int] = {}    # tool-call id issued -> call index
        self._contexts: list[tuple[str, str]] = []   # context index -> (role, first message)
        self.drift_prevented = 0                 # calls whose naive re-render would have had other ids
        self.drift_measured = 0
        self.context_keys: set[str] = set()

    # -- admission --------------------------------------------------------------------------------------
    def admit(self, max_inflight: int) -> None:
        """Count a request in, or refuse it: a limit hit, too many in flight, the execution over."""
        with self.lock:
            if self.closed:
                raise ProxyError(400, "this execution has ended", code="execution_ended")
            self._check_limits()
            if self.inflight >= max_inflight:
                raise ProxyError(429, f"more than {max_inflight} requests in flight for this execution",
                                 type="rate_limit_error", code="concurrency_limit")
            self.inflight += 1

    def leave(self) -> None:
        with self.lock:
            self.inflight -= 1

    def close(self) -> list:
        """Refuse further requests and calls; its jobs still generating, to be let go."""
        with self.lock:
            self.closed = True
            jobs, self.jobs = list(self.jobs), set()
        return jobs

    def _check_limits(self) -> None:
        lim, rec = self.limits, self.record
        if self.limit_status is None:
            if len(rec.calls) >= lim.max_calls:
                self.limit_status = STATUS_TURN_LIMIT
            elif self.tokens_used >= lim.max_tokens:
                self.limit_status = STATUS_TOKEN_LIMIT
            elif lim.wall_clock_s is not None and time.time() - rec.t_start > lim.wall_clock_s:
                self.limit_status = STATUS_TIMEOUT
        if self.limit_status is not None:
            what = {STATUS_TURN_LIMIT: f"{lim.max_calls} model calls", STATUS_TOKEN_LIMIT: f"{lim.max_tokens} tokens",
                    STATUS_TIMEOUT: f"{lim.wall_clock_s} s"}[self.limit_status]
            raise ProxyError(400, f"this execution reached its limit of {what}", code="execution_limit")

    # -- prompts ----------------------------------------------------------------------------------------
    def prepare_chat(self, chat, messages: list[dict], tools: list[dict] | None, key_role: str,
                     declared_role: str | None) -> Prepared:
        """The exact prompt of a chat request (see the module's text)."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ProxyError(400, "'messages' must be a non-empty list of message objects", param="messages")
        seed = json.dumps(tools, sort_keys=True) if tools else ""
        with self.lock:
            canon = [_canonical(m, self._tool_calls) for m in messages]
            chain = _chain(seed, canon)
            match = next(((k, self._served[chain[k - 1]]) for k in range(len(messages), 0, -1)
                          if chain[k - 1] in self._served), None)
        try:
            if match is not None:
                k, served = match
                ids = served.ids + chat.after_assistant(messages[k:], served.stopped_on, tools)
                return Prepared(ids, served.context_index, served.role, served.call_index, len(served.ids),
                                served.first, True, messages, tools, chain)
            ids = chat.render(messages, tools)
        except ProxyError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template refused these messages
            raise ProxyError(400, f"the model's chat template cannot render these messages: {exc}",
                             param="messages") from None
        return self._fresh(ids, canon[0], key_role, declared_role, messages, tools, chain)

    def prepare_text(self, tokenizer, prompt, key_role: str, declared_role: str | None) -> Prepared:
        """The exact prompt of a /v1/completions request: token ids as given, or text — whose longest
        leading part that is the text of a served context reuses that context's ids."""
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
            if max(ids) >= len(tokenizer) or min(ids) < 0:
                raise ProxyError(400, f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt")
        elif isinstance(prompt, str) and prompt:
            with self.lock:
                best = max((s for s in self._by_call.values() if s.text and prompt.startswith(s.text)),
                           key=lambda s: len(s.text), default=None)
            if best is not None:
                ids = best.ids + list(tokenizer.encode(prompt[len(best.text):], add_special_tokens=False))
            else:
                ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            raise ProxyError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")
        if not ids:
            raise ProxyError(400, "the prompt has no tokens", param="prompt")
        with self.lock:
            parent = max(self._by_call.values(), key=lambda s: common_prefix(s.ids, ids), default=None)
        if parent is not None and ids[:len(parent.ids)] == parent.ids:   # it extends that context
            return Prepared(ids, parent.context_index, parent.role, parent.call_index, len(parent.ids), parent.first,
                            True)
        return self._fresh(ids, _fields("prompt", *map(str, ids[:64])), key_role, declared_role, None, None, None)

    def _fresh(self, ids, first, key_role, declared_role, messages, tools, chain) -> Prepared:
        """A new context's prompt; its index and role are given when it is submitted (`commit`), so a refused
        request leaves no context behind."""
        with self.lock:
            parent = max(self._by_call.values(), key=lambda s: common_prefix(s.ids, ids), default=None)
            shared = common_prefix(parent.ids, ids) if parent is not None else 0
        p = Prepared(ids, -1, declared_role or key_role, parent.call_index if shared else -1, shared, first, False,
                     messages, tools, chain)
        p.declared = declared_role is not None
        if not p.declared and chain is not None:
            with self.lock:
                asked = next((self._requests[h] for h in reversed(chain[:-1]) if h in self._requests), None)
            if asked is not None:
                # the messages of an earlier request, then others instead of its reply (a retry after a format
                # error, an edited answer): a branch of that context, in its role
                p.role, p.declared = asked.role, True
        return p

    def commit(self, p: Prepared, job) -> None:
        """The request is going to the engine: a new context gets its index and role (the declared one, or the
        key's, `-summary` when an earlier context of that role began with the same first message), and the
        job is the execution's until it finishes."""
        with self.lock:
            if self.closed:
                raise ProxyError(400, "this execution has ended", code="execution_ended")
            if p.context_index < 0:
                if not p.declared and any(r.split("-summary")[0] == p.role and f == p.first for r, f in self._contexts):
                    p.role = f"{p.role}-summary"
                p.context_index = len(self._contexts)
                self._contexts.append((p.role, p.first))
            self.jobs.add(job)
            self.context_keys.add(f"{self.record.execution_id}/c{p.context_index}")

    # -- the finished call ------------------------------------------------------------------------------
    def complete(self, p: Prepared, ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str,
                 stopped_on: str | None, reply: str, tool_call_ids: list[str], tool_parse: str,
                 tool_spans: list[list[int]], text: str) -> CallRecord:
        """Record the call and keep it as a context later requests may extend (`reply`: the canonical
        assistant message it answered with). An execution that has ended records nothing more."""
        with self.lock:
            if self.closed:
                raise ProxyError(400, "this execution has ended", code="execution_ended")
            rec = self.record
            call = CallRecord(
                execution_id=rec.execution_id, call_index=len(rec.calls), context_index=p.context_index,
                role=p.role, prompt_ids=p.prompt_ids, completion_ids=list(ids), logprobs=list(logprobs),
                versions=list(versions), finish_reason=finish_reason, parent_call=p.parent_call,
                prefix_len=p.prefix_len, t_start=p.t_start, t_end=time.time(), tool_call_ids=list(tool_call_ids),
                tool_parse=tool_parse, tool_spans=tool_spans)
            rec.calls.append(call)
            rec.turns += 1
            self.tokens_used += len(p.prompt_ids) - p.prefix_len + len(ids)
            served = Served(call.call_index, p.context_index, p.role, p.prompt_ids + list(ids), stopped_on, p.first,
                            text)
            self._by_call[call.call_index] = served
            for tid in tool_call_ids:
                self._tool_calls[tid] = call.call_index
            if p.chain is not None:
                self._requests[p.chain[-1]] = served
                canon_reply = reply_canonical(reply, tool_call_ids)
                last = p.chain[-1] if p.chain else b""
                self._served[hashlib.blake2b(last + canon_reply.encode(), digest_size=16).digest()] = served
        return call

    def done(self, job) -> None:
        with self.lock:
            self.jobs.discard(job)

    def note_drift(self, call: CallRecord, naive_ids: list[int]) -> None:
        """The ids a from-scratch render of the call's messages would have had (measured off the request path)."""
        with self.lock:
            call.rerender_drift = naive_ids != call.prompt_ids
            self.drift_measured += 1
            self.drift_prevented += call.rerender_drift

    def summary_contexts(self) -> int:
        return sum(r.endswith("-summary") for r, _ in self._contexts)


def check_role(role: str | None) -> str | None:
    if role is None or role == "":
        return None
    if role not in ROLES:
        raise ProxyError(400, f"X-Gyre-Role {role!r}: use one of {', '.join(ROLES)}", param="X-Gyre-Role")
    return role
