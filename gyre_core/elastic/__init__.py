"""Elastic rollout/training reallocation: cells, the waterlevel controller, the router, streaming training.

The devices are grouped into K identical *cells*. Cell 0 is the *core*: it owns the authoritative
weights and the only optimizer state; cells 1..K−1 are *satellites*. Each cell is in one role at a
time — `rollout` (serving model calls through the router) or `train` (claiming streamed micro-steps)
— and switches inside its long-lived agent, never by starting a process.

Modules, bottom up:
- `workload`   — the execution-time model shared by the emulated runtime and the simulator
                 (long-tailed calls per execution with a timeout cap, environment latency, training cost).
- `controller` — the role policies (`colocated`, `async`, `elastic` waterlevel) as pure functions of
                 the counters (dispatched d, finished f, capacity); every decision is a `Decision` record.
- `messages`   — what the coordinator and its cell agents say to each other, one typed record per message.
- `router`     — binds executions to rollout cells (≤ capacity each), reroutes calls off a cell that leaves
                 rollout or dies, carrying the tokens so far; versions are recorded per token.
- `stream`     — the micro-step queue finished executions stream into; training cells claim micro-steps,
                 gradient accumulation keeps the update equal to the non-streamed one; staleness bound.
- `agent`      — the cell agent process (`python -m gyre_core.elastic.agent`): emulated or real device work.
- `work`       — what runs on the fleet (the `Work` protocol) and its emulated kind; the real harness, env
                 and model are `gyre_core.phases.rl_on_cells.HarnessWork`, above this package.
- `connections` — the coordinator's side of the agents: starts them (a launcher), carries their messages
                 (a reader and a writer thread per cell), stops them.
- `runtime`    — the coordinator: applies the policy, feeds micro-steps, loses cells, measures.
- `sim`        — a discrete-event model of a fleet running the same policies (`gyre sim`); `comparison`
                 sets the policies side by side and prints the table; `profiles` holds its named fleets
                 (laptop, the paper's 122B and 2.4T runs).
- `timeline`   — the role-timeline picture (cells × time, coloured by role, switch marks).

Training cells always form a prefix of the order core, satellite 1, satellite 2, ...: the core goes
first (it holds the optimizer), and the set of training cells is always cells[0:t] for some t.
"""
