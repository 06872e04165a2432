"""The recording OpenAI-compatible proxy: any agent harness, unmodified, with exact tokens recorded.

    with open_proxy(cfg, chat, stop_texts, CellPool([engine]), temperature) as (proxy, server):
        keys = proxy.open_execution(record)      # OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY=keys.main
        ...                                      # the harness calls the model; each call lands in record.calls
        proxy.close_execution(record.execution_id)

`pool.py`: where calls are generated — `CellPool`, engines as cells in this process, a call movable between
them mid-call; `RouterPool`, the elastic phase's router to cell agents; `recorder.py`: per execution,
the served contexts and exact prompts; `service.py`: the OpenAI semantics; `server.py`: HTTP.
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def open_proxy(cfg, chat, stop_texts: dict[int, str], pool, temperature: float | None,
               model_name: str = "gyre-policy", admin=None):
    """A proxy generating on `pool` (a `pool.CellPool` or `pool.RouterPool`; stopped when the block ends) with
    the config's `proxy` and `harness` limits, served over HTTP until the block ends. `temperature`: the
    run's (None: each request's, as `proxy.sampling: request`)."""
    from .recorder import Limits
    from .server import ProxyServer
    from .service import Proxy

    p = cfg.proxy
    try:
        proxy = Proxy(chat, stop_texts, pool, p, Limits.of(cfg.harness), model_name=model_name, temperature=temperature)
        server = ProxyServer(proxy, host=p.host, port=p.port, max_request_bytes=p.max_request_bytes, admin=admin).start()
        try:
            yield proxy, server
        finally:
            server.stop()
            proxy.close()
    finally:
        pool.stop()
