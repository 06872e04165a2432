import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_core.config import ConfigError, GyreConfig, load_config, presets

ROOT = Path(__file__).resolve().parents[2]


def test_presets_load_and_differ():
    assert {"smoke", "quick", "default", "long"} <= set(presets())
    smoke, long = load_config("smoke"), load_config("long")
    assert smoke.rl.steps < long.rl.steps
    assert long.env.kwargs["level"] == "BabyAI-BossLevel-v0"


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config("quick", ["rl.lr=3e-4", "rollout.group_size=4", "harness.wall_clock_s=null",
                                "env.kwargs.level=BabyAI-PickupLoc-v0"])
    assert cfg.rl.lr == pytest.approx(3e-4)
    assert cfg.rollout.group_size == 4
    assert cfg.harness.wall_clock_s is None
    assert cfg.env.kwargs == {"level": "BabyAI-PickupLoc-v0"}


@pytest.mark.parametrize("override,message", [
    ("rl.lr=-1", "rl.lr: Input should be greater than 0 (got -1)"),
    ("rl.lrr=1", "rl.lrr: unknown key (allowed here: steps, lr,"),
    ("rollout.group_size=many", "rollout.group_size: Input should be a valid integer"),
    ("rl.advantage_norm=max", "rl.advantage_norm: Input should be 'none' or 'std'"),
    ("noequals", "override 'noequals': expected key=value"),
    ("harness.command=[python,agent.py] rollout.fork_k=2", "rollout.fork_k: forks copy Gyre's own harness"),
    ("harness.command=[python,agent.py]", "eval.random_baseline: the uniform-random floor needs Gyre's own harness"),
    ("proxy.host=0.0.0.0", "proxy.host '0.0.0.0' is not loopback: set proxy.admin_token"),
    ("rl.progress_credit=1 elastic.enabled=true", "rl.progress_credit: per-turn credit is given to flat sequences"),
    # each of these was accepted and failed later, some after the warm start
    ("rl.lr=.inf", "rl.lr: Input should be a finite number"),
    ("warmstart.lr=.nan", "warmstart.lr: Input should be a finite number"),
    ("model.num_kv_heads=3", "model.num_kv_heads: 3 key/value heads do not divide model.num_heads 2"),
    ("model.num_heads=3", "model.num_heads: 3 heads do not divide model.hidden_size 64"),
    ("run.seed=-1", "run.seed: Input should be greater than or equal to 0 (got -1)"),
    ("run.threads=-1", "run.threads: Input should be greater than or equal to 0 (got -1)"),
    ("run.name=../x", "run.name: '../x' is not a run id"),
    ("run.name=a/b", "run.name: 'a/b' is not a run id"),
    ("run.replay=.hidden", "run.replay: '.hidden' is not a run id"),
])
@pytest.mark.bad_input("config values")
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("smoke", override.split())
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.bad_input("a preset given as a path")
def test_a_preset_is_a_name_never_a_path(tmp_path):
    (tmp_path / "x.yaml").write_text("run: {seed: 3}\n")
    for name in (f"../../{tmp_path.name}/x", str(tmp_path / "x"), "smoke/../smoke"):
        with pytest.raises(ConfigError, match="preset: unknown preset"):
            load_config(name)


@pytest.mark.bad_input("an unknown preset")
def test_unknown_preset_lists_allowed():
    with pytest.raises(ConfigError, match=r"preset: unknown preset 'nope' \(allowed: agent, agent-long, agent-quick, coding-quick, coding-real, coding-smoke, default, elastic-quick, long, proxy-smoke, quick, real-quick, real-smoke, smoke\)"):
        load_config("nope")


def test_every_field_has_a_docstring():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                yield from walk(ann)
            elif name != "preset":
                yield f"{model.__name__}.{name}", field.description
    missing = [n for n, d in walk(GyreConfig) if not d]
    assert missing == []


@pytest.mark.bad_input("config errors at the CLI")
def test_cli_config_error_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "gyre_cli", "train", "--preset", "smoke", "--set", "rl.lr=0",
                           "--set", f"run.out_root={out}", "--set", f"lake.root={tmp_path / 'lake'}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == ["gyre: config error: rl.lr: Input should be greater than 0 (got 0)"]
    assert not out.exists() and not (tmp_path / "lake").exists()


def test_a_dict_value_replaces_and_a_dotted_key_merges():
    cfg = load_config("quick", ["env.kwargs={length: 4}"])
    assert cfg.env.kwargs == {"length": 4}
    cfg = load_config("quick", ["env.kwargs.max_steps=30"])
    assert cfg.env.kwargs == {"level": "BabyAI-GoToLocal-v0", "max_steps": 30}


def test_run_threads_sets_torchs_intra_op_threads_and_zero_leaves_them():
    import torch

    from gyre_core.config import apply_threads

    before = torch.get_num_threads()
    try:
        apply_threads(load_config("smoke", ["run.threads=1"]))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        apply_threads(load_config("smoke"))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def _gyre(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed `gyre` console script (what a user types), not `python -m`: its import path starts at its
    own bin/ directory, so a user's module in the working directory is found only because the CLI adds it."""
    script = Path(sys.executable).parent / "gyre"
    assert script.is_file(), f"no console script at {script}: install the project (scripts/install.sh)"
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_env_check_finds_a_users_module_in_the_working_directory(tmp_path):
    shutil.copy(ROOT / "examples" / "custom_env.py", tmp_path / "userenv.py")
    ok = _gyre("env-check", "userenv:GuessEnv", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == "userenv:GuessEnv: keeps the environment contract", ok.stderr
    bad = _gyre("env-check", "userenv:NoSuchEnv", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "gyre: env target 'userenv:NoSuchEnv': module 'userenv' has no attribute 'NoSuchEnv'"


@pytest.mark.bad_input("an unloadable env, a reused run name, an oversized fleet")
def test_train_refuses_an_unloadable_env_and_a_reused_run_name_in_one_line_before_any_work(tmp_path):
    """Both would stop the run at its first task; the CLI says so before Prefect starts or a file is written."""
    out, lake = tmp_path / "runs", tmp_path / "lake"
    common = ["train", "--preset", "smoke", "--set", f"run.out_root={out}", "--set", f"lake.root={lake}"]
    proc = _gyre(*common, "--set", "env.target=userenv:GuessEnv", "--set", "env.kwargs={}", cwd=tmp_path)
    assert proc.returncode == 2
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [
        "gyre: config error: env.target: env target 'userenv:GuessEnv': cannot import module 'userenv' "
        "(No module named 'userenv')"]
    assert not out.exists() and not lake.exists()

    from gyre_core.run import RunDir

    RunDir.create(load_config("smoke", [f"run.out_root={out}", f"lake.root={lake}"]))   # an earlier run, smoke-s0
    proc = _gyre(*common, "--set", "rl.lr=2e-4", cwd=tmp_path)
    assert proc.returncode == 2
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [
        f"gyre: config error: run.name: run 'smoke-s0' exists with a different config; choose another name "
        f"(--set run.name=NAME) or delete {out / 'smoke-s0'}"]
    assert not lake.exists()

    # a real fleet larger than this host: refused before the warm start (it was refused after it)
    import os

    cores = os.cpu_count()
    proc = _gyre(*common, "--set", "run.name=fleet", "--set", "elastic.enabled=true", "--set", "elastic.mode=real",
                 "--set", f"elastic.cells={cores + 1}", cwd=tmp_path)
    assert proc.returncode == 2
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [
        f"gyre: config error: elastic.cells: {cores + 1} real cells × 1 device(s) each need {cores + 1} CPU cores, "
        f"but {cores} are available; use fewer cells, or elastic.mode=emulated"]
    assert not (out / "fleet").exists() and not lake.exists()


def test_entropy_forks_need_an_engine_that_reports_entropy():
    with pytest.raises(ConfigError, match=r"rollout.fork_at: entropy-chosen forks .* engine.kind=local"):
        load_config("smoke", ["engine.kind=vllm", "rollout.fork_k=2", "rollout.fork_at=entropy"])
    assert load_config("smoke", ["engine.kind=vllm", "rollout.fork_k=2"]).rollout.fork_at == "uniform"


def test_real_presets_serve_a_pretrained_model_on_vllm():
    cfg = load_config("real-smoke")
    assert cfg.engine.kind == "vllm" and cfg.model.fetch == "smollm2-135m-instruct" and cfg.rl.tis_cap == 2.0


@pytest.mark.bad_input("literal secrets in lake.storage_options")
def test_lake_secrets_are_environment_references_never_literals(tmp_path, monkeypatch):
    """A literal credential in lake.storage_options is refused (it would land in config.yaml and MLflow);
    "${env:NAME}" is stored as written and read from the environment when the lake is opened."""
    from gyre_core.run import RunDir
    from gyre_core.tracking import flatten

    with pytest.raises(ConfigError, match=r"lake\.storage_options\.client_kwargs\.aws_secret_access_key holds a "
                                          r"literal secret"):
        load_config("smoke", ["lake.storage_options={client_kwargs: {aws_secret_access_key: hunter2}}"])
    with pytest.raises(ConfigError, match=r"lake\.storage_options\.secret holds a literal secret"):
        load_config("smoke", ["lake.storage_options={secret: hunter2}"])
    refs = {"key": "${env:GYRE_TEST_KEY}", "secret": "${env:GYRE_TEST_SECRET}", "anon": False,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    cfg = load_config("smoke", [f"run.out_root={tmp_path}", f"lake.storage_options={refs}"])
    monkeypatch.delenv("GYRE_TEST_SECRET", raising=False)
    monkeypatch.setenv("GYRE_TEST_KEY", "AKIA-test")
    with pytest.raises(ConfigError, match=r"names GYRE_TEST_SECRET, which is not set"):
        cfg.lake.resolved_storage_options()
    monkeypatch.setenv("GYRE_TEST_SECRET", "hunter2")
    assert cfg.lake.resolved_storage_options() == {
        "key": "AKIA-test", "secret": "hunter2", "anon": False,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    run = RunDir.create(cfg)
    written = (run.path / "config.yaml").read_text()
    params = flatten(cfg.model_dump(mode="json"))
    assert "hunter2" not in written and "hunter2" not in str(params)
    assert "${env:GYRE_TEST_SECRET}" in written and params["lake.storage_options.secret"] == "${env:GYRE_TEST_SECRET}"


@pytest.mark.bad_input("an env target or agent command the worker does not allow")
def test_a_workers_allow_lists_refuse_other_code_before_it_runs(tmp_path, monkeypatch):
    """GYRE_ALLOW_ENVS / GYRE_ALLOW_COMMANDS, set by whoever runs the worker: a target outside them is refused
    before its module is imported (its import would write a file), a command before it starts."""
    from gyre_core.phases.prepare import preflight

    (tmp_path / "sideeffect.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                            "def Env(**kw):\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = [f"run.out_root={tmp_path}/runs", f"lake.root={tmp_path}/lake"]
    monkeypatch.setenv("GYRE_ALLOW_ENVS", "gyre_core.envs.*:*, examples.custom_env:GuessEnv")
    for target in ("sideeffect:Env", "os:system"):
        with pytest.raises(ConfigError) as err:
            preflight(load_config("smoke", [*base, f"env.target={target}", "env.kwargs={}"]))
        assert str(err.value) == (f"env.target: {target!r} is not allowed on this machine "
                                  "(GYRE_ALLOW_ENVS='gyre_core.envs.*:*, examples.custom_env:GuessEnv')")
    assert not (tmp_path / "ran").exists()
    preflight(load_config("smoke", base))                                   # the preset's own env: allowed
    monkeypatch.setenv("GYRE_ALLOW_COMMANDS", "mini-swe-agent *")
    with pytest.raises(ConfigError, match=r"^harness.command: 'sh -c id' is not allowed on this machine"):
        preflight(load_config("smoke", [*base, "harness.command=sh -c id", "eval.random_baseline=false"]))
    monkeypatch.setenv("GYRE_ALLOW_ENVS", "")                               # empty: nothing is allowed
    cfg = load_config("smoke", base)
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert str(err.value) == f"env.target: {cfg.env.target!r} is not allowed on this machine (GYRE_ALLOW_ENVS='')"


def test_relative_data_paths_live_in_the_gyre_home(tmp_path, monkeypatch):
    """GYRE_HOME, else the current directory: resolved once when the config loads, so any later command or
    worker finds the same run, lake and MLflow store; URLs and absolute paths stay as written."""
    import yaml

    from gyre_core.run import RunDir

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("GYRE_HOME", str(home))
    cfg = load_config("smoke", ["trainer.publish_root=pub", "lake.storage_options={}"])
    assert (cfg.run.out_root, cfg.lake.root, cfg.trainer.publish_root) == (
        str(home / "data/runs"), str(home / "data/lake"), str(home / "pub"))
    assert cfg.tracking.uri == f"sqlite:///{home}/data/mlflow/mlflow.db"
    kept = load_config("smoke", ["lake.root=s3://bucket/lake", f"run.out_root={tmp_path}/abs",
                                 "tracking.uri=sqlite:////var/x.db"])
    assert (kept.lake.root, kept.run.out_root, kept.tracking.uri) == ("s3://bucket/lake", f"{tmp_path}/abs",
                                                                      "sqlite:////var/x.db")
    monkeypatch.delenv("GYRE_HOME")
    assert load_config("smoke").run.out_root == str(elsewhere / "data/runs")       # unset: the current directory
    # a run whose config.yaml holds the paths relative (as earlier Gyre wrote them) is the same run
    monkeypatch.setenv("GYRE_HOME", str(home))
    run = RunDir.create(cfg)
    old = yaml.safe_load((run.path / "config.yaml").read_text())
    old["run"]["out_root"], old["lake"]["root"] = "data/runs", "data/lake"
    (run.path / "config.yaml").write_text(yaml.safe_dump(old))
    monkeypatch.chdir(home)
    RunDir.check_reusable(load_config("smoke", ["trainer.publish_root=pub", "lake.storage_options={}"]))
