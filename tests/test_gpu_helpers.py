"""The GPU tests' own helpers on CPU (no GPU): readiness of workloads, dying workloads failing at once, watched
commands reporting their exit status, result rows."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import gpulab as G

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _w(name="CT 301", gib=1.0, pids=(10,), exit_file=None, listed=True):
    return G.Workload(name, gib, f"/r/{name}.ready", lambda: list(pids), exit_file, listed)


def test_ready_needs_the_ready_file_and_the_nvml_listing():
    """A workload is ready once its ready file is there and NVML lists one of its pids with 90 % of its memory."""
    w = _w(pids=(10, 11))
    assert G.problem(w, {11: 1024 * MIB}, exists=lambda p: False)[0] == "waiting"
    assert G.problem(w, {}, exists=lambda p: p == w.ready)[0] == "waiting"
    assert G.problem(w, {11: 100 * MIB, 99: 4096 * MIB}, exists=lambda p: p == w.ready)[0] == "waiting"  # 99 is not its pid
    assert G.problem(w, {11: None}, exists=lambda p: p == w.ready)[0] == "waiting"  # memory not reported
    assert G.problem(w, {11: 922 * MIB}, exists=lambda p: p == w.ready) is None


def test_a_fork_child_workload_needs_only_its_ready_file():
    """A fork-after-init child (NVML lists its dead parent, never it) is ready on its ready file alone."""
    w = _w(listed=False)
    assert G.problem(w, {}, exists=lambda p: p == w.ready) is None


def test_wait_fails_at_once_when_a_workload_died():
    """One dead workload (its exit file is there) fails the wait on the first look, with its exit status."""
    clock = Clock()
    ws = [_w("CT 301", exit_file="/r/301.exit"), _w("CT 302")]
    with pytest.raises(AssertionError, match="CT 301: the workload ended \\(exit status 1\\)"):
        G.wait_ready(ws, dict, 120, exists=lambda p: p == "/r/301.exit", read=lambda p: "1\n", clock=clock, sleep=clock.sleep)
    assert clock.t == 0.0
    host = G.Workload("host", 1.0, "/r/h.ready", lambda: [5], exited=lambda: -9)
    with pytest.raises(AssertionError, match="host: the workload ended \\(exit status -9\\)"):
        G.wait_ready([host], dict, 120, exists=lambda p: False, clock=clock, sleep=clock.sleep)


def test_wait_names_the_missing_workloads_at_the_deadline():
    """At the deadline the wait fails naming what is still not ready; ready ones end the wait at once."""
    clock = Clock()
    ws = [_w("CT 301", pids=(1,)), _w("CT 302", pids=(2,))]
    with pytest.raises(AssertionError, match="1 of 2 workload\\(s\\) not ready after 5 s: CT 302"):
        G.wait_ready(ws, lambda: {1: 1024 * MIB}, 5, exists=lambda p: True, clock=clock, sleep=clock.sleep)
    assert 5 <= clock.t < 5.2
    clock = Clock()
    assert G.wait_ready(ws, lambda: {1: 1024 * MIB, 2: 1024 * MIB}, 5, exists=lambda p: True, clock=clock, sleep=clock.sleep) == 0.0


def test_watched_commands_write_their_exit_status(tmp_path):
    """watched_argv / watched_script run the command and write its exit status when it ends."""
    a, b = tmp_path / "a.exit", tmp_path / "b.exit"
    subprocess.run(G.watched_argv(["sh", "-c", "exit 3"], str(a)), check=True, timeout=10)
    subprocess.run(["sh", "-c", G.watched_script(["sh", "-c", "exit 0", "x y"], str(b))], check=True, timeout=10)
    assert a.read_text().strip() == "3" and b.read_text().strip() == "0"


def test_holder_argv_and_result_rows(tmp_path, monkeypatch):
    """The workload command names cuda_hold with its size and ready file; result rows record the goal, not assert it."""
    argv = G.holder_argv(0.0625, "/r/ready", "--fork-after-init", python="/usr/bin/python3")
    assert argv == ["/usr/bin/python3", G.HOLDER, "--gib", "0.0625", "--ready", "/r/ready", "--fork-after-init"]
    assert os.path.exists(G.HOLDER)
    out = tmp_path / "r.jsonl"
    monkeypatch.setenv("PVEGPU_RESULTS", str(out))
    G.record(G.goal({"scenario": "x"}, 1.23456, 1.0))
    assert json.loads(out.read_text()) == {"scenario": "x", "wall_s": 1.235, "goal_s": 1.0, "goal_met": False}


def test_first_line_has_a_deadline_and_sees_a_dead_process():
    """first_line returns what a process prints first, and fails (never hangs) when it is silent or ends."""
    import sys

    def proc(code):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    talker = proc("print('ready', flush=True); import time; time.sleep(30)")
    assert G.first_line(talker, 10) == "ready"
    talker.kill()
    talker.wait()
    silent = proc("import time; time.sleep(30)")
    with pytest.raises(AssertionError, match="printed nothing in 0.3 s"):
        G.first_line(silent, 0.3)
    silent.kill()
    silent.wait()
    with pytest.raises(AssertionError, match="ended \\(exit status 4\\)"):
        G.first_line(proc("raise SystemExit(4)"), 10)
