"""The proxy's OpenAI semantics, apart from HTTP: executions and their keys, requests in, responses out.

    proxy = Proxy(chat, stop_texts, pool, ProxyConfig(), limits, model_name="policy", temperature=1.0)   # pool: pool.py
    keys = proxy.open_execution(record)          # keys.main, keys.sub_agent: bearer tokens of this execution
    call = proxy.chat_call(key, role_header, body)   # validated, prompt prepared, job submitted
    ... call.job.future.result() ...                 # (server.py streams call.text deltas meanwhile)
    response = proxy.chat_response(call, result)
    exe = proxy.close_execution(record.execution_id)   # its ExecutionRecord is final

One execution = one capability: a key names one execution (and a role), every call made with it is
recorded there, and an unknown key is refused. Sampling follows `proxy.sampling`: the run's temperature
(what RL trains on) or the request's.
"""
from __future__ import annotations

import hashlib
import json
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..harness.loop import strip_stop
from ..harness.tools import PARSE_OK, parse_tool_calls, token_spans
from .pool import Job, JobResult
from .recorder import Limits, Prepared, ProxyError, ProxyExecution, check_role


@dataclass(slots=True)
class Keys:
    main: str
    sub_agent: str


@dataclass(slots=True)
class Call:
    """One request on its way: what was asked, the prepared prompt, the job generating it."""

    exe: ProxyExecution
    kind: str                   # "chat" | "text"
    prepared: Prepared
    job: Job
    model: str
    stops: list[str]
    tool_names: set[str] | None     # tools the completion may call (None: none offered, or tool_choice none)
    logprobs: bool = False
    ended: bool = False         # `Proxy.end_call` ran: the request no longer counts as in flight
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


class Proxy:
    def __init__(self, chat, stop_texts: dict[int, str], pool, cfg, limits: Limits, *, model_name: str,
                 temperature: float | None) -> None:
        self.chat, self.tok, self.stop_texts, self.pool, self.cfg = chat, chat.tokenizer, stop_texts, pool, cfg
        self.limits, self.model_name, self.temperature = limits, model_name, temperature
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[ProxyExecution, str]] = {}
        self._executions: dict[str, ProxyExecution] = {}
        self._drift: queue.Queue = queue.Queue()
        self._drift_pending: dict[str, int] = {}
        self._drift_done = threading.Condition(self._lock)
        self.calls = 0
        self._drift_thread = None
        if cfg.measure_drift:
            self._drift_thread = threading.Thread(target=self._measure_drift, name="gyre-proxy-drift", daemon=True)
            self._drift_thread.start()

    def close(self) -> None:
        """Stop the drift thread (the pool is its owner's to stop)."""
        if self._drift_thread is not None:
            self._drift.put(None)
            self._drift_thread.join(timeout=30)
            self._drift_thread = None

    # -- executions ---------------------------------------------------------------------------------------
    def open_execution(self, record) -> Keys:
        exe = ProxyExecution(record, self.limits)
        keys = Keys("gyre-" + secrets.token_urlsafe(24), "gyre-" + secrets.token_urlsafe(24))
        with self._lock:
            if record.execution_id in self._executions:
                raise ValueError(f"execution {record.execution_id!r} is already open at the proxy")
            self._executions[record.execution_id] = exe
            self._keys[_digest(keys.main)] = (exe, "main")
            self._keys[_digest(keys.sub_agent)] = (exe, "sub-agent")
        return keys

    def execution(self, execution_id: str) -> ProxyExecution:
        with self._lock:
            return self._executions[execution_id]

    def close_execution(self, execution_id: str, wait_s: float = 30.0) -> ProxyExecution:
        """Refuse the execution's further requests and let go of its calls still generating (they are not
        recorded: the harness that asked is gone), wait for its requests to end and for its drift measures,
        drop its keys and cached contexts; its record is then final."""
        with self._lock:
            exe = self._executions.pop(execution_id)
            for k in [k for k, (e, _) in self._keys.items() if e is exe]:
                del self._keys[k]
        for job in exe.close():
            job.cancelled = True
        deadline = time.time() + wait_s
        while exe.inflight and time.time() < deadline:
            time.sleep(0.01)
        with self._drift_done:
            self._drift_done.wait_for(lambda: not self._drift_pending.get(execution_id), timeout=max(0.0, deadline - time.time()))
            self._drift_pending.pop(execution_id, None)
        for key in exe.context_keys:
            self.pool.release(key)
        exe.record.t_end = time.time()
        return exe

    def authenticate(self, authorization: str | None, api_key_header: str | None = None) -> tuple[ProxyExecution, str]:
        """The execution and role of a request's bearer token (or `x-api-key`); an unknown one is refused."""
        token = None
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        elif api_key_header:
            token = api_key_header.strip()
        if not token:
            raise ProxyError(401, "no API key: send 'Authorization: Bearer <key>' (the key of your execution)",
                             type="authentication_error", code="missing_api_key")
        with self._lock:
            found = self._keys.get(_digest(token))
        if found is not None:
            return found
        raise ProxyError(401, "unknown API key (each execution has its own)", type="authentication_error",
                         code="invalid_api_key")

    # -- requests -----------------------------------------------------------------------------------------
    def chat_call(self, exe: ProxyExecution, key_role: str, declared_role: str | None, body: dict,
                  on_tokens=None) -> Call:
        """Validate a /v1/chat/completions body, prepare its exact prompt and submit it (`exe` admitted)."""
        _check_common(body)
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)):
            raise ProxyError(400, "'tools' must be a list of {type: function, function: {name, ...}}", param="tools")
        choice = body.get("tool_choice", "auto")
        names = {t["function"]["name"] for t in tools} if tools else None
        if choice == "none":
            names = None
        role = check_role(declared_role)
        t0 = time.time()
        p = exe.prepare_chat(self.chat, body.get("messages"), tools, key_role, role)
        p.t_start = t0
        return self._submit(exe, "chat", p, body, names, on_tokens)

    def text_call(self, exe: ProxyExecution, key_role: str, declared_role: str | None, body: dict,
                  on_tokens=None) -> Call:
        """Validate a /v1/completions body, prepare its prompt and submit it."""
        _check_common(body)
        if body.get("echo") or body.get("suffix") is not None or (body.get("best_of") or 1) != 1:
            raise ProxyError(400, "echo, suffix and best_of are not supported")
        t0 = time.time()
        p = exe.prepare_text(self.tok, body.get("prompt"), key_role, check_role(declared_role))
        p.t_start = t0
        return self._submit(exe, "text", p, body, None, on_tokens)

    def _submit(self, exe: ProxyExecution, kind: str, p: Prepared, body: dict, names, on_tokens) -> Call:
        lim = self.limits
        room = lim.context_tokens - len(p.prompt_ids)
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise ProxyError(400, "max_tokens must be a positive integer", param="max_tokens")
        if room < 1:
            raise ProxyError(400, f"this model's context is {lim.context_tokens} tokens; the messages are "
                             f"{len(p.prompt_ids)}", code="context_length_exceeded", param="messages")
        max_new = min(asked or lim.max_new_tokens, lim.max_new_tokens, room)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise ProxyError(400, "'stop' must be a string or up to 4 non-empty strings", param="stop")
        temperature = self._temperature(body)
        job = Job("", p.prompt_ids, max_new, temperature, on_tokens=on_tokens,
                  stop_at=self._stop_at(stops) if stops else None, owner=exe.record.execution_id,
                  request={"messages": p.messages, "tools": p.tools} if kind == "chat" else None)
        call = Call(exe, kind, p, job, body.get("model") or self.model_name, stops, names,
                    logprobs=bool(body.get("logprobs")))
        exe.commit(p, job)                 # everything checked: a new context gets its index and role now
        job.key = f"{exe.record.execution_id}/c{p.context_index}"
        try:
            self.pool.submit(job)
        except BaseException:
            exe.done(job)
            raise
        return call

    def end_call(self, call: Call) -> None:
        """The request is over (answered, failed, or its client gone): it no longer counts as in flight, and a
        call still generating is let go. Idempotent."""
        if call.ended:
            return
        call.ended = True
        if not call.job.future.done():
            call.job.cancelled = True
        call.exe.done(call.job)
        call.exe.leave()

    def _temperature(self, body: dict) -> float:
        if self.cfg.sampling == "run" and self.temperature is not None:
            return self.temperature
        t = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 2:
            raise ProxyError(400, "temperature must be a number in [0, 2]", param="temperature")
        if top_p is not None and top_p != 1:
            raise ProxyError(400, "top_p < 1 is not supported: Gyre samples (and trains on) the full "
                             "distribution; use temperature", param="top_p")
        return float(t)

    def _stop_at(self, stops: list[str]):
        def holds(ids: list[int]) -> bool:
            text = self._text(ids)
            return any(s in text for s in stops)

        def stop_at(ids: list[int]) -> int | None:
            if not holds(ids):
                return None
            lo, hi = 1, len(ids)                 # the fewest tokens whose text holds a stop string (bisection)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if holds(ids[:mid]) else (mid + 1, hi)
            return lo
        return stop_at

    # -- responses ----------------------------------------------------------------------------------------
    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(strip_stop(ids, self.stop_texts), skip_special_tokens=False)

    def visible_text(self, call: Call, ids: list[int], final: bool) -> str:
        """The completion's text a client may be shown so far: cut at a stop string; while generating, short
        of anything that may still turn out to be a stop string, a tool call or half a character."""
        text = self._text(ids)
        cut = min((text.index(s) for s in call.stops if s in text), default=len(text))
        text = text[:cut]
        if call.tool_names is not None and "<tool_call>" in text:
            text = text[:text.index("<tool_call>")]
        if final:
            return text
        hold = max((len(s) - 1 for s in call.stops), default=0)
        if call.tool_names is not None:
            hold = max(hold, len("<tool_call>") - 1)
        for n in range(min(hold, len(text)), 0, -1):   # a tail that may begin a stop string or a tool call
            tail = text[-n:]
            if any(s.startswith(tail) for s in call.stops) or (call.tool_names is not None and "<tool_call>".startswith(tail)):
                text = text[:-n]
                break
        return text.rstrip("\ufffd")

    def finish(self, call: Call, result: JobResult) -> dict:
        """Record the finished call; the assistant message (or text) and finish reason to answer with."""
        ids = result.ids
        stopped_on = self.stop_texts.get(ids[-1]) if ids and result.finish_reason == "stop" else None
        full = self._text(ids)
        cut = min((full.index(s) for s in call.stops if s in full), default=len(full))
        text = full[:cut]
        tool_calls, tool_parse, spans, content, finish = [], "", [], text, result.finish_reason
        if call.tool_names is not None:
            parsed = parse_tool_calls(text, call.tool_names)
            tool_parse = parsed.status
            if parsed.status == PARSE_OK:
                spans = token_spans(self.tok, strip_stop(ids, self.stop_texts), [c.span for c in parsed.calls])
                tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                              for c in parsed.calls]
                content = text[:parsed.calls[0].span[0]].strip() or None
                finish = "tool_calls"
        exe = call.exe
        record = exe.complete(call.prepared, ids, result.logprobs, result.versions, result.finish_reason, stopped_on,
                              content or "", [t["id"] for t in tool_calls], tool_parse, spans,
                              self.tok.decode(call.prepared.prompt_ids + ids, skip_special_tokens=False)
                              if call.kind == "text" else "")
        with self._lock:
            self.calls += 1
        if self.cfg.measure_drift and call.prepared.extends and call.prepared.messages is not None:
            with self._lock:
                self._drift_pending[exe.record.execution_id] = self._drift_pending.get(exe.record.execution_id, 0) + 1
            self._drift.put((exe, record, call.prepared.messages, call.prepared.tools))
        out = {"content": content, "tool_calls": tool_calls, "finish_reason": finish, "text": text,
               "usage": {"prompt_tokens": len(call.prepared.prompt_ids), "completion_tokens": len(ids),
                         "total_tokens": len(call.prepared.prompt_ids) + len(ids)}}
        if call.logprobs:
            out["logprobs"] = {"content": [{"token": self.tok.decode([i], skip_special_tokens=False), "logprob": lp,
                                            "bytes": list(self.tok.decode([i], skip_special_tokens=False).encode()),
                                            "top_logprobs": []} for i, lp in zip(ids, result.logprobs)]}
        return out

    def chat_response(self, call: Call, done: dict) -> dict:
        msg = {"role": "assistant", "content": done["content"]}
        if done["tool_calls"]:
            msg["tool_calls"] = done["tool_calls"]
        choice = {"index": 0, "message": msg, "finish_reason": done["finish_reason"], "logprobs": done.get("logprobs")}
        return {"id": f"chatcmpl-{call.id}", "object": "chat.completion", "created": call.created, "model": call.model,
                "choices": [choice], "usage": done["usage"]}

    def text_response(self, call: Call, done: dict) -> dict:
        choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"], "logprobs": None}
        return {"id": f"cmpl-{call.id}", "object": "text_completion", "created": call.created, "model": call.model,
                "choices": [choice], "usage": done["usage"]}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "gyre"}]}

    # -- the drift a naive re-render would have had --------------------------------------------------------
    def _measure_drift(self) -> None:
        while (item := self._drift.get()) is not None:
            exe, record, messages, tools = item
            try:
                exe.note_drift(record, self.chat.render(messages, tools))
            except Exception:  # noqa: BLE001 - a measure, never a failure of the call
                pass
            with self._drift_done:
                eid = exe.record.execution_id
                if eid in self._drift_pending:      # (an execution closed meanwhile has no entry left)
                    self._drift_pending[eid] -= 1
                self._drift_done.notify_all()


def _digest(key: str) -> bytes:
    """Keys are held as digests: found in one lookup, never kept or logged as text."""
    return hashlib.sha256(key.encode()).digest()


def _check_common(body: dict) -> None:
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object")
    if (body.get("n") or 1) != 1:
        raise ProxyError(400, "n > 1 is not supported: send one request per sample", param="n")
