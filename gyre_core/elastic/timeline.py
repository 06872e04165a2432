"""The role timeline: which cell held which role when, when it was busy, and the picture of it.

    from gyre_core.elastic.timeline import RoleSpan, BusySpan, busy_fractions, plot_timeline
    fr = busy_fractions(role_spans, busy_spans, k=4, wall=12.0)     # {"overall": 0.71, "rollout": ..., ...}
    plot_timeline("data/sim/laptop-elastic.png", role_spans, busy_spans, switches, "elastic", decisions)

Both the simulator (`gyre_core.elastic.sim`) and the runtime (`gyre_core.elastic.runtime`) record the
same three things, so one accounting and one picture serve both and their figures are comparable:
- `RoleSpan(cell, t0, t1, role)`: the cell held `role` (rollout | train | switching | dead) over [t0, t1);
- `BusySpan(cell, t0, t1, role)`: the cell did device work in `role` over [t0, t1) — a rollout cell with at
  least one model call in flight, or a train cell computing a micro-step or an optimizer step;
- switch marks `(cell, t, from_role, to_role)`: a switch started at t.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

ROLES = ("rollout", "train", "switching", "dead")
SwitchMark = tuple[int, float, str, str]

# light band per role, darker overlay when busy (rollout blue, train orange: the paper's convention)
_BAND = {"rollout": "#c6dbef", "train": "#fdd0a2", "switching": "#d9d9d9", "dead": "#525252"}
_BUSY = {"rollout": "#2171b5", "train": "#d94801"}


@dataclass(slots=True, frozen=True)
class RoleSpan:
    """A cell held `role` over [t0, t1) (seconds since the run started)."""

    cell: int
    t0: float
    t1: float
    role: str


@dataclass(slots=True, frozen=True)
class BusySpan:
    """A cell did device work in `role` over [t0, t1)."""

    cell: int
    t0: float
    t1: float
    role: str


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: overlapping spans of one cell must not count twice."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def busy_fractions(role_spans: Iterable[RoleSpan], busy_spans: Iterable[BusySpan], k: int, wall: float) -> dict:
    """Busy cell-seconds per role over the fleet's cell-seconds (k × wall), and each role's time share.

    Returns `overall`, `rollout`, `train` (busy fractions: busy cell-seconds in that role / (k × wall)),
    `share_<role>` for every role (cell-seconds held in the role / (k × wall)), and the raw seconds as
    `busy_s_<role>` and `role_s_<role>`. Spans are clipped to [0, wall]; a cell's overlapping busy spans
    count once.
    """
    if k <= 0 or not wall > 0:
        raise ValueError(f"busy_fractions: need k > 0 and wall > 0, got k={k}, wall={wall}")
    role_s = dict.fromkeys(ROLES, 0.0)
    for s in role_spans:
        if s.role not in role_s:
            raise ValueError(f"busy_fractions: unknown role {s.role!r} (allowed: {ROLES})")
        role_s[s.role] += max(0.0, min(s.t1, wall) - max(s.t0, 0.0))
    per_cell: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for b in busy_spans:
        if b.role not in _BUSY:
            raise ValueError(f"busy_fractions: a busy span's role must be rollout or train, got {b.role!r}")
        a, z = max(b.t0, 0.0), min(b.t1, wall)
        if z > a:
            per_cell[(b.cell, b.role)].append((a, z))
    busy_s = dict.fromkeys(_BUSY, 0.0)
    for (_, role), spans in per_cell.items():
        busy_s[role] += _union_length(spans)
    fleet = k * wall
    out = {"overall": sum(busy_s.values()) / fleet}
    out.update({role: busy_s[role] / fleet for role in _BUSY})
    out.update({f"share_{r}": role_s[r] / fleet for r in ROLES})
    out.update({f"busy_s_{r}": busy_s[r] for r in _BUSY})
    out.update({f"role_s_{r}": role_s[r] for r in ROLES})
    return out


def _time_unit(wall: float) -> tuple[float, str]:
    if wall >= 2 * 3600:
        return 3600.0, "h"
    if wall >= 120:
        return 60.0, "min"
    return 1.0, "s"


def _grouped(spans, scale: float) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(cell, role) -> [(start, width)]: one draw call per group, not per span (thousands of spans)."""
    out: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        out[(s.cell, s.role)].append((s.t0 / scale, (s.t1 - s.t0) / scale))
    return out


def _decision_series(decisions) -> tuple[list[float], list[int], list[int]]:
    """(t, w = d − f, rollout capacity) from Decision records or their dicts."""
    ts, ws, caps = [], [], []
    for d in decisions:
        d = d if isinstance(d, dict) else d.to_dict()
        ts.append(float(d["t"]))
        ws.append(int(d["dispatched"]) - int(d["finished"]))
        caps.append(int(d["rollout_capacity"]))
    return ts, ws, caps


def plot_timeline(path: str, role_spans: list[RoleSpan], busy_spans: list[BusySpan],
                  switches: list[SwitchMark], title: str, decisions=None,
                  load: list[tuple[float, int]] | None = None) -> str:
    """Write a PNG: one row per cell (core on top), its role as a light band, device work as a darker
    overlay, switch starts as ticks; with `decisions` (Decision records or their dicts), a lower panel of
    the unfinished executions w(t) and the rollout capacity the controller left. Decisions are logged
    only when the split changes, so w(t) read from them is coarse; `load` — (t, w) at every dispatch and
    finish — draws it exactly. Returns `path`.

    Uses matplotlib's Agg canvas directly (no pyplot), so it works headless and leaves global state alone.
    """
    if not role_spans:
        raise ValueError("plot_timeline: no role spans to draw")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    cells = sorted({s.cell for s in role_spans} | {b.cell for b in busy_spans})
    wall = max(s.t1 for s in role_spans)
    scale, unit = _time_unit(wall)
    row = {c: i for i, c in enumerate(cells)}
    with_w = bool(decisions) or bool(load)
    fig = Figure(figsize=(11, 1.0 + 0.45 * len(cells) + (1.8 if with_w else 0)), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2 if with_w else 1, 1, height_ratios=[max(len(cells), 2), 2.5] if with_w else [1])
    ax = fig.add_subplot(grid[0])
    y_of = {c: len(cells) - 1 - row[c] for c in cells}
    for (cell, role), xr in _grouped(role_spans, scale).items():
        ax.broken_barh(xr, (y_of[cell] - 0.4, 0.8), color=_BAND.get(role, "#ffffff"), lw=0)
    for (cell, role), xr in _grouped(busy_spans, scale).items():
        ax.broken_barh(xr, (y_of[cell] - 0.25, 0.5), color=_BUSY.get(role, "#000000"), lw=0)
    for to in {m[3] for m in switches}:
        marks = [(t / scale, y_of[cell]) for cell, t, _, dest in switches if dest == to and cell in y_of]
        if marks:
            xs, ys = zip(*marks)
            ax.vlines(xs, [y - 0.45 for y in ys], [y + 0.45 for y in ys], color=_BUSY.get(to, "#000000"), lw=1.2)
    ax.set_yticks(range(len(cells)))
    ax.set_yticklabels([("core (0)" if c == 0 else f"cell {c}") for c in reversed(cells)])
    ax.set_xlim(0, wall / scale)
    ax.set_title(title, pad=22)
    legend = [Patch(color=_BAND[r], label=r) for r in ("rollout", "train", "switching")]
    legend += [Patch(color=_BUSY[r], label=f"busy ({r})") for r in _BUSY]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, fontsize=8, frameon=False)
    if with_w:
        ts, ws, caps = _decision_series(decisions or [])
        if load:
            ts_w, ws = [t for t, _ in load], [w for _, w in load]
        else:
            ts_w = ts
        low = fig.add_subplot(grid[1], sharex=ax)
        if ws:
            xs = [t / scale for t in ts_w] + [wall / scale]
            low.step(xs, ws + ws[-1:], where="post", color="#6a51a3", label="unfinished w(t)")
        if caps:
            xs = [t / scale for t in ts] + [wall / scale]
            low.step(xs, caps + caps[-1:], where="post", color="#2171b5", ls="--",
                     label="rollout capacity (after each decision)")
        low.set_ylabel("executions")
        low.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, frameon=False)
        low.set_xlabel(f"time ({unit})")
    else:
        ax.set_xlabel(f"time ({unit})")
    fig.tight_layout()
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
    return path
