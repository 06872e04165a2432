"""Progress bars for long phases. One bar per phase, on stderr, quiet when GYRE_QUIET=1.

On a terminal it is a live bar. When stderr is a file or a pipe (a log, a batch job) a live bar shows
nothing until the phase ends, so it is a plain line instead — at the start, then at most every
`GYRE_PROGRESS_EVERY_S` seconds (30) as it advances, and at the end:

    rollout: 12/64 (26 s) reward=0.31
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager


def _info(figures: dict) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())


@contextmanager
def phase(description: str, total: int):
    """`with phase("rollout", n) as tick: ... tick()` — advances a bar; tick(loss=0.3) shows a figure;
    tick(completed=x) sets the bar's position (e.g. seconds spent of a time budget)."""
    if os.environ.get("GYRE_QUIET") == "1" or total <= 0:
        yield lambda **kw: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        with _lines(description, total) as tick:
            yield tick
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"))
    with Progress(*cols, console=console, transient=False) as bar:
        task = bar.add_task(description, total=total, info="")

        def tick(completed: float | None = None, **figures):
            move = {"advance": 1} if completed is None else {"completed": min(completed, total)}
            bar.update(task, **move, **({"info": _info(figures)} if figures else {}))

        yield tick


@contextmanager
def _lines(description: str, total: int):
    every = float(os.environ.get("GYRE_PROGRESS_EVERY_S", "30"))
    t0 = time.monotonic()
    state = {"done": 0.0, "info": "", "printed": t0}

    def emit() -> None:
        done = state["done"]
        shown = f"{done:.0f}" if done == int(done) else f"{done:.1f}"
        line = f"{description}: {shown}/{total} ({time.monotonic() - t0:.0f} s)"
        print(line + (f" {state['info']}" if state["info"] else ""), file=sys.stderr, flush=True)
        state["printed"] = time.monotonic()

    def tick(completed: float | None = None, **figures):
        state["done"] = state["done"] + 1 if completed is None else min(completed, total)
        if figures:
            state["info"] = _info(figures)
        if time.monotonic() - state["printed"] >= every:
            emit()

    emit()
    try:
        yield tick
    finally:
        emit()
