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
