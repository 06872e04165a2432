"""What a run's config may make a worker execute, when the operator of the worker limits it.

A config names code to run: `env.target` is any importable callable, `harness.command` any program. So
whoever can start a run with overrides can run code on the machine that executes it. That is `gyre train`
in your own shell, but also a deployment run started through a Prefect server's API or UI, on whichever
worker picks it up. On a laptop that is you. On a shared server, give access to the Prefect API (its basic
auth) only to people you would give a shell on the workers, and limit what runs there by setting, in each
worker's environment:

    GYRE_ALLOW_ENVS="gyre_core.envs.*:*,mylab.games:TextGame"   # fnmatch patterns over env.target
    GYRE_ALLOW_COMMANDS="mini-swe-agent *"                       # over harness.command, words joined by spaces

Unset, anything goes. Set, a target or command that matches no pattern is a config error, raised before the
module is imported or the program started; an empty value allows nothing.
"""
from __future__ import annotations

import fnmatch
import os


def _patterns(var: str) -> list[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return [p.strip() for p in value.split(",") if p.strip()]


def _check(var: str, field: str, what: str) -> None:
    allowed = _patterns(var)
    if allowed is not None and not any(fnmatch.fnmatchcase(what, p) for p in allowed):
        from .config import ConfigError

        raise ConfigError(f"{field}: {what!r} is not allowed on this machine ({var}={os.environ[var]!r})")


def check_env_target(target: str) -> None:
    """Refuse `target` unless GYRE_ALLOW_ENVS allows it (or is unset)."""
    _check("GYRE_ALLOW_ENVS", "env.target", target)


def check_command(argv: list[str]) -> None:
    """Refuse `argv` unless GYRE_ALLOW_COMMANDS allows it (or is unset)."""
    _check("GYRE_ALLOW_COMMANDS", "harness.command", " ".join(argv))
