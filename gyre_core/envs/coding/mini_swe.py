"""mini-SWE-agent (PyPI `mini-swe-agent`, unmodified) as the external harness of a coding execution: its model
calls go to Gyre's recording proxy, its shell commands run in Gyre's sandbox.

    harness.command: [.venv-mswea/bin/python, gyre_core/envs/coding/mini_swe.py, --step-limit, "12"]

It runs in mini-SWE-agent's own virtual environment (`bash scripts/install.sh --agents` builds
`.venv-mswea/`), reads the execution's endpoint and task from the environment Gyre gives it
(`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `GYRE_MODEL`, `GYRE_TASK`, `GYRE_WORKSPACE`), and drives mini-SWE-agent's
`DefaultAgent` with its text-based litellm model (the served model need not have a tool parser) and its own
`mini_textbased.yaml` prompts. The one piece of Gyre it brings is `SandboxEnvironment`, which implements
mini-SWE-agent's environment interface over `gyre_core.sandbox` (standard library only, so it imports in the
agent's venv). For offline use: litellm's local cost map, no cost tracking, one model retry.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"      # mini-SWE-agent's end-of-task marker


class SandboxEnvironment:
    """mini-SWE-agent's environment interface (`execute`, `get_template_vars`, `serialize`) over Gyre's sandbox."""

    def __init__(self, cwd: str = "", env: dict | None = None, timeout: int = 30, **_: object) -> None:
        from gyre_core.sandbox import Sandbox, SandboxLimits

        self.cwd, self.timeout = cwd or os.getcwd(), timeout
        self.box = Sandbox(self.cwd, SandboxLimits(wall_s=timeout, cpu_s=timeout), env=dict(env or {}))

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        r = self.box.run(str(action.get("command", "")))
        out = {"output": r.output, "returncode": r.exit_code,
               "exception_info": f"the command timed out after {self.timeout} s" if r.timed_out else ""}
        lines = r.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and r.exit_code == 0:
            from minisweagent.exceptions import Submitted

            rest = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": rest, "extra": {"exit_status": "Submitted", "submission": rest}})
        return out

    def get_template_vars(self, **kwargs) -> dict:
        import platform

        from gyre_core.sandbox import MOUNT

        return {**platform.uname()._asdict(), "cwd": MOUNT, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment_type": "gyre.sandbox", "timeout": self.timeout}}}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="mini-SWE-agent on a Gyre coding execution")
    ap.add_argument("--step-limit", type=int, default=12)
    ap.add_argument("--command-timeout", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # else litellm fetches a price list
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("MSWEA_CONFIGURED", "true")                  # no first-run questions
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    config = yaml.safe_load((builtin_config_dir / "mini_textbased.yaml").read_text())
    model_cfg = {k: v for k, v in (config.get("model") or {}).items() if k not in ("model_name", "model_kwargs",
                                                                                     "model_class")}
    model = LitellmTextbasedModel(
        model_name=f"openai/{os.environ['GYRE_MODEL']}", cost_tracking="ignore_errors", **model_cfg,
        model_kwargs={"api_base": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"],
                      "temperature": args.temperature})
    env = SandboxEnvironment(cwd=os.environ.get("GYRE_WORKSPACE", os.getcwd()), timeout=args.command_timeout)
    agent_cfg = {**(config.get("agent") or {}), "step_limit": args.step_limit, "cost_limit": 0}
    agent_cfg.pop("agent_class", None)
    agent_cfg.pop("mode", None)
    agent = DefaultAgent(model, env, **agent_cfg)
    result = agent.run(os.environ["GYRE_TASK"])
    print(f"mini-swe-agent: {result.get('exit_status', result) if isinstance(result, dict) else result}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))      # the project: gyre_core.sandbox
    sys.exit(main())
