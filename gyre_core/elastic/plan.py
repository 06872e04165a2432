"""The cost-aware policy's planner as a process of its own, so its simulations never hold the coordinator's
interpreter lock (`runtime.Coordinator._plan` starts it once a version):

    echo '{"workload": {...}, "k": 8, "capacity": 8, "max_staleness": 1, "micro": 4}' | python -m gyre_core.elastic.plan
    [2, false]                           # sim.plan_reserve: (training reserve, static split?)

It runs at low priority (nice 10): the cells and the coordinator come first.
"""
from __future__ import annotations

import json
import os
import sys

from .sim import plan_reserve
from .workload import Workload


def main() -> int:
    os.nice(10)
    a = json.load(sys.stdin)
    reserve, static = plan_reserve(Workload.from_dict(a["workload"]), a["k"], a["capacity"], a["max_staleness"],
                                   a["micro"])
    print(json.dumps([reserve, static]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
