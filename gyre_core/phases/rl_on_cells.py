"""The RL phase on cell agents (`elastic.enabled`): the same steps as `rl_step`, streamed across K cells.

    summary = elastic_rl(run_dir)      # every RL step; resumes at the newest published version

The scheduler (`gyre_core.elastic`: coordinator, router, controller, cells) knows nothing of runs: it
runs a `Work`. `HarnessWork` here is the run's real work — its environment and agent harness, model calls
through the router to cells that decode and train the run's model — and `elastic_rl` lands each published
version as a finished step (lake part, MLflow metrics, `publish_` marker).
"""
from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from typing import Callable

from ..config import ConfigError
from ..elastic.messages import CallRequest
from ..elastic.work import Report
from ..run import CheckpointError, RunDir, publish_marker, step_part
from ..seeds import sampling_seed
from ..ui import phase
from .rl_step import task_groups
from .run_objects import drop_engine, env_factory, policy_bundle, served_model_name, tracker, write_records


def elastic_rl(run_dir: str, on_role=None, launcher=None) -> dict:
    """All RL steps at once on `elastic.cells` cell agents under `elastic.policy` (see `gyre_core.elastic`).
    `on_role(cell, role, reason)` hears each cell's starting role and every finished switch (the Prefect
    task passes `gyre_ops.cells.RoleRecorder`, which records them as queue moves). `launcher` starts the
    agents: None starts them as local processes; `elastic.launch=prefect` needs the Prefect task's
    `gyre_ops.cell_runs.PrefectCellLauncher`.

    Rollout, scoring and training overlap here, so there are no per-phase markers. As each version v is
    published, step v−1 is finished: its executions land in the lake as the step-by-step loop writes them,
    MLflow gets its metrics, and it gets its `publish_` marker (`land_elastic_step`). A crash therefore
    loses only the steps in flight: rerunning resumes at the newest published version — the cells load
    its weights, the bursts continue from its step (same tasks and seeds), and the core's optimizer starts
    afresh from those weights (Adam's moments are not published; the summary's `resumed_from` says where).
    At the end MLflow gets the role timeline, the busy fractions and the controller's decisions (of the
    last invocation)."""
    run = RunDir.open(run_dir)
    if (m := run.done("elastic")) is not None:
        return m
    from ..elastic.runtime import run_elastic

    cfg = run.cfg
    if run.done("warm_start") is None:
        raise CheckpointError("elastic_rl: the warm start is not done; run warm_start first")
    if cfg.elastic.launch == "prefect" and launcher is None:
        raise ConfigError("elastic.launch=prefect: cell agents start as Prefect flow runs, which only the train "
                          "flow's elastic-rl task creates (`gyre train`, or the `train` deployment)")
    drop_engine(run)             # an evaluation's vLLM server: the cells start their own on these devices
    start = run.latest_version()                # steps before it finished in an earlier invocation
    work = HarnessWork(run_dir, cfg.rl.steps, first_step=start)
    t = tracker(run)
    last = [time.time()]
    with phase(f"elastic RL: {cfg.rl.steps} steps on {cfg.elastic.cells} {cfg.elastic.mode} cells "
               f"({cfg.elastic.policy})" + (f", resuming at step {start}" if start else ""), cfg.rl.steps) as tick:
        for _ in range(start):
            tick()

        def published(version: int, stats: dict) -> None:
            now = time.time()
            land_elastic_step(run, t, version - 1, work.take_records(version - 1), stats, now - last[0])
            last[0] = now
            tick()

        try:
            res = (run_elastic(cfg.elastic, work, on_version=published, on_role=on_role, launcher=launcher)
                   if start < cfg.rl.steps else None)
        finally:
            work.close()
    summary = {k: v for k, v in res.to_dict().items() if k != "decisions"} if res else {}
    summary["resumed_from"] = start
    if res is not None:
        summary["switch_marks"] = [[cell, round(t_, 3), src, dst] for cell, t_, src, dst in res.switch_marks]
        t.log_metrics({f"elastic/busy_{k}": v for k, v in res.busy.items() if v is not None}
                      | {"elastic/step_s": res.step_s, "elastic/switches": res.switches,
                         "elastic/reroutes": res.reroutes, "elastic/stale_dropped": res.stale_dropped,
                         "elastic/start_s": res.start_s}, 0)
        out = run.path / "elastic"
        out.mkdir(exist_ok=True)
        res.plot(str(out / "role_timeline.png"))
        (out / "decisions.json").write_text(json.dumps([d.to_dict() for d in res.decisions], indent=1))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        for f in ("role_timeline.png", "decisions.json", "summary.json"):
            t.log_artifact(out / f, "elastic")
    # the phase's wall time across invocations: each step's (from the previous publish, or from this
    # invocation's start: agents' start-up included), and the writes after the last
    steps_s = sum(run.done(publish_marker(v))["metrics"]["time/elastic_step_s"] for v in range(1, cfg.rl.steps + 1))
    summary["rl_wall_s"] = steps_s + (time.time() - last[0])
    return run.mark("elastic", summary)


def land_elastic_step(run: RunDir, t, step: int, recs: list, ts: dict, step_s: float) -> None:
    """Land a finished elastic step: its executions in the lake, its metrics in MLflow, its `publish_`
    marker last (the marker is what a resumed run trusts)."""
    write_records(run, step_part(step), recs)
    n = max(len(recs), 1)
    metrics = {"rollout/executions": len(recs), "rollout/success": sum(r.success for r in recs) / n,
               "rollout/partial": sum(r.partial for r in recs) / n,
               "reward/mean": sum(r.reward for r in recs) / n,
               "rollout/failed": sum(r.status == "failed" for r in recs),
               "tokens/generated": sum(r.tokens_generated for r in recs),
               "time/elastic_step_s": step_s}
    tok = max(ts.get("tokens", 0.0), 1.0)      # `ts`: summed over the step's micro-steps, on every cell
    # the loss as the step loop reports it (micro-steps sum per-execution means; the update divides
    # by the executions trained); behaviour vs trained log-probs are not compared here: with
    # staleness they differ by design (decoupled PPO's IS weight covers that)
    if "kl" in ts:             # the KL guard (rl.max_kl) measured the update
        metrics.update({"train/kl": ts["kl"], "train/kl_backtracks": ts["kl_backtracks"], "train/lr": ts["lr"]})
    metrics.update({"tokens/trained": ts.get("tokens", 0.0),
                    "train/loss": ts.get("loss", 0.0) / max(ts.get("executions", 0.0), 1.0),
                    "train/entropy": ts.get("entropy", 0.0) / tok,
                    "train/clip_frac_in_update": ts.get("clip_frac", 0.0) / tok,
                    "train/is_truncated": ts.get("is_truncated", 0.0) / tok})
    t.log_metrics(metrics, step)
    run.mark(publish_marker(step + 1), {"uri": run.weights_uri(step + 1), "metrics": metrics})


class RouterPolicy:
    """The harness's `Policy` over the router: a round's calls go out concurrently, each to the
    execution's rollout cell; tokens carry the version that made them."""

    def __init__(self, router, temperature: float, max_new_tokens: int) -> None:
        self.router, self.temperature, self.max_new = router, temperature, max_new_tokens

    def complete(self, calls):
        from ..harness.loop import Completion

        outs: list = [None] * len(calls)

        def one(i, c):
            ex_id = c.execution.record.execution_id
            outs[i] = self.router.call(ex_id, CallRequest(c.key, list(c.prompt_ids), c.max_new_tokens,
                                                          self.temperature))
        if len(calls) == 1:       # one execution per thread (HarnessWork): no helper thread needed
            one(0, calls[0])
        else:
            threads = [threading.Thread(target=one, args=(i, c), daemon=True) for i, c in enumerate(calls)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        return [Completion(o.ids, o.logprobs, o.finish_reason, min(o.versions, default=0), 0.0, list(o.versions))
                for o in outs]

    def release(self, key: str) -> None:
        self.router.forget(key)   # the serving cell drops the context's K/V

    def ended(self, execution_id: str) -> None:
        self.router.release(execution_id)   # its last call is made: the slot is free while it is scored


class HarnessWork:
    """The run's real environment, harness and model, as a `Work` for the coordinator: the same tasks,
    seeds and rewards as the step-by-step loop (`rl_step.task_groups`, `assign_reward`)."""

    mode = "real"

    def __init__(self, run_dir: str, steps: int, first_step: int = 0) -> None:
        """Bursts `first_step` .. `steps` − 1; a resumed run starts at its newest published version."""
        self.run = RunDir.open(run_dir)
        self.cfg = self.run.cfg
        self.vocab_size = self.run.vocab_size()      # token ids of every group are checked against it
        self.steps, self.first_step, self.threads = steps, first_step, self.cfg.elastic.devices_per_cell
        self.switch_to_train_s = self.switch_to_rollout_s = 0.0    # real cells do the real work
        self.records: list = []
        self._groups: dict[str, list] = {}
        self._lock = threading.Lock()
        self._proxy = None        # an external harness (harness.command): (proxy, server) in front of the router
        self._stack = contextlib.ExitStack()

    def close(self) -> None:
        """Stop the proxy, if an external harness had one."""
        self._proxy = None
        self._stack.close()

    def cell_args(self) -> list[str]:
        cfg, rl = self.cfg, self.cfg.rl
        train = {"lr": rl.lr, "zero_stage": cfg.trainer.zero_stage, "grad_clip": rl.grad_clip,
                 "temperature": cfg.rollout.temperature, "clip_low": rl.clip_low, "clip_high": rl.clip_high,
                 "is_cap": cfg.elastic.is_cap, "negative_scale": rl.negative_scale,
                 "micro_batch_tokens": rl.micro_batch_tokens, "entropy_coef": rl.entropy_coef,
                 "optimizer": rl.optimizer, "dtype": cfg.trainer.dtype,
                 "gradient_checkpointing": cfg.trainer.gradient_checkpointing,
                 "device": cfg.model.device, "packed": cfg.processor.mode == "tree"}
        args = ["--mode", "real", "--policy", str(self.run.warm), "--weights", self.run.weights_root,
                "--start-version", str(self.first_step),
                "--train-json", json.dumps(train), "--seed", str(cfg.run.seed), "--threads", str(self.threads)]
        if cfg.engine.kind == "vllm":       # rollout on a vLLM server per cell, on all the cell's devices
            n = cfg.elastic.devices_per_cell   # (GPUs: tensor-parallel over them; CPU: that many cores)
            args += ["--engine-json", json.dumps({**cfg.engine.model_dump(), "concurrency": cfg.elastic.capacity,
                                                  "tensor_parallel_size": n, "threads": n})]
        return args

    def take_records(self, step: int) -> list:
        """The finished executions of `step`, handed over once (its version is published: all are in)."""
        with self._lock:
            mine = [r for r in self.records if r.step == step]
            self.records = [r for r in self.records if r.step != step]
        return mine

    def burst_size(self, s: int) -> int:
        return self.cfg.rollout.tasks_per_step * self.cfg.rollout.group_size

    def start_burst(self, s: int, router, report: Report) -> list[Callable[[], None]]:
        specs = [spec for group in task_groups(self.run, s) for spec in group]
        b = policy_bundle(self.run)   # the tokenizer and chat format, loaded once before the threads share it
        if self.cfg.harness.command and self._proxy is None:   # one proxy for the phase, calls via the router
            from ..proxy import open_proxy
            from ..proxy.pool import RouterPool

            self._proxy = self._stack.enter_context(open_proxy(
                self.cfg, b.chat, b.stop_texts, RouterPool(router), self.cfg.rollout.temperature,
                served_model_name(self.cfg)))
        return [functools.partial(self._execution, spec, router, report) for spec in specs]

    def _execution(self, spec, router, report: Report) -> None:
        """One execution on its own thread: a model call, then its environment turn, at its own pace
        (a real harness does not wait for the other executions of a round)."""
        from ..harness.loop import run_executions

        b = policy_bundle(self.run)

        if self.cfg.harness.command:      # the external program, its calls through the proxy to the router
            from ..harness.external import resolve_command, run_agent, score_agent

            proxy, server = self._proxy
            env = env_factory(self.cfg, rollout=True)()
            rec, workspace = run_agent(self.cfg, proxy, server.base_url, resolve_command(self.cfg.harness.command),
                                       spec, env)
            router.release(rec.execution_id)          # the slot is free while its workspace is scored
            return self._finished(score_agent(self.cfg, rec, workspace, env), report)

        policy = RouterPolicy(router, self.cfg.rollout.temperature, self.cfg.harness.max_new_tokens)
        run_executions([spec], policy, self.cfg.harness, env_factory(self.cfg, rollout=True), b.chat, b.stop_texts, 1,
                       lambda rec: self._finished(rec, report))

    def _finished(self, rec, report: Report) -> None:
        """Once a task's group is all in, process it as the step loop processes a step (`step_batch`: dedup,
        advantages, trees, pruning, sampling, credit) and stream each execution's sequences."""
        from ..processor.batch import assign_reward
        from ..processor.step_batch import group_items

        assign_reward(rec, self.cfg.rl.partial_reward)
        with self._lock:
            self.records.append(rec)
            group = self._groups.setdefault(rec.task_id, [])
            group.append(rec)
            if len(group) < self.cfg.rollout.group_size:
                report(rec.step, [])          # finished; it trains with its group (advantages need all of it)
                return
            del self._groups[rec.task_id]
        report(rec.step, group_items(group, self.cfg, sampling_seed(self.cfg.run.seed, rec.step), self.vocab_size))

    def micro_work(self, ms):
        return ms

    def optim_work(self, version: int, n_executions: int, payloads: list):
        """The executions trained; with `rl.max_kl`, also every 4th execution's sequences of the step to
        measure the update's KL on, as the step loop measures it on every 4th micro-batch."""
        rl = self.cfg.rl
        if rl.max_kl is None:
            return n_executions
        return {"n": n_executions, "probe": [sq for seqs in payloads[::4] for sq in seqs], "max_kl": rl.max_kl,
                "backtracks": rl.kl_backtracks}
