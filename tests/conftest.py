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


# -- the fault table's figures (docs/faults.md, `gyre bench faults`) ------------------------------------
class FaultLedger:
    """Executions lost or duplicated, as the fault tests count them in the lake."""

    def __init__(self) -> None:
        self.lost = self.duplicated = 0

    def record(self, lost: int, duplicated: int) -> None:
        self.lost += lost
        self.duplicated += duplicated


_LEDGER = FaultLedger()


@pytest.fixture
def fault_ledger() -> FaultLedger:
    return _LEDGER


def _tally(terminalreporter) -> dict:
    """faults_tried / faults_survived (items marked `fault`), bad_inputs_tried / bad_inputs_refused (items
    marked `bad_input`), and the ledger's executions_lost / executions_duplicated."""
    out = {"faults_tried": 0, "faults_survived": 0, "bad_inputs_tried": 0, "bad_inputs_refused": 0}
    for outcome in ("passed", "failed", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if getattr(rep, "when", "call") != "call" and outcome == "passed":
                continue
            kinds = getattr(rep, "gyre_kinds", ())
            for kind, tried, ok in (("fault", "faults_tried", "faults_survived"),
                                    ("bad_input", "bad_inputs_tried", "bad_inputs_refused")):
                if kind in kinds:
                    out[tried] += 1
                    out[ok] += outcome == "passed"
    out.update(executions_lost=_LEDGER.lost, executions_duplicated=_LEDGER.duplicated)
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.gyre_kinds = tuple(k for k in ("fault", "bad_input") if item.get_closest_marker(k) is not None)


def pytest_terminal_summary(terminalreporter):
    tally = _tally(terminalreporter)
    if tally["faults_tried"] or tally["bad_inputs_tried"]:
        terminalreporter.write_line("gyre faults: " + ", ".join(f"{k} {v}" for k, v in tally.items()))
    if os.environ.get("GYRE_FAULT_SUMMARY"):
        import json

        Path(os.environ["GYRE_FAULT_SUMMARY"]).write_text(json.dumps(tally, indent=1))
