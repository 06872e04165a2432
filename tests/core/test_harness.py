"""The harness: append-only TITO contexts, compaction, limits, failures — on a scripted env with a real
locally trained tokenizer (the same code path as the BabyAI runs)."""
import pytest

from gyre_core.config import HarnessConfig
from gyre_core.envs.scripted import ScriptedEnv
from gyre_core.harness.conversation import ChatFormat
from gyre_core.harness.loop import ExecutionSpec, ForkEvent, fork_tree, run_executions
from gyre_core.harness.policies import ExpertPolicy, RandomPolicy
from gyre_core.model import IM_END, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    env = ScriptedEnv(length=6)
    return train_tokenizer(list(env.corpus(20, 0)) + [env.instructions()], vocab_size=300)


def _run(tok, cfg, make_env=lambda: ScriptedEnv(length=6), policy=None, n=3):
    fmt = ChatFormat(tok)
    stop = tok.convert_tokens_to_ids(IM_END)
    specs = [ExecutionSpec("r", 0, f"e{i}", "t", i, "train") for i in range(n)]
    policy = policy or ExpertPolicy(tok, stop)
    return run_executions(specs, policy, cfg, make_env, fmt, {stop: IM_END}, concurrency=2)


def test_contexts_are_append_only_token_for_token(tok):
    recs = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096))
    for r in recs:
        assert r.status == "done" and r.success and r.partial == 1.0
        assert r.turns == 6 and r.compactions == 0
        for prev, cur in zip(r.calls, r.calls[1:]):
            head = prev.prompt_ids + prev.completion_ids
            assert cur.prompt_ids[:len(head)] == head          # TITO: turn k+1 extends turn k exactly
            assert (cur.parent_call, cur.prefix_len) == (prev.call_index, len(head))
            # the appended text is the template's continuation, decoded back exactly
            added = tok.decode(cur.prompt_ids[len(head):])
            assert added.startswith("\n<|im_start|>user\n") and added.endswith("<|im_end|>\n<|im_start|>assistant\n")
        # the first prompt is exactly the chat template's rendering of instructions + mission + observation
        env = ScriptedEnv(length=6)
        obs = env.reset(r.seed)
        text = tok.apply_chat_template(
            [{"role": "system", "content": env.instructions()},
             {"role": "user", "content": f"Mission: {env.mission()}\n{obs}"}],
            tokenize=False, add_generation_prompt=True)
        assert tok.decode(r.calls[0].prompt_ids) == text
        assert tok.decode(r.calls[0].completion_ids) == "forward" + IM_END


def test_compaction_opens_a_new_context_from_the_summary(tok):
    first = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096), n=1)[0]
    budget = len(first.calls[2].prompt_ids) + 4      # room for about three turns
    r = _run(tok, HarnessConfig(max_turns=50, context_tokens=budget, max_new_tokens=4), n=1)[0]
    assert r.success and r.compactions >= 1
    for c in r.calls:
        assert len(c.prompt_ids) + 4 <= budget
    new_ctx = [c for c in r.calls if c.parent_call == -1]
    assert len(new_ctx) == r.compactions + 1
    second = new_ctx[1]
    assert second.role == "main-summary" and second.context_index == 1 and second.prefix_len == 0
    assert "Mission:" in tok.decode(second.prompt_ids)


def test_turn_limit_scores_what_was_left(tok):
    stop = tok.convert_tokens_to_ids(IM_END)

    class Waiter(ExpertPolicy):
        def choose(self, env):
            return "forward" if env._s["pos"] < 2 else "wait"

    r = _run(tok, HarnessConfig(max_turns=5, context_tokens=4096), policy=Waiter(tok, stop), n=1)[0]
    assert r.status == "turn_limit" and r.turns == 5
    assert not r.success and r.partial == pytest.approx(2 / 6)
    # each call carries where the corridor walk stood when it was made: cells 0, 1, then 2 (waiting) of 6
    assert [c.progress for c in r.calls] == pytest.approx([0, 1 / 6, 2 / 6, 2 / 6, 2 / 6])


def test_invalid_actions_are_answered_and_counted(tok):
    stop = tok.convert_tokens_to_ids(IM_END)

    class Babbler(ExpertPolicy):
        said = False

        def choose(self, env):
            if not self.said:
                self.said = True
                return "jump"
            return "forward"

    r = _run(tok, HarnessConfig(max_turns=20, context_tokens=4096), policy=Babbler(tok, stop), n=1)[0]
    assert r.invalid_actions == 1 and r.success and r.turns == 7
    # each action the environment ran is one tool invocation, named after its call; the babble is none
    assert [c.tool_call_ids for c in r.calls] == [[]] + [[f"e0/{i}"] for i in range(1, 7)]


def test_an_imperfect_expert_takes_the_random_action_its_seed_and_turn_draw(tok):
    import random

    stop = tok.convert_tokens_to_ids(IM_END)
    cfg = HarnessConfig(max_turns=30, context_tokens=4096)
    recs = _run(tok, cfg, policy=ExpertPolicy(tok, stop, epsilon=0.5, seed=7), n=4)
    again = _run(tok, cfg, policy=ExpertPolicy(tok, stop, epsilon=0.5, seed=7), n=4)
    taken = [[tok.decode(c.completion_ids[:-1]) for c in r.calls] for r in recs]
    assert taken == [[tok.decode(c.completion_ids[:-1]) for c in r.calls] for r in again]
    for r, acts in zip(recs, taken):     # the corridor by hand: 6 cells, 18 steps at most, `done` ends it
        pos, want = 0, []
        for turn in range(cfg.max_turns):
            rng = random.Random(f"7:{r.seed}:{turn}")
            a = rng.choice(ScriptedEnv.actions) if rng.random() < 0.5 else "forward"
            want.append(a)
            pos = pos + 1 if a == "forward" else max(pos - 1, 0) if a == "back" else pos
            if a == "done" or pos >= 6 or turn + 1 >= 18:
                break
        assert acts == want and r.success == (pos >= 6)
    assert any(a != "forward" for acts in taken for a in acts)    # the noise did act


@pytest.mark.fault("an environment that raises", "that execution fails with its reason; the others go on")
def test_env_exception_fails_one_execution_and_the_rest_go_on(tok):
    class Exploding(ScriptedEnv):
        def step(self, action):
            if self._s["seed"] == 1 and self._s["steps"] == 2:
                raise RuntimeError("sandbox died")
            return super().step(action)

    recs = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096), make_env=lambda: Exploding(6), n=3)
    assert [r.status for r in recs] == ["done", "failed", "done"]
    assert recs[1].error == "RuntimeError: sandbox died" and len(recs[1].calls) == 3


def test_random_policy_uses_only_env_actions(tok):
    stop = tok.convert_tokens_to_ids(IM_END)
    recs = _run(tok, HarnessConfig(max_turns=10, context_tokens=4096), policy=RandomPolicy(tok, stop, seed=3), n=4)
    for r in recs:
        for c in r.calls:
            assert tok.decode(c.completion_ids[:-1]) in ScriptedEnv.actions
            assert c.completion_ids[-1] == stop


def test_failures_at_start_or_in_compaction_end_only_their_execution(tok):
    class Broken(ScriptedEnv):
        def reset(self, seed):
            if seed == 2:
                raise OSError("no sandbox")
            return super().reset(seed)

        def summary(self):
            if self._s["seed"] == 1:
                raise ValueError("cannot summarise")
            return super().summary()

    first = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096), n=1)[0]
    budget = len(first.calls[2].prompt_ids) + 4   # forces a compaction after about three turns
    recs = _run(tok, HarnessConfig(max_turns=50, context_tokens=budget, max_new_tokens=4),
                make_env=lambda: Broken(6), n=3)
    assert [r.status for r in recs] == ["done", "failed", "failed"]
    assert recs[1].error == "ValueError: cannot summarise" and recs[1].turns >= 2
    assert recs[2].error == "OSError: no sandbox" and recs[2].turns == 0


def test_a_first_context_over_budget_stops_with_a_token_limit(tok):
    recs = _run(tok, HarnessConfig(max_turns=50, context_tokens=40, max_new_tokens=4), n=1)
    assert recs[0].status == "token_limit" and recs[0].turns == 0 and recs[0].partial == 0.0


@pytest.mark.fault("an evaluator that raises", "retried, then the execution is excluded with its reason")
def test_a_failing_evaluator_is_retried_then_the_execution_excluded_with_its_reason(tok):
    class Flaky(ScriptedEnv):
        failures = 0

        def score(self):
            if Flaky.failures < 2:
                Flaky.failures += 1
                raise KeyError("evaluator crashed")
            return super().score()

    r = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096, score_retries=2), make_env=lambda: Flaky(6), n=1)[0]
    assert r.status == "done" and r.success and r.partial == 1.0 and Flaky.failures == 2
    Flaky.failures = 0
    r = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096, score_retries=1), make_env=lambda: Flaky(6), n=1)[0]
    assert r.status == "failed" and r.turns == 6
    assert r.error == "score failed after 2 attempts: KeyError: 'evaluator crashed'"


def test_an_evaluator_runs_off_the_critical_path_and_frees_its_slot(tok):
    """One slot, two executions: the first one's evaluator waits until the second has taken three steps, which
    it can only do if the evaluator runs beside the rollout and the ended execution's slot went to the next."""
    import threading
    import time

    second_stepped = threading.Event()

    class Waits(ScriptedEnv):
        def step(self, action):
            out = super().step(action)
            if self._s["seed"] == 1 and self._s["steps"] == 3:
                second_stepped.set()
            return out

        def score(self):
            if self._s["seed"] == 0:
                t0 = time.time()
                if not second_stepped.wait(timeout=30):
                    raise TimeoutError("the second execution never ran while this one was scored")
                Waits.waited, Waits.scored_at = time.time() - t0, time.time()
            return super().score()

    fmt, stop = ChatFormat(tok), tok.convert_tokens_to_ids(IM_END)
    specs = [ExecutionSpec("r", 0, f"e{i}", "t", i, "train") for i in range(2)]
    settled = []
    recs = run_executions(specs, ExpertPolicy(tok, stop), HarnessConfig(max_turns=50, context_tokens=4096,
                                                                       score_retries=0, score_workers=2),
                          lambda: Waits(length=6), fmt, {stop: IM_END}, concurrency=1, on_finish=settled.append)
    assert [r.status for r in recs] == ["done", "done"] and all(r.success for r in recs)
    assert sorted(r.execution_id for r in settled) == ["e0", "e1"]      # each handed on once, scored
    first, second = recs
    # the second execution's model calls began after the first's last one and before its evaluator ended
    assert first.t_end <= second.calls[0].t_start
    assert second.calls[2].t_end <= Waits.scored_at
    assert first.evaluator_s >= Waits.waited > 0 and 0 < second.evaluator_s < first.evaluator_s


def test_nothing_to_score_gets_the_placeholder_zero(tok):
    class Blank(ScriptedEnv):
        def score(self):
            return None

    r = _run(tok, HarnessConfig(max_turns=50, context_tokens=4096), make_env=lambda: Blank(6), n=1)[0]
    assert r.status == "done" and not r.success and r.partial == 0.0 and r.error == ""


def test_forks_continue_from_a_saved_state_and_share_their_prefix_in_the_lake(tok):
    from gyre_core.lake.schema import calls_table, executions_table, read_executions

    stop = tok.convert_tokens_to_ids(IM_END)
    fmt = ChatFormat(tok)
    kids = [ExecutionSpec("r", 0, f"kid{j}", "t", 5, "train") for j in range(2)]
    root = ExecutionSpec("r", 0, "root", "t", 5, "train", forks=[ForkEvent(2, kids)])
    late_kid = ExecutionSpec("r", 0, "late", "u", 6, "train")
    early = ExecutionSpec("r", 0, "early", "u", 6, "train", forks=[ForkEvent(40, [late_kid])])   # hits max_turns first
    specs = [root, *kids, early, late_kid]
    class Wanderer(RandomPolicy):   # never says "done", so the root lives past its fork turn
        def choose(self, env):
            return self.rng.choice(["forward", "back", "wait"])

    recs = run_executions(specs, Wanderer(tok, stop, seed=11), HarnessConfig(max_turns=12, context_tokens=4096),
                          lambda: ScriptedEnv(length=6), fmt, {stop: IM_END}, concurrency=8)
    by = {r.execution_id: r for r in recs}
    for k in ("kid0", "kid1"):
        kid = by[k]
        assert (kid.fork_of, kid.fork_call) == ("root", 2)
        assert kid.calls[:2] == by["root"].calls[:2]          # the same two calls, token for token
        # the third prompt continues from the state at the fork: the same observation as the root saw
        assert kid.calls[2].prompt_ids == by["root"].calls[2].prompt_ids
    assert by["late"].fork_of == "" and by["late"].calls[0].prompt_ids == by["early"].calls[0].prompt_ids
    # stored once: the kids' shared calls are not written again, and reading rebuilds them exactly
    table = calls_table(recs)
    stored = {(e, i) for e, i in zip(table.column("execution_id").to_pylist(), table.column("call_index").to_pylist())}
    assert ("kid0", 0) not in stored and ("kid0", 2) in stored and ("root", 0) in stored
    again = {r.execution_id: r for r in read_executions(executions_table(recs), table)}
    without_root = [r for r in recs if r.execution_id != "root"]
    with pytest.raises(ValueError, match="forked from 'root', which is not in this read"):
        read_executions(executions_table(without_root), table)
    for r in recs:
        got = again[r.execution_id]
        assert [c.prompt_ids for c in got.calls] == [c.prompt_ids for c in r.calls]
        assert [c.completion_ids for c in got.calls] == [c.completion_ids for c in r.calls]
        assert (got.fork_of, got.fork_call) == (r.fork_of, r.fork_call)


def test_entropy_forking_forks_at_the_first_unsure_call_in_the_window(tok):
    stop = tok.convert_tokens_to_ids(IM_END)

    class Scripted:
        """A fake model: 'forward' always; its first-token entropy is high only at call 3."""

        def __init__(self):
            self.ids = list(tok.encode("forward", add_special_tokens=False)) + [stop]

        def complete(self, calls):
            from gyre_core.harness.loop import Completion
            return [Completion(self.ids, [0.0] * len(self.ids), "stop", 0,
                               entropy=2.0 if c.execution.record.turns == 3 else 0.1) for c in calls]

        def release(self, key):
            pass

    def run(threshold, window):
        kid = ExecutionSpec("r", 0, "kid", "t", 1, "train")
        root = ExecutionSpec("r", 0, "root", "t", 1, "train",
                             forks=[ForkEvent(window[0], [kid], until=window[1], entropy=threshold)])
        recs = run_executions([root, kid], Scripted(), HarnessConfig(max_turns=20, context_tokens=4096),
                              lambda: ScriptedEnv(length=8), ChatFormat(tok), {stop: IM_END}, concurrency=4)
        return recs[1]

    assert run(1.0, (1, 6)).fork_call == 3     # the first unsure call
    assert run(5.0, (1, 6)).fork_call == 6     # none reaches 5 nats: the window's end
    assert run(1.0, (4, 6)).fork_call == 6     # the unsure call came before the window


def test_fork_trees_nest_and_the_lake_rebuilds_every_level(tok):
    import random

    from gyre_core.lake.schema import calls_table, executions_table, read_executions

    stop = tok.convert_tokens_to_ids(IM_END)

    class Wanderer(RandomPolicy):
        def choose(self, env):
            return self.rng.choice(["forward", "back", "wait"])

    group = [ExecutionSpec("r", 0, f"g{i}", "t", 3, "train") for i in range(8)]
    fork_tree(group, k=2, depth=3, window=(2, 3), rng=random.Random(0))
    # one root; 3 levels of binary forks: the root forks three times, each child once per later level
    assert [len(s.forks) for s in group] == [3, 2, 1, 1, 0, 0, 0, 0]
    recs = run_executions(group, Wanderer(tok, stop, seed=5), HarnessConfig(max_turns=14, context_tokens=4096),
                          lambda: ScriptedEnv(length=30), ChatFormat(tok), {stop: IM_END}, concurrency=8)
    by = {r.execution_id: r for r in recs}
    forked = [r for r in recs if r.fork_of]
    assert len(forked) == 7 and any(by[r.fork_of].fork_of for r in forked)   # forks of forks happened
    for r in forked:
        assert r.calls[:r.fork_call] == by[r.fork_of].calls[:r.fork_call]
    # exact accounting: every generated token is counted once, by the execution that generated it
    unique_calls = {id(c): c for r in recs for c in r.calls}
    assert sum(r.tokens_generated for r in recs) == sum(len(c.completion_ids) for c in unique_calls.values())
    again = {r.execution_id: r for r in read_executions(executions_table(recs), calls_table(recs))}
    for r in recs:
        assert [c.prompt_ids + c.completion_ids for c in again[r.execution_id].calls] == \
            [c.prompt_ids + c.completion_ids for c in r.calls]


def test_a_fork_root_that_cannot_start_lets_its_children_start_afresh(tok):
    import random

    class Dead(ScriptedEnv):
        calls = 0

        def reset(self, seed):
            Dead.calls += 1
            if Dead.calls == 1:
                raise OSError("sandbox refused")
            return super().reset(seed)

    stop = tok.convert_tokens_to_ids(IM_END)
    group = [ExecutionSpec("r", 0, f"g{i}", "t", 3, "train") for i in range(4)]
    fork_tree(group, k=2, depth=2, window=(2, 3), rng=random.Random(0))
    recs = run_executions(group, ExpertPolicy(tok, stop), HarnessConfig(max_turns=20, context_tokens=4096),
                          lambda: Dead(6), ChatFormat(tok), {stop: IM_END}, concurrency=4)
    assert [r.status for r in recs] == ["failed", "done", "done", "done"]
    assert all(r.fork_of == "" or r.fork_of != "g0" for r in recs)
    with pytest.raises(ValueError, match="not whole trees"):
        fork_tree(group[:3], k=2, depth=2, window=(2, 3), rng=random.Random(0))


class PhraseCorridor:
    """The corridor with phrase commands, a `reset` told the split, and a `close` that counts."""

    name = "phrase-corridor"
    actions = ("walk forward", "walk back", "wait here", "say done")
    words = dict(zip(actions, ScriptedEnv.actions))
    closed: list[tuple[int, str]] = []

    def __init__(self, length: int) -> None:
        self.inner, self.split = ScriptedEnv(length=length), None

    def instructions(self):
        return "You walk a corridor; answer with one of: " + ", ".join(self.actions) + "."

    def reset(self, seed, split):
        self.split = split
        return self.inner.reset(seed)

    def step(self, action):
        if self.inner._s["seed"] == 2 and self.inner._s["steps"] == 1:
            raise RuntimeError("the game process died")
        return self.inner.step(self.words.get(action.strip(), "no such command"))

    def expert_action(self):
        word = self.inner.expert_action()
        return next(p for p, w in self.words.items() if w == word) if word else None

    def mission(self):
        return self.inner.mission()

    def score(self):
        return self.inner.score()

    def summary(self):
        return self.inner.summary()

    def close(self):
        PhraseCorridor.closed.append((self.inner._s["seed"], self.split))


def test_phrase_actions_the_split_and_close_reach_the_environment(tok):
    from gyre_core.envs import check_environment

    assert check_environment(PhraseCorridor(length=3), seeds=(0, 1)) == []      # phrases keep the contract
    PhraseCorridor.closed.clear()
    fmt, stop = ChatFormat(tok), tok.convert_tokens_to_ids(IM_END)
    splits = ["train", "eval-sampled", "demo", "control-demo", "eval-random"]
    specs = [ExecutionSpec("r", 0, f"e{i}", "t", i, s) for i, s in enumerate(splits)]
    recs = run_executions(specs, ExpertPolicy(tok, stop), HarnessConfig(max_turns=20, context_tokens=4096),
                          lambda: PhraseCorridor(length=3), fmt, {stop: IM_END}, concurrency=2)
    assert [r.status for r in recs] == ["done", "done", "failed", "done", "done"]
    assert recs[2].error == "RuntimeError: the game process died"
    for r in recs[:2] + recs[3:]:
        assert r.success and [tok.decode(c.completion_ids[:-1]) for c in r.calls] == ["walk forward"] * 3
    # every execution's environment closed exactly once, failed one included, each told its split
    assert sorted(PhraseCorridor.closed) == [(0, "train"), (1, "eval"), (2, "demo"), (3, "demo"), (4, "eval")]
