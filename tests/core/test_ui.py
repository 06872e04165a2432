"""Progress where nobody watches a terminal: plain lines in a log, not a live bar that shows nothing."""
import re

from gyre_core.ui import phase


def test_progress_into_a_file_is_plain_lines(monkeypatch, capsys):
    monkeypatch.setenv("GYRE_QUIET", "0")
    monkeypatch.setenv("GYRE_PROGRESS_EVERY_S", "0")          # a line at every tick
    with phase("rollout", 3) as tick:                          # capsys: stderr is not a terminal
        tick()
        tick(reward=0.25)
        tick(completed=3, loss=1.5)
    lines = [re.sub(r" \(\d+ s\)", "", line) for line in capsys.readouterr().err.splitlines()]   # (elapsed)
    assert lines == ["rollout: 0/3", "rollout: 1/3", "rollout: 2/3 reward=0.25", "rollout: 3/3 loss=1.5",
                     "rollout: 3/3 loss=1.5"]


def test_a_slow_log_gets_a_line_at_most_every_so_often(monkeypatch, capsys):
    monkeypatch.setenv("GYRE_QUIET", "0")
    monkeypatch.setenv("GYRE_PROGRESS_EVERY_S", "3600")
    with phase("warm start", 100) as tick:
        for _ in range(100):
            tick()
    err = capsys.readouterr().err.splitlines()
    assert [e.split(" (")[0] for e in err] == ["warm start: 0/100", "warm start: 100/100"]   # start and end only
