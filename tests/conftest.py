"""Shared test setup: the repo root on sys.path (for `examples.*`), quiet bars, CPU DeepSpeed."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("GYRE_QUIET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on loopback (moto's server mode, as s3fs's own tests use), for the
    whole session: the s3fs storage options that reach it. Each test makes its own bucket or prefix."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(k, v)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield {"anon": False, "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}
        server.stop()
