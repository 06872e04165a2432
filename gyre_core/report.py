"""The end of a run: the summary (JSON + a terminal table), the reward-curve PNG, MLflow artifacts; and
the plain figures an orchestrator shows for each RL step (`step_row`) and for the run (`summary_markdown`)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .evaluation import paired
from .run import RunDir, eval_marker, publish_marker, step_marker


def summarize(run_dir: str, started_at: float | None = None) -> dict:
    """Collect the run's figures from its markers; write summary.json and the reward curve; log both."""
    from .evaluation import EvalResult
    from .phases.run_objects import tracker

    run = RunDir.open(run_dir)
    before, after = run.done(eval_marker("before")) or {}, run.done(eval_marker("after")) or {}
    base = run.done(eval_marker("base")) or {}
    ctrl, ctrl_eval = run.done("control") or {}, run.done(eval_marker("control")) or {}
    steps = run.latest_version()
    per_step = [run.done(publish_marker(v))["metrics"] for v in range(1, steps + 1)]
    ws = run.done("warm_start") or {}

    def ev(d: dict, mode: str) -> dict:
        r = d.get(mode) or {}
        return {"success": r.get("success"), "partial": r.get("partial"), "episodes": r.get("episodes"),
                **{k: r[k] for k in AGENT_STATS if k in r}}

    summary: dict = {
        "run_id": run.run_id, "preset": run.cfg.preset, "rl_steps": steps,
        "eval_before": ev(before, "sampled"), "eval_after": ev(after, "sampled"),
        "eval_before_greedy": ev(before, "greedy"), "eval_after_greedy": ev(after, "greedy"),
        "eval_random": ev(before, "random"),
        # the demonstrator under the same harness limits (its demonstration seeds): with epsilon 0 the
        # environment's expert, the ceiling; with epsilon > 0 the noisy demonstrator the warm start copied
        "expert": {"success": ws.get("demo_success"), "episodes": ws.get("demos"),
                   "epsilon": run.cfg.warmstart.expert_epsilon},
        "eval_episodes": (before.get("sampled") or {}).get("episodes", 0),
        "eval_paired": bool(before.get("sampled") and after.get("sampled")
                            and before["sampled"]["seeds"] == after["sampled"]["seeds"]),
    }
    b, a, c = (EvalResult.of(x["sampled"]) if x.get("sampled") else None for x in (before, after, ctrl_eval))

    def interval(first: EvalResult, second: EvalResult, metric: str = "success") -> dict:   # second − first
        return paired(first, second, metric).as_summary()

    if summary["eval_paired"]:
        summary.update(interval(b, a))
        summary["partial_diff"] = interval(b, a, "partial")
    if base.get("sampled"):   # the initial model, before the warm start
        summary["base"] = ev(base, "sampled")
        if b is not None:
            summary["warm_start_vs_base"] = interval(EvalResult.of(base["sampled"]), b)
    if c is not None:   # the supervised-only control, on the same seeds
        summary["control"] = {**ev(ctrl_eval, "sampled"), "budget_s": ctrl.get("budget_s"),
                              "wall_s": ctrl.get("wall_s"), "sft_steps": ctrl.get("sft_steps"),
                              **(interval(b, c) if b else {})}
        if a is not None:
            summary["rl_vs_control"] = interval(c, a)
    el = run.done("elastic") or {}
    rollouts = [run.done(step_marker("rollout", s)) or {} for s in range(steps)]
    if el:   # the RL phase ran on cell agents: its per-step figures are in the publish markers
        rollouts = [{"executions": m.get("rollout/executions", 0), "tokens_generated": m.get("tokens/generated", 0)}
                    for m in per_step]
        summary["elastic"] = {k: el.get(k) for k in ("policy", "mode", "k", "step_s", "busy_frac", "switches",
                                                     "switch_s_rollout_to_train", "switch_s_train_to_rollout",
                                                     "reroutes", "stale_dropped", "dead_cells", "notes")}
    if per_step and run.cfg.engine.kind != "local":   # the engine's log-probs against the trainer's
        def over_steps(key: str, how):
            vals = [m[key] for m in per_step if key in m]
            return how(vals) if vals else None     # None: not measured (e.g. on elastic cells)

        summary["engine"] = {
            "kind": run.cfg.engine.kind,
            "logprob_mismatch": over_steps("train/logprob_mismatch", lambda v: sum(v) / len(v)),
            "tis_clip_frac": over_steps("train/tis_clip_frac", lambda v: sum(v) / len(v)),
            "reload_max_logprob_err": over_steps("engine/reload_max_logprob_err", max)}
    summary["executions"] = sum(r.get("executions", 0) for r in rollouts) + ws.get("demos", 0) + ctrl.get(
        "demos", 0) + sum((x.get(m) or {}).get("episodes", 0) for x in (base, before, after, ctrl_eval)
                          for m in ("sampled", "greedy", "random"))
    summary["tokens_generated"] = int(sum(r.get("tokens_generated", 0) for r in rollouts))
    summary["tokens_trained"] = int(sum(m.get("tokens/trained", 0) for m in per_step))
    summary["executions_collapsed"] = int(sum(m.get("dedup/collapsed", 0) for m in per_step))   # dedup
    phases = {
        "warm_start": ws.get("wall_s", 0.0),
        "eval": sum(x.get("wall_s", 0.0) for x in (base, before, after, ctrl_eval)),
        "rollout": sum(m.get("time/rollout_s", 0.0) for m in per_step),
        "score": sum(m.get("time/score_s", 0.0) for m in per_step),
        "process": sum(m.get("time/process_s", 0.0) for m in per_step),
        "train": sum(m.get("time/train_s", 0.0) for m in per_step),
        "publish": sum(m.get("time/publish_s", 0.0) for m in per_step),
        "elastic": el.get("rl_wall_s", 0.0),      # across resumed invocations
        "control": ctrl.get("wall_s", 0.0),
    }
    for k in (("rollout", "score", "process", "train", "publish") if el else ("elastic",)):
        del phases[k]            # the RL phase ran one way or the other
    summary["phase_s"] = phases
    summary["work_s"] = sum(phases.values())      # all phases, across resumed invocations
    summary["wall_s"] = time.time() - started_at if started_at else summary["work_s"]   # this invocation
    summary["logprob_mismatch_max"] = max((abs(m.get("train/logprob_mismatch", 0.0)) for m in per_step), default=0.0)
    t = tracker(run)
    exported = run.done("export_policy") or {}
    from .config import gyre_home

    summary["paths"] = {"home": str(gyre_home()), "run_dir": str(run.path), "lake": run.cfg.lake.root,
                        "checkpoints": str(run.ckpt),
                        "mlflow_uri": run.cfg.tracking.uri, "mlflow_run_id": t.run_id,
                        "mlflow_experiment_id": t.experiment_id, "mlflow_url": t.link()["url"],
                        # the newest policy as an HF directory in MLflow (phases.export.export_policy), if logged
                        "policy_uri": exported.get("uri") if exported.get("version") == steps else None}
    out = run.path / "summary.json"
    out.write_text(json.dumps(summary, indent=1))
    png = reward_curve(per_step, before, after, run.path / "reward_curve.png")
    for path in (run.path / "config.yaml", out, png):
        t.log_artifact(path)
    final = {f"eval/{k}_success": v["success"] for k, v in (("before", summary["eval_before"]),
                                                             ("after", summary["eval_after"])) if v["success"] is not None}
    t.log_metrics(final, steps)
    t.finish()
    return summary


PHASES = ("rollout", "score", "process", "train", "publish")
AGENT_STATS = ("calls_per_execution", "compactions_per_execution", "tool_calls_per_execution",
               "tool_parse_failure_rate")     # phases.held_out.agent_stats, per held-out evaluation


def step_row(run_dir: str, step: int) -> dict:
    """One RL step's figures, from its markers (rounded to 4 decimals): what the step's Prefect artifact shows.

    `policy_version` is the version the step published (it rolled out version `step`). The phase times
    are None for the elastic phase, where phases overlap; `step_s` is then the elastic mean step time."""
    from .phases.run_objects import tracker

    run = RunDir.open(run_dir)
    pub = run.done(publish_marker(step + 1))
    if pub is None:
        raise ValueError(f"step_row: step {step} of run {run.run_id} is not published (no {publish_marker(step + 1)} marker)")
    m = pub["metrics"]
    elastic = "time/elastic_step_s" in m
    ro = run.done(step_marker("rollout", step)) or {}
    phase_s = {k: None if elastic else m.get(f"time/{k}_s", 0.0) for k in PHASES}
    t = tracker(run)

    def r(x):
        return round(x, 4) if isinstance(x, float) else x

    row = {"run_id": run.run_id, "step": step, "policy_version": step + 1,
           "executions": m.get("rollout/executions", ro.get("executions", 0)),
           "success": m.get("rollout/success", 0.0), "partial": m.get("rollout/partial", 0.0),
           "reward_mean": m.get("reward/mean", 0.0),
           "tokens_generated": int(m.get("tokens/generated", 0)), "tokens_trained": int(m.get("tokens/trained", 0)),
           "executions_collapsed": int(m.get("dedup/collapsed", 0)),
           **{f"time_{k}_s": v for k, v in phase_s.items()},
           "step_s": m["time/elastic_step_s"] if elastic else sum(phase_s.values()),
           "mlflow_run_id": t.run_id, "mlflow_url": t.link()["url"]}
    return {k: r(v) for k, v in row.items()}


def _demonstrator(expert: dict) -> str:
    """The summary's label for the demonstration episodes' success: the expert, or the noisy demonstrator."""
    eps = expert.get("epsilon") or 0.0
    return "expert" if eps == 0 else f"demonstrator (expert, {100 * eps:.0f}% of actions random)"


def summary_markdown(run_dir: str, summary: dict) -> str:
    """The run's summary as markdown: held-out success before/after with the paired interval, the
    supervised-only control, minutes per phase, one line per RL step, and where MLflow has the run."""
    from .tracking import run_link

    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    def dur(x):
        return f"{x:.0f} s" if x < 90 else f"{x / 60:.1f} min"

    def ci(d):
        return f"{100 * d['diff']:+.1f} points [95% CI {100 * d['ci95_low']:+.1f}, {100 * d['ci95_high']:+.1f}]"

    s, p = summary, summary["paths"]
    b, a = s["eval_before"], s["eval_after"]
    out = [f"# Gyre run `{s['run_id']}` ({s['preset']}): {s['rl_steps']} RL steps", "",
           "| held-out success | before RL | after RL |", "|---|---:|---:|",
           f"| sampled ({s['eval_episodes']} seeds, {'paired' if s['eval_paired'] else 'not paired'}) "
           f"| {pct(b['success'])} | {pct(a['success'])} |",
           f"| greedy | {pct(s['eval_before_greedy']['success'])} | {pct(s['eval_after_greedy']['success'])} |",
           f"| uniform-random policy | {pct(s['eval_random']['success'])} | |",
           *([f"| initial model, before the warm start | {pct(s['base']['success'])} | |"] if "base" in s else []),
           f"| {_demonstrator(s['expert'])}, same turn limit | {pct(s['expert']['success'])} | |", ""]
    if "ci95_low" in s:
        out += [f"**After − before:** {ci(s)}", ""]
    if "partial_diff" in s:
        d = s["partial_diff"]
        out += [f"**Partial score, after − before:** {d['diff']:+.3f} [95% CI {d['ci95_low']:+.3f}, "
                f"{d['ci95_high']:+.3f}]", ""]
    if "control" in s:
        c = s["control"]
        out += [f"**Supervised-only control** ({c['sft_steps']} steps in {dur(c['wall_s'] or 0)}, "
                f"the RL phase's time): {pct(c['success'])}"
                + (f"; RL − control: {ci(s['rl_vs_control'])}" if "rl_vs_control" in s else ""), ""]
    phases = ", ".join(f"{k} {dur(v)}" for k, v in s["phase_s"].items() if v)
    out += [f"- **time:** {dur(s['work_s'])} of work ({phases}); {dur(s['wall_s'])} wall in this invocation",
            f"- **tokens:** {s['tokens_generated']:,} generated, {s['tokens_trained']:,} trained; "
            f"{s['executions_collapsed']} executions collapsed by dedup", ""]
    rows = [step_row(run_dir, k) for k in range(s["rl_steps"])]
    if rows:
        out += ["| step | success | partial | reward | tokens gen / trained | collapsed | step s |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['step']} | {pct(r['success'])} | {r['partial']:.3f} | {r['reward_mean']:.3f} | "
                f"{r['tokens_generated']:,} / {r['tokens_trained']:,} | {r['executions_collapsed']} | {r['step_s']:.1f} |"
                for r in rows]
        out.append("")
    link = run_link(p["mlflow_uri"], p["mlflow_experiment_id"], p["mlflow_run_id"])
    out.append(f"- **MLflow:** [run {p['mlflow_run_id']}]({link['url']})"
               + (f" (serve the UI first: `{link['hint']}`)" if link["hint"] else ""))
    if p.get("policy_uri"):
        out.append(f"- **policy:** `{p['policy_uri']}` (an HF model directory; evaluate it by this URI)")
    out.append(f"- **lake:** `{p['lake']}`; **run dir:** `{p['run_dir']}`")
    return "\n".join(out) + "\n"


def reward_curve(per_step: list[dict], before: dict, after: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    xs = list(range(len(per_step)))
    if per_step:
        ax.plot(xs, [m["reward/mean"] for m in per_step], marker=".", label="reward (mean)")
        ax.plot(xs, [m["rollout/success"] for m in per_step], marker=".", label="rollout success")
    for d, x, name in ((before, -0.5, "eval before"), (after, max(len(per_step) - 0.5, 0.5), "eval after")):
        if d.get("sampled"):
            ax.scatter([x], [d["sampled"]["success"]], marker="s", s=40, label=f"{name} (held-out)")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def render_summary(s: dict) -> None:
    """The table `gyre train` ends with."""
    from rich.console import Console
    from rich.table import Table

    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}%"

    t = Table(title=f"gyre run {s['run_id']} ({s['preset']})", show_header=True)
    t.add_column("figure")
    t.add_column("before RL", justify="right")
    t.add_column("after RL", justify="right")
    t.add_row("held-out success (sampled)", pct(s["eval_before"]["success"]), pct(s["eval_after"]["success"]))
    t.add_row("held-out success (greedy)", pct(s["eval_before_greedy"]["success"]), pct(s["eval_after_greedy"]["success"]))
    t.add_row("mean partial score (sampled)", f"{s['eval_before']['partial'] or 0:.3f}", f"{s['eval_after']['partial'] or 0:.3f}")
    b, a = s["eval_before"], s["eval_after"]
    if "calls_per_execution" in b or "calls_per_execution" in a:
        def per(d):
            return "/".join("—" if d.get(k) is None else f"{d[k]:.1f}" for k in AGENT_STATS[:3])
        t.add_row("model calls / compactions / tool calls per execution", per(b), per(a))
    if "tool_parse_failure_rate" in b or "tool_parse_failure_rate" in a:
        t.add_row("tool-call parse failures", pct(b.get("tool_parse_failure_rate")), pct(a.get("tool_parse_failure_rate")))
    if "ci95_low" in s:
        t.add_row("paired difference, 95% CI", "", f"{100 * s['diff']:+.1f} [{100 * s['ci95_low']:+.1f}, {100 * s['ci95_high']:+.1f}]")
    if "partial_diff" in s:
        d = s["partial_diff"]
        t.add_row("partial score: paired difference, 95% CI", "",
                  f"{d['diff']:+.3f} [{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}]")
    if "control" in s:
        c = s["control"]
        t.add_row(f"supervised-only control ({c['sft_steps']} steps, {c['wall_s']:.0f} s)", "",
                  pct(c["success"]))
        if "rl_vs_control" in s:
            r = s["rl_vs_control"]
            t.add_row("RL minus control, 95% CI", "",
                      f"{100 * r['diff']:+.1f} [{100 * r['ci95_low']:+.1f}, {100 * r['ci95_high']:+.1f}]")
    if s["eval_random"].get("success") is not None:
        t.add_row("uniform-random policy", pct(s["eval_random"]["success"]), "")
    if "base" in s:
        w = s.get("warm_start_vs_base")
        t.add_row("initial model, before the warm start", pct(s["base"]["success"]),
                  "" if not w else f"warm start − initial {100 * w['diff']:+.1f} [{100 * w['ci95_low']:+.1f}, "
                                   f"{100 * w['ci95_high']:+.1f}]")
    if s["expert"]["episodes"]:
        t.add_row(f"{_demonstrator(s['expert'])}, same turn limit ({s['expert']['episodes']} demo seeds)",
                  pct(s["expert"]["success"]), "")
    t.add_row("held-out episodes (paired)", str(s["eval_episodes"]), "yes" if s["eval_paired"] else "no")
    t.add_row("RL steps / executions run", "", f"{s['rl_steps']} / {s['executions']}")
    t.add_row("tokens generated / trained", "", f"{s['tokens_generated']:,} / {s['tokens_trained']:,}")
    if e := s.get("engine"):
        if e["logprob_mismatch"] is not None:
            t.add_row(f"{e['kind']}: mean |Δ log-prob| vs trainer", "", f"{e['logprob_mismatch']:.4f}")
        if e["tis_clip_frac"] is not None:
            t.add_row("TIS: tokens truncated", "", f"{100 * e['tis_clip_frac']:.2f}%")
        if e["reload_max_logprob_err"] is not None:
            t.add_row(f"{e['kind']}: reload check, max |Δ log-prob|", "", f"{e['reload_max_logprob_err']:.3g}")
    for k, v in s["phase_s"].items():
        if k == "control" and "control" not in s:
            continue                   # no control was run
        t.add_row(f"time: {k}", "", f"{v:.1f} s")
    t.add_row("time: all phases", "", f"{s['work_s']:.1f} s")
    t.add_row("time: wall (this invocation)", "", f"{s['wall_s']:.1f} s")
    c = Console()
    c.print(t)
    p = s["paths"]
    if p.get("home"):
        c.print(f"home: {p['home']}   (relative data paths live here: $GYRE_HOME, else the current directory)")
    c.print(f"lake: {p['lake']}   (gyre sql \"SELECT * FROM executions LIMIT 5\" --run {s['run_id']})")
    c.print(f"checkpoints: {p['checkpoints']}")
    c.print(f"MLflow run {p['mlflow_run_id']} at {p['mlflow_uri']}   (mlflow ui --backend-store-uri {p['mlflow_uri']})")
    if p.get("policy_uri"):
        c.print(f"policy: {p['policy_uri']}")
