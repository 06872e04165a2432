"""Benchmarks: plain functions returning dicts of figures (`gyre bench <name> --json` prints them)."""
