"""Progress bars for long phases. One bar per phase, on stderr, quiet when GYRE_QUIET=1."""
from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def phase(description: str, total: int):
    """`with phase("rollout", n) as tick: ... tick()` — advances a bar; tick(loss=0.3) shows a figure;
    tick(completed=x) sets the bar's position (e.g. seconds spent of a time budget)."""
    if os.environ.get("GYRE_QUIET") == "1" or total <= 0:
        yield lambda **kw: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"))
    with Progress(*cols, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total, info="")

        def tick(completed: float | None = None, **figures):
            info = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
            move = {"advance": 1} if completed is None else {"completed": min(completed, total)}
            bar.update(task, **move, **({"info": info} if figures else {}))

        yield tick
