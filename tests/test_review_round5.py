"""Review of round 5's speed work (the forked gate check, marshal, local_first, the reset's NVML warm-up): attacks."""

from __future__ import annotations

import threading
import time

from pvegpu.core.model import GpuSample
from tests.pvelike import kill_and_reap


def _stuck_nvml(monkeypatch, release: threading.Event) -> None:
    """A pynvml whose nvmlInit sits in the driver (as after an Xid) until the test lets it go, then fails."""
    from tests.test_nvml_per_gpu import fake_pynvml, use

    m = use(monkeypatch, fake_pynvml())

    def init() -> None:
        release.wait(30)
        raise m.NVMLError("Driver Not Loaded")

    m.nvmlInit = init


def while_nvml_start_hangs(monkeypatch, call, limit_extra: float = 5.0) -> tuple[bool, float, dict[str, object]]:
    """Run ``call(settings)`` in a thread while every nvmlInit sits in the driver: (whether it returned within the
    read deadline + ``limit_extra`` s, how long it took, ``{"value": ...}`` or ``{"error": ...}``); then NVML is let go."""
    from pvegpu import wiring
    from pvegpu.adapters.settingsfile import load

    release = threading.Event()
    _stuck_nvml(monkeypatch, release)
    s = load(None, env={}, snapshot_dir=None)
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call(s)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(wiring.read_deadline(s) + limit_extra)
    finished, took = not t.is_alive(), time.monotonic() - t0
    release.set()
    t.join(30)
    return finished, took, box


def test_a_reset_whose_nvml_start_hangs_gets_unknown_within_the_read_deadline(monkeypatch):
    """A reset's first GPU reading, with the warm-up's nvmlInit stuck in the driver, answers unknown within the read deadline."""
    from pvegpu import wiring

    def first_reading(s):
        probe = wiring.nvml_reader(s)
        probe.begin()
        return probe.sample([0])

    finished, took, box = while_nvml_start_hangs(monkeypatch, first_reading)
    assert finished, f"the reading was still waiting after {took:.1f} s"
    sample = box["value"]
    assert isinstance(sample, dict) and isinstance(sample[0], GpuSample) and sample[0].used_bytes is None


def test_the_childs_answer_carries_mixed_in_enums_and_str_subclasses_as_json_did():
    """child.plain gives what json.dumps/loads gave: a (str, Enum) member or a str/int subclass with its own __str__ as its value."""
    import enum
    import json

    from pvegpu.adapters.child import plain

    class Mixed(str, enum.Enum):  # noqa: UP042 - the mixed-in form is the point: json wrote its value
        ALLOW = "allow"

    class Shown(str):
        def __str__(self) -> str:
            return "<shown>"

    class Count(int):
        def __int__(self) -> int:
            return -1

        def __index__(self) -> int:
            return -1

    for x in (Mixed.ALLOW, {Mixed.ALLOW: [Mixed.ALLOW]}, Shown("text"), {Shown("k"): Shown("v")}, Count(7), {Count(7): Count(7)}):
        assert plain(x) == json.loads(json.dumps(x)), x


def test_a_forked_check_answers_its_verdict_as_json_did():
    """Child(fn).result gives fn's value as json would bring it (a mixed-in enum as its value, lone surrogates kept)."""
    import enum
    import json

    from pvegpu.adapters.child import Child

    class Mixed(str, enum.Enum):  # noqa: UP042 - the mixed-in form is the point: json wrote its value
        REFUSE = "refuse"

    value = {"state": Mixed.REFUSE, "names": ["bad\udcff\x1b[2J", ("a", 1)], 3: None}
    done, ans = Child(lambda: value).result(20.0)
    assert done and ans is not None and ans["ok"] == json.loads(json.dumps(value))


def test_a_child_that_closed_its_pipe_but_does_not_exit_is_not_waited_for_past_the_deadline():
    """Child.result returns within its deadline when the pipe is at EOF but the child never exits (its exit stuck in the driver)."""
    import os

    from pvegpu.adapters.child import Child

    def closes_then_lingers() -> None:
        os.closerange(3, 65536)  # the answer pipe too: the parent sees EOF, as when exit closed it before a stuck release
        time.sleep(15)

    child = Child(closes_then_lingers)
    t0 = time.monotonic()
    try:
        done, ans = child.result(2.0)
        took = time.monotonic() - t0
    finally:
        kill_and_reap(child.pid)
    assert took < 6.0, f"result() waited {took:.1f} s for the child's exit"
    assert ans is None or "crash" in ans


def test_a_start_gate_that_cannot_fork_its_check_refuses_with_the_gates_code(monkeypatch, capsys):
    """pre-start refuses with exit 10 (fail closed, one line) when the check's child cannot be forked (no pids left)."""
    import os
    import random

    from pvegpu.cli import run
    from pvegpu.core import errors as E

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    code = run(["hook", str(random.randint(100000, 999999)), "pre-start"])
    err = capsys.readouterr().err
    assert code == E.EXIT_REFUSED and "Traceback" not in err and "internal error" not in err


def test_a_post_stop_that_cannot_fork_its_check_never_fails_the_stop(monkeypatch, capsys):
    """post-stop exits 0 (a stop is never failed) when the check's child cannot be forked."""
    import os
    import random

    from pvegpu.cli import run
    from pvegpu.core import errors as E

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    code = run(["hook", str(random.randint(100000, 999999)), "post-stop"])
    err = capsys.readouterr().err
    assert code == E.EXIT_OK and "internal error" not in err
