"""Experiment drivers (RL ablations, seed pooling, the supervised curve, the simulator sweep): scripts that
run or compare training runs and print tables, apart from the benchmarks in `bench/` (`gyre bench <name>`).

Run each from the repository root as `.venv/bin/python bench/experiments/NAME.py ...` (see its docstring)."""
