"""`gyre proxy`: the recording proxy on its own, in front of a model, for agents run by hand or by another
system. Executions are opened and ended over HTTP with the admin token; each ended execution is written to
the lake (run `proxy.run`, one part per execution), scored with what the caller says.

    gyre proxy --set model.path=data/models/SmolLM2-135M-Instruct [--set engine.kind=vllm] [--name NAME]

    POST /gyre/executions            {"task_id": "t1"}            -> {"execution_id", "api_key", "sub_agent_api_key", "base_url"}
    POST /gyre/executions/{id}/end   {"reward": 1.0, "success": true}   -> the execution's summary (written to the lake)
    GET  /gyre/executions[/{id}]                                   -> open executions / one's summary

Errors are the proxy's OpenAI-style JSON; the admin token is compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
import itertools
import threading
import time

from ..records import STATUS_DONE, STATUSES, ExecutionRecord
from .recorder import ProxyError


class StandaloneAdmin:
    def __init__(self, token: str, run_id: str, lake) -> None:
        self.token, self.run_id, self.lake = token, run_id, lake
        self.proxy = None        # set once the proxy exists
        self.base_url = ""
        self._seq = itertools.count(len(lake.parts(run_id)) if lake is not None else 0)
        self._lock = threading.Lock()
        self._open: dict[str, ExecutionRecord] = {}
        self._ended: dict = {}        # closed at the proxy, its lake write failed: (record, its ProxyExecution)

    def authorized(self, authorization: str | None) -> bool:
        given = authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " else ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def open(self, body: dict) -> dict:
        task_id = body.get("task_id", "task")
        if not isinstance(task_id, str) or not task_id:
            raise ProxyError(400, "task_id must be a non-empty string", param="task_id")
        with self._lock:
            n = next(self._seq)
        rec = ExecutionRecord(run_id=self.run_id, step=0, execution_id=f"{self.run_id}/x{n:06d}", task_id=task_id,
                              seed=n, split=str(body.get("split", "proxy")), env=str(body.get("env", "external")),
                              t_start=time.time())
        keys = self.proxy.open_execution(rec)
        with self._lock:
            self._open[rec.execution_id] = rec
        return {"execution_id": rec.execution_id, "api_key": keys.main, "sub_agent_api_key": keys.sub_agent,
                "base_url": self.base_url}

    def list(self) -> list[dict]:
        with self._lock:
            return [_summary(r) for r in self._open.values()]

    def show(self, execution_id: str) -> dict:
        with self._lock:
            rec = self._open.get(execution_id)
        if rec is None:
            raise ProxyError(404, f"no open execution {execution_id!r}", type="not_found_error")
        return _summary(rec)

    def end(self, execution_id: str, body: dict) -> dict:
        """Close the execution with the caller's scores and write it to the lake. A bad body changes nothing;
        a failed write leaves it to be ended again (its calls are kept)."""
        status, reward, success, partial = _scores(body)
        with self._lock:
            rec = self._open.pop(execution_id, None)
            ended = self._ended.pop(execution_id, None)     # closed before, its write failed
        if rec is None and ended is None:
            raise ProxyError(404, f"no open execution {execution_id!r}", type="not_found_error")
        rec, exe = ended if ended is not None else (rec, self.proxy.close_execution(execution_id))
        rec.status, rec.reward, rec.success, rec.partial = status, reward, success, partial
        rec.compactions = exe.summary_contexts()
        rec.error = str(body.get("error", ""))[:2000]
        if self.lake is not None:
            from ..lake.schema import calls_table, executions_table

            part = f"proxy-{execution_id.rsplit('/x', 1)[1]}"
            try:
                self.lake.write_part(self.run_id, part, {"executions": executions_table([rec]),
                                                         "calls": calls_table([rec])})
            except Exception as exc:
                with self._lock:
                    self._ended[execution_id] = (rec, exe)
                raise ProxyError(500, f"could not write the execution to the lake ({type(exc).__name__}); end it "
                                 "again to retry", type="server_error", code="lake_write_failed") from None
        return {**_summary(rec), "drift_prevented": exe.drift_prevented, "written": self.lake is not None}


def _scores(body: dict) -> tuple[str, float, bool, float]:
    """(status, reward, success, partial) from an /end body, each checked."""
    status = body.get("status", STATUS_DONE)
    if status not in STATUSES:
        raise ProxyError(400, f"status must be one of {', '.join(STATUSES)}", param="status")
    reward, success = body.get("reward", 0.0), body.get("success", False)
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise ProxyError(400, "reward must be a number", param="reward")
    if not isinstance(success, bool):
        raise ProxyError(400, "success must be true or false", param="success")
    partial = body.get("partial", 1.0 if success else 0.0)
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0.0 <= partial <= 1.0:
        raise ProxyError(400, "partial must be a number in [0, 1]", param="partial")
    return status, float(reward), success, float(partial)


def _summary(rec: ExecutionRecord) -> dict:
    return {"execution_id": rec.execution_id, "task_id": rec.task_id, "status": rec.status, "calls": len(rec.calls),
            "tokens_generated": rec.tokens_generated, "contexts": len({c.context_index for c in rec.calls}),
            "roles": sorted({c.role for c in rec.calls})}


def serve(cfg, run_id: str, stop: threading.Event, ready=None) -> None:
    """Serve the config's model through the proxy until `stop` is set (`ready(server, admin)` once it listens)."""
    import secrets

    from ..config import gyre_home
    from ..lake import Lake
    from ..model import load_policy
    from ..phases.run_objects import PolicyBundle, served_model_name
    from . import open_proxy
    from .pool import CellPool

    if not cfg.model.path:
        raise ValueError("gyre proxy serves a model directory: set model.path (e.g. --set model.path=DIR)")
    device = "cpu" if cfg.engine.kind == "vllm" else cfg.model.device
    model, tok = load_policy(cfg.model.path, device=device)
    bundle = PolicyBundle.of(model, tok, cfg.run.seed, version=0, engine_cfg=cfg.engine, model_dir=cfg.model.path)
    lake = Lake.from_config(cfg.lake)
    lake.check_writable(home=str(gyre_home()))
    admin = StandaloneAdmin(cfg.proxy.admin_token or secrets.token_urlsafe(24), run_id, lake)
    temperature = cfg.rollout.temperature if cfg.proxy.sampling == "run" else None
    try:
        with open_proxy(cfg, bundle.chat, bundle.stop_texts, CellPool([bundle.engine], cfg.proxy.chunk_tokens),
                        temperature, served_model_name(cfg), admin=admin) as (proxy, server):
            admin.proxy, admin.base_url = proxy, server.base_url
            if ready is not None:
                ready(server, admin)
            stop.wait()
    finally:
        if hasattr(bundle._engine, "close"):
            bundle._engine.close()
