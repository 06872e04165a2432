"""BabyAI levels (from the `minigrid` package) as a text environment.

    from gyre_core.envs.babyai import BabyAIEnv
    env = BabyAIEnv("BabyAI-GoToLocal-v0")
    print(env.mission(), env.reset(0))
    print(env.step("forward"), env.score())

Actions: `left right forward pickup drop toggle done` (minigrid's action set). A completion is parsed
leniently: stripped, lowercased, its first word with surrounding punctuation removed must be exactly
one of those words; anything else gives valid=False, an error message, and no change of state.
`done` ends the episode (the verifier still sees it, so `done` while facing a GoTo target succeeds).

Observation (egocentric, from the agent's 7x7 partial view, deterministic, ~15-35 words):

    carry: nothing. front: empty. free: ahead 3 left 1 right 2. see: green ball a2 r1, closed red door a4 l3.

- `carry`: the carried object or `nothing`; `front`: the cell directly ahead (`wall`, `empty`,
  `closed red door`, `green key`, ...);
- `free`: how many cells one can walk ahead / to the left / to the right before something blocks
  (a wall, closed door or object; open doors are passable), limited to what the view shows
  (at most 6 ahead and 3 to each side);
- `see`: doors and objects in view, nearest first (ahead + sideways distance, then fewer cells ahead,
  then left before right), at most 6, each with its offset: `a2 r1` = 2 cells ahead, 1 to the right
  (`l` = left). Cells hidden behind walls are not shown. `see: nothing.` when empty.

Score (from the state left behind; BabyAI's own instruction objects `env.instrs`):
  success = the env reported success (reward > 0 when it terminated); partial = 1.0 on success.
  Otherwise, with closeness(d) = 1 - min(d, d_max)/d_max, d = Manhattan distance (walls ignored) from
  the agent to the nearest object matching the description, d_max = (width - 3) + (height - 3),
  each leaf instruction is worth:
    verified done by BabyAI's verifier ........................... 1.0
    GoTo .......................................................... 0.5 * closeness(d)
    Pickup: not carrying a match 0.5 * closeness(d); carrying a match (not yet counted) 0.75
    Open:   no matching door open 0.5 * closeness(d to a matching door); one open (not counted) 0.75
    PutNext: an object to move is next to a fixed one (not counted) 0.75; carrying an object to move
             0.5 + 0.25 * closeness(d to the nearest fixed object); else 0.25 * closeness(d to it)
  Sequences (Before/After/And): partial = sum of the leaf values / number of leaves, where leaves of
  an ordered sequence that are not current yet (e.g. `b` of "a, then b" before `a` is done) are worth 0
  and the sequence's `a_done`/`b_done` say which parts are done. "Not counted" states arise only when a
  part was achieved out of order (BabyAI counts it only while current); a non-success is capped at 0.99.
  details: subgoals_done, subgoals, distance (d of the first unfinished leaf, 0 if none), steps.

Expert (`expert_action`): minigrid's BabyAIBot, created lazily after reset and replanned once per
step. When the executed action differs from its suggestion, the bot is told so (`replan(action_taken)`,
its advising mode, which keeps its map of explored cells); when it missed a state (the expert was not
asked before a step) or fails in advising mode, a fresh bot is built from the current state, planning
only the parts of the instruction not done yet. Returns None if even a fresh bot fails (e.g. after a
box was opened) or loops (given up after `_BOT_CALL_BUDGET` Python calls). Measured with 30% random
actions mixed in, 30 seeds: advising mode solves BossLevel 30/30 (mean 134 steps), rebuilding the bot
after every deviation 12/30 (it forgets what it explored).
Speed: the env is stepped unwrapped (no gymnasium wrappers) and the observation text is built from the
7x7 encoding minigrid already computes in `step`; nothing is rendered as an image.
"""
from __future__ import annotations

import contextlib
import copy
import io
import random
import string
import sys
from collections.abc import Iterator
from typing import Any

import gymnasium
import minigrid  # noqa: F401  (importing it registers the BabyAI levels with gymnasium)
from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT
from minigrid.envs.babyai.core.verifier import (
    ActionInstr, AfterInstr, AndInstr, GoToInstr, OpenInstr, PickupInstr, PutNextInstr,
    pos_next_to,
)

from gyre_core.envs.protocol import Score, StepResult
from gyre_core.seeds import stream

ACTIONS = ("left", "right", "forward", "pickup", "drop", "toggle", "done")  # minigrid's indices 0..6
_ACTION_INDEX = {a: i for i, a in enumerate(ACTIONS)}
_DOOR_STATES = ("open", "closed", "locked")
_SHOWN_TYPES = frozenset(("door", "key", "ball", "box", "goal", "lava"))
_PASSABLE = frozenset(("empty", "floor", "goal"))
_MAX_SEEN = 6
# A bot's construction or replan makes ≤ ~1.5k Python calls (the most over 2660 of an ε = 0.5 demonstrator
# on GoToLocal: 1188; on BossLevel at ε = 0.3: 1411). minigrid's bot can loop forever in some states
# (e.g. `_find_drop_pos` when it carries an object it has nowhere to drop), growing memory as it goes;
# past this many calls it is given up and the state has no expert action.
_BOT_CALL_BUDGET = 200_000
_PUNCT = string.punctuation


class BabyAIEnv:
    """One BabyAI level as a text environment (see the module docstring for the formats)."""

    actions = ACTIONS

    def __init__(self, level: str = "BabyAI-GoToLocal-v0", max_steps: int | None = None) -> None:
        if not level.startswith("BabyAI-") or level not in gymnasium.registry:
            raise ValueError(
                f"unknown BabyAI level {level!r}; expected a registered id like 'BabyAI-GoToLocal-v0'")
        self.name = level
        self._max_steps = max_steps
        self._u: Any = gymnasium.make(level, disable_env_checker=True).unwrapped
        self._obs = ""
        self._done = True
        self._success = False
        self._bot: Any = None      # BabyAIBot in sync with the current state, or None
        self._expert: int | None = None  # the bot's suggestion for the current state, if computed
        self._taken: int | None = None   # the action executed instead of the bot's suggestion

    @property
    def unwrapped(self) -> Any:
        """The minigrid level object (for tests and tools that build states by hand)."""
        return self._u

    # --- the Protocol -------------------------------------------------------------------------------
    def instructions(self) -> str:
        return ("You are an agent in a grid world; each turn answer with one action word: "
                + ", ".join(ACTIONS) + ".")

    def reset(self, seed: int) -> str:
        # minigrid prints every rejected level sample; silence it (stdout is process-wide, so a print
        # from another thread during these milliseconds is silenced too)
        with contextlib.redirect_stdout(io.StringIO()):
            obs, _ = self._u.reset(seed=seed)
        if self._max_steps is not None:
            self._u.max_steps = self._max_steps
        self._done, self._success = False, False
        self._bot, self._expert, self._taken = None, None, None
        self._obs = render_observation(obs["image"].tolist(), self._u.carrying)
        return self._obs

    def mission(self) -> str:
        return self._u.mission

    def step(self, action: str) -> StepResult:
        word = parse_action(action)
        if word is None:
            shown = action.strip()[:20]
            return StepResult(f"invalid action {shown!r}; answer with one of: {', '.join(ACTIONS)}",
                              done=self._done, valid=False)
        if self._done:
            return StepResult(self._obs, done=True)
        index = _ACTION_INDEX[word]
        obs, reward, terminated, truncated, _ = self._u.step(index)
        if self._bot is not None and self._expert is not None:  # the bot saw the state before this step
            self._taken = None if index == self._expert else index
        else:  # the bot skipped a state (the expert was not asked): it is out of sync
            self._bot, self._taken = None, None
        self._expert = None
        self._success = bool(terminated and reward > 0)
        self._done = bool(terminated or truncated or word == "done")
        self._obs = render_observation(obs["image"].tolist(), self._u.carrying)
        return StepResult(self._obs, done=self._done)

    def score(self) -> Score:
        leaves, total = _leaf_values(self._u, self._u.instrs, verified=False)
        n = len(leaves)
        done = n if self._success else sum(1 for v, _ in leaves if v == 1.0)
        distance = 0 if self._success else next((d for v, d in leaves if v < 1.0 and d is not None), 0)
        partial = 1.0 if self._success else min(total / n, 0.99)
        details = {"subgoals_done": float(done), "subgoals": float(n), "distance": float(distance),
                   "steps": float(self._u.step_count)}
        return Score(success=self._success, partial=partial, details=details)

    def progress(self) -> float:
        """The partial score of the state now (1.0 once solved): the subgoals' closeness."""
        return self.score().partial

    def summary(self) -> str:
        s = self.score().details
        return (f"mission: {self.mission()}. steps {self._u.step_count}. "
                f"subgoals done {int(s['subgoals_done'])}/{int(s['subgoals'])}. {self._obs}")

    # --- optional hooks -----------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        if self._done:
            return None
        if self._expert is None:
            self._expert = self._ask_bot()
            if self._expert is None:
                return None
        return ACTIONS[self._expert]

    def corpus(self, episodes: int, seed: int) -> Iterator[str]:
        """Instructions, then per episode: mission, observations, actions (mostly the expert's, a
        fifth random), one error message and the final summary. Uses its own env instance."""
        env = BabyAIEnv(self.name, self._max_steps)
        yield env.instructions()
        for e in range(episodes):
            rng = random.Random(stream(seed, e))
            yield env.reset(seed + e)
            yield env.mission()
            yield env.step(rng.choice(("go", "north", "jump", "pick up", "?", ""))).observation
            for _ in range(128):
                action = env.expert_action()
                if action is None or rng.random() < 0.2:
                    action = rng.choice(ACTIONS[:-1])
                yield action
                result = env.step(action)
                yield result.observation
                if result.done:
                    break
            yield env.summary()

    def save_state(self) -> object:
        return copy.deepcopy(
            (self._u, self._bot, self._expert, self._taken, self._obs, self._done, self._success))

    def restore_state(self, state: object) -> None:
        (self._u, self._bot, self._expert, self._taken, self._obs, self._done,
         self._success) = copy.deepcopy(state)  # type: ignore[misc]

    # --- helpers ------------------------------------------------------------------------------------
    def observe(self) -> str:
        """Re-render the observation from the level's current state (after editing it by hand)."""
        self._obs = render_observation(self._u.gen_obs()["image"].tolist(), self._u.carrying)
        self._bot, self._expert, self._taken = None, None, None
        return self._obs

    def _ask_bot(self) -> int | None:
        """The bot's action index for the current state: advising mode first, then a fresh bot."""
        if self._bot is not None:
            taken, self._taken = self._taken, None
            try:
                return int(_within_calls(lambda: self._bot.replan(taken), _BOT_CALL_BUDGET))
            except Exception:  # the bot can fail on states it did not expect; rebuild it
                pass
        try:
            self._bot = _within_calls(self._new_bot, _BOT_CALL_BUDGET)
            return int(_within_calls(self._bot.replan, _BOT_CALL_BUDGET))
        except Exception:  # e.g. DisappearedBoxError, or a bot that loops: no demonstration from here
            self._bot = None
            return None

    def _new_bot(self) -> Any:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        bot = BabyAIBot(self._u)
        # Plan only what is left: the bot's constructor plans the whole instruction, which would
        # redo finished parts of a sequence when the bot is rebuilt mid-episode. `_process_instr`
        # pushes onto a stack, so push the remaining leaves last-to-first.
        bot.stack = []
        for leaf in reversed(_remaining_leaves(self._u.instrs)):
            bot._process_instr(leaf)
        return bot


class BotStuck(RuntimeError):
    """The expert bot ran past its call budget (`_within_calls`)."""


def _within_calls(fn, budget: int):
    """`fn()`, given up with `BotStuck` once it has made `budget` Python function calls: a deterministic
    bound (the same state gives up at the same point on any machine), unlike a wall-clock timeout. Only
    call events are traced (no per-line tracing), so the bot runs at nearly full speed; whatever tracer
    was set (a debugger, coverage) is put back afterwards."""
    left = budget

    def on_call(frame, event, arg):
        nonlocal left
        left -= 1
        if left < 0:
            raise BotStuck(f"the expert bot made more than {budget} calls")
        return None   # no line events inside the frame

    before = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(before)


def parse_action(text: str) -> str | None:
    """The action word of a completion, or None: strip, lowercase, first word, trim punctuation."""
    words = text.strip().lower().split(maxsplit=1)
    if not words:
        return None
    word = words[0].strip(_PUNCT)
    return word if word in _ACTION_INDEX else None


def _cell_name(cell: list[int]) -> str:
    kind = IDX_TO_OBJECT[cell[0]]
    if kind == "door":
        return f"{_DOOR_STATES[cell[2]]} {IDX_TO_COLOR[cell[1]]} door"
    if kind in ("key", "ball", "box"):
        return f"{IDX_TO_COLOR[cell[1]]} {kind}"
    if kind == "floor":
        return "empty"
    return kind  # empty, wall, goal, lava, unseen


def _passable(cell: list[int]) -> bool:
    kind = IDX_TO_OBJECT[cell[0]]
    return kind in _PASSABLE or (kind == "door" and cell[2] == 0)


def render_observation(image: list, carrying: Any) -> str:
    """The observation text from minigrid's egocentric encoding `image[x][y] = (type, color, state)`
    (as nested lists; the agent sits at x = size // 2, y = size - 1, looking towards y = 0)."""
    size = len(image)
    ax, ay = size // 2, size - 1
    carry = f"{carrying.color} {carrying.type}" if carrying is not None else "nothing"
    front = _cell_name(image[ax][ay - 1])
    ahead = 0
    while ahead < ay and _passable(image[ax][ay - 1 - ahead]):
        ahead += 1
    left = 0
    while left < ax and _passable(image[ax - 1 - left][ay]):
        left += 1
    right = 0
    while right < size - 1 - ax and _passable(image[ax + 1 + right][ay]):
        right += 1
    seen = []
    for x in range(size):
        column = image[x]
        for y in range(size):
            cell = column[y]
            if IDX_TO_OBJECT[cell[0]] in _SHOWN_TYPES and (x, y) != (ax, ay):
                a, r = ay - y, x - ax
                side = f" r{r}" if r > 0 else f" l{-r}" if r < 0 else ""
                seen.append((a + abs(r), a, r, f"{_cell_name(cell)} a{a}{side}"))
    seen.sort()
    see = ", ".join(s[3] for s in seen[:_MAX_SEEN]) or "nothing"
    return (f"carry: {carry}. front: {front}. free: ahead {ahead} left {left} right {right}. "
            f"see: {see}.")


# --- scoring ----------------------------------------------------------------------------------------

def _ordered_parts(instr: Any) -> list[tuple[Any, bool]]:
    """The two parts of a sequence (Before/After/And) in execution order, each with whether BabyAI
    counts it done."""
    a_ok, b_ok = instr.a_done == "success", instr.b_done == "success"
    if isinstance(instr, AfterInstr):
        return [(instr.instr_b, b_ok), (instr.instr_a, a_ok)]
    return [(instr.instr_a, a_ok), (instr.instr_b, b_ok)]


def _count_leaves(instr: Any) -> int:
    if isinstance(instr, ActionInstr):
        return 1
    return _count_leaves(instr.instr_a) + _count_leaves(instr.instr_b)


def _leaf_values(env: Any, instr: Any, verified: bool) -> tuple[list[tuple[float, int | None]], float]:
    """Per leaf (value, distance) in execution order, and the sum of values (see the module doc)."""
    if isinstance(instr, ActionInstr):
        if verified:
            return [(1.0, None)], 1.0
        value, dist = _leaf_partial(env, instr)
        return [(value, dist)], value
    if verified:
        n = _count_leaves(instr)
        return [(1.0, None)] * n, float(n)
    leaves: list[tuple[float, int | None]] = []
    total = 0.0
    (first, first_ok), (second, second_ok) = _ordered_parts(instr)
    for part, ok, current in ((first, first_ok, True),
                              (second, second_ok, first_ok or isinstance(instr, AndInstr))):
        if current:
            sub, value = _leaf_values(env, part, ok)
        else:  # not its turn yet: worth nothing
            sub, value = [(0.0, None)] * _count_leaves(part), 0.0
        leaves += sub
        total += value
    return leaves, total


def _positions(env: Any, objs: list) -> list[tuple[int, int]]:
    out = []
    for obj in objs:
        if obj.type == "wall" or obj is env.carrying or obj.cur_pos is None:
            continue
        x, y = int(obj.cur_pos[0]), int(obj.cur_pos[1])
        if x >= 0 and env.grid.get(x, y) is obj:
            out.append((x, y))
    return out


def _nearest(env: Any, positions: list[tuple[int, int]]) -> int | None:
    ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
    return min((abs(x - ax) + abs(y - ay) for x, y in positions), default=None)


def _closeness(env: Any, d: int | None) -> float:
    if d is None:
        return 0.0
    d_max = (env.width - 3) + (env.height - 3)
    return 1.0 - min(d, d_max) / d_max


def _leaf_partial(env: Any, instr: Any) -> tuple[float, int | None]:
    carrying = env.carrying
    if isinstance(instr, GoToInstr):
        d = _nearest(env, _positions(env, instr.desc.obj_set))
        return 0.5 * _closeness(env, d), d
    if isinstance(instr, PickupInstr):
        if carrying is not None and any(carrying is o for o in instr.desc.obj_set):
            return 0.75, 0
        d = _nearest(env, _positions(env, instr.desc.obj_set))
        return 0.5 * _closeness(env, d), d
    if isinstance(instr, OpenInstr):
        if any(getattr(o, "is_open", False) for o in instr.desc.obj_set):
            return 0.75, 0
        d = _nearest(env, _positions(env, instr.desc.obj_set))
        return 0.5 * _closeness(env, d), d
    if isinstance(instr, PutNextInstr):
        fixed = _positions(env, instr.desc_fixed.obj_set)
        moving = _positions(env, instr.desc_move.obj_set)
        if any(pos_next_to(m, f) for m in moving for f in fixed):
            return 0.75, 0
        if carrying is not None and any(carrying is o for o in instr.desc_move.obj_set):
            d = _nearest(env, fixed)
            return 0.5 + 0.25 * _closeness(env, d), d
        d = _nearest(env, moving)
        return 0.25 * _closeness(env, d), d
    raise TypeError(f"unknown BabyAI instruction {type(instr).__name__}")


def _remaining_leaves(instr: Any) -> list[Any]:
    """Leaves not yet counted done, in execution order (what a fresh bot still has to do)."""
    if isinstance(instr, ActionInstr):
        return [instr]
    out = []
    for part, ok in _ordered_parts(instr):
        if not ok:
            out += _remaining_leaves(part)
    return out

