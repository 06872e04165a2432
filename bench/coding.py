"""The coding environment: task-builder yield, the expert and a random tool policy, hostile commands against the
sandbox, and executions per minute through Gyre's harness.

    python -m bench.coding [--quick]       # prints JSON figures
    gyre bench coding --json

- Builder: `gyre tasks build` on the shipped package (inflection 0.5.1): candidates tried, tasks kept, seconds.
- Expert: every shipped task (train and held-out) solved through `edit_file`, scored by the withheld tests;
  `expert_success` must be 1.0 (every task solvable).
- Random: a uniform-random tool policy (each turn one of list_files, read_file of a random file, `run ls`,
  an `edit_file` of a random line to a random other line, or `done`; at most 6 turns) on every task.
- Hostile: the commands of tests/core/test_sandbox.py and a few more, each checked for containment (refused,
  cut off or killed, with nothing outside the workspace changed and nothing left running).
- Throughput: the expert through Gyre's harness (tool calls parsed from its completions, results rendered as
  tool messages), N executions with 16 and 64 at once on this machine's cores; every command and evaluation
  in the sandbox. `evaluator_s`: the evaluator's mean seconds per execution. Evaluators run on
  `harness.score_workers` (4) threads beside the rollout; `executions_per_min_16_one_evaluator` is the same run
  with one, and `evaluators_speedup` the ratio.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _hostile(tmp: Path) -> tuple[int, int, list[str]]:
    from gyre_core.sandbox import Sandbox, SandboxLimits

    root = tmp / "ws"
    (root / "mine").mkdir(parents=True)
    (root / "theirs").mkdir()
    (root / "theirs" / "secret.txt").write_text("their answer")
    outside = tmp / "outside.txt"
    outside.write_text("untouched")
    box = Sandbox(root / "mine", SandboxLimits(wall_s=10, cpu_s=10, memory_mb=1024, processes=32))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    py = sys.executable
    cases = {
        "write outside the workspace": (f"echo x > {outside}; echo x > /etc/gyre-bench", lambda r: outside.read_text() == "untouched" and not os.path.exists("/etc/gyre-bench")),
        "read another workspace": (f"cat {root / 'theirs' / 'secret.txt'}", lambda r: "their answer" not in r.output),
        "read the project": (f"cat {Path(__file__).resolve().parents[1] / 'README.md'}", lambda r: "Gyre" not in r.output),
        "connect to the host's loopback": ([py, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"], lambda r: "CONNECTED" not in r.output),
        "connect to the internet": ([py, "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2); print('CONNECTED')"], lambda r: "CONNECTED" not in r.output),
        "fork bomb": ([py, "-c", "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(60); os._exit(0)"], lambda r: r.seconds < 12),
        "allocate 10 GB": ([py, "-c", "x = bytearray(10 * 1024 ** 3); print('GOT')"], lambda r: "GOT" not in r.output),
        "sleep forever": ("sleep 100000", lambda r: r.timed_out and r.seconds < 15),
        "write a 1 GB file": (f"head -c {1 << 30} /dev/zero > big.bin", lambda r: (root / "mine" / "big.bin").stat().st_size <= 64 << 20),
        "kill the parent": (f"kill -9 {os.getpid()}; kill -9 -1", lambda r: True),       # we are still here
        "fill /tmp": ("head -c 500000000 /dev/zero > /tmp/fill", lambda r: r.exit_code != 0),
    }
    contained, failed = 0, []
    try:
        for name, (cmd, ok) in cases.items():
            r = box.run(cmd)
            if ok(r):
                contained += 1
            else:
                failed.append(name)
    finally:
        server.close()
    return len(cases), contained, failed


def _random_policy(env, rng: random.Random, turns: int = 6):
    files = None
    for _ in range(turns):
        choice = rng.randrange(5)
        try:
            if choice == 0:
                files = env.call_tool("list_files", {}).split("\n")
            elif choice == 1:
                files = files or env.call_tool("list_files", {}).split("\n")
                env.call_tool("read_file", {"path": rng.choice(files)})
            elif choice == 2:
                env.call_tool("run", {"command": "ls"})
            elif choice == 3:
                path = env.task.path
                lines = (env.workspace / path).read_text().splitlines(keepends=True)
                a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
                if lines[a] != lines[b] and (env.workspace / path).read_text().count(lines[a]) == 1:
                    env.call_tool("edit_file", {"path": path, "old": lines[a], "new": lines[b]})
            else:
                break
        except Exception:  # noqa: BLE001 - a random call may fail; the agent sees an error
            pass
    return env.score()


def _throughput(concurrency: int, n: int, score_workers: int = 4) -> tuple[float, list[float]]:
    """Expert executions per minute through Gyre's harness, `concurrency` at once, and each one's evaluator
    seconds (`ExecutionRecord.evaluator_s`)."""
    from gyre_core.config import HarnessConfig
    from gyre_core.envs.coding.env import CodingEnv
    from gyre_core.harness.conversation import ChatFormat
    from gyre_core.harness.loop import ExecutionSpec, run_executions
    from gyre_core.harness.policies import ExpertPolicy
    from gyre_core.model import IM_END, train_tokenizer

    env = CodingEnv("inflection")
    tok = train_tokenizer(list(env.corpus(20, 0)), vocab_size=512)
    stop = tok.convert_tokens_to_ids(IM_END)
    cfg = HarnessConfig(max_turns=4, context_tokens=100_000, max_new_tokens=4096, score_workers=score_workers)
    specs = [ExecutionSpec("bench", 0, f"bench/e{i}", f"t{i}", i, "train") for i in range(n)]
    t0 = time.perf_counter()
    recs = run_executions(specs, ExpertPolicy(tok, stop), cfg, lambda: CodingEnv("inflection"), ChatFormat(tok),
                          {stop: IM_END}, concurrency)
    wall = time.perf_counter() - t0
    if not all(r.success for r in recs):
        raise RuntimeError(f"the expert failed through the harness: {[r.error for r in recs if not r.success][:2]}")
    return n / wall * 60, [r.evaluator_s for r in recs]


def bench_coding(quick: bool = False) -> dict:
    from gyre_core.envs.coding.env import CodingEnv
    from gyre_core.envs.coding.tasks import PACKAGES, PackageSource, build_tasks

    out: dict = {}
    t0 = time.perf_counter()
    src = PackageSource.of(PACKAGES / "inflection-0.5.1", "test_inflection.py", ["inflection/__init__.py"], "inflection")
    tasks, stats = build_tasks(src, per_function=1 if quick else 3)
    out.update(tasks_built=stats.candidates, tasks_kept=stats.kept, build_s=round(time.perf_counter() - t0, 1),
               tasks_shipped=len(CodingEnv("inflection").train) + len(CodingEnv("inflection").heldout))

    env = CodingEnv("inflection")
    everything = env.train + env.heldout
    ok = 0
    for t in everything:
        env.task = t
        env._drop_workspace()
        env.workspace = Path(tempfile.mkdtemp(prefix="gyre-code-"))
        env.setup_workspace(str(env.workspace))
        env._expert_step = 0
        call = json.loads(env.expert_action().split("<tool_call>")[1].split("</tool_call>")[0])
        env.call_tool(call["name"], call["arguments"])
        ok += env.score().success
    out.update(expert_success=round(ok / len(everything), 4), expert_tasks=len(everything))

    rng = random.Random(0)
    rand = []
    for seed in range(len(everything) if not quick else 6):
        env.reset(seed if seed % 2 == 0 else 1_000_000_000 + seed)
        rand.append(_random_policy(env, rng))
    out.update(random_success=round(sum(s.success for s in rand) / len(rand), 4),
               random_partial=round(statistics.mean(s.partial for s in rand), 4), random_episodes=len(rand))

    tmp = Path(tempfile.mkdtemp(prefix="gyre-hostile-"))
    try:
        tried, contained, failed = _hostile(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(hostile_tried=tried, hostile_contained=contained, **({"hostile_failed": failed} if failed else {}))

    per_min_16, scored = _throughput(16, 16 if quick else 32)
    out.update(executions_per_min_16=round(per_min_16, 1), evaluator_s=round(statistics.mean(scored), 2))
    # the baseline: one evaluator at a time (what scoring in line with the rollout allows at most)
    serial, _ = _throughput(16, 16 if quick else 32, score_workers=1)
    out.update(executions_per_min_16_one_evaluator=round(serial, 1),
               evaluators_speedup=round(per_min_16 / serial, 2))
    if not quick:
        per_min_64, _ = _throughput(64, 64)
        out.update(executions_per_min_64=round(per_min_64, 1))
    return out


if __name__ == "__main__":
    print(json.dumps(bench_coding(quick="--quick" in sys.argv)))
