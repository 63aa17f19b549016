"""The gate's forked child (adapters/child.py): what its answer looks like across the pipe, its deadline (a child
that closed its pipe but does not exit is not waited for), and the gate when the child cannot be forked."""

from __future__ import annotations

import enum
import json
import os
import random
import time

from pvegpu.adapters.child import Child, call_in_child, plain
from pvegpu.cli import run
from pvegpu.core import errors as E
from pvegpu.gate.decide import GateState
from tests.pvelike import kill_and_reap


def test_the_answer_arrives_as_json_would_bring_it():
    """Tuples as lists, StrEnum members as their value (a plain str: marshal carries no subclass), non-string keys
    as JSON writes them: the same data as a JSON round trip."""
    value = {"states": {0: GateState.CLEAN, 1: GateState.REFUSED}, "pids": (1, 2), True: None, "x": 1.5, "n": [{"a": ()}]}
    done, ans = call_in_child(lambda: value, 5)
    assert done and ans == {"ok": json.loads(json.dumps(value))}
    assert type(ans["ok"]["states"]["0"]) is str


def test_an_answer_that_cannot_be_carried_is_a_crash_not_a_hang():
    """A result that is not plain data comes back as a crash (the gate then refuses: fail closed)."""
    done, ans = call_in_child(lambda: {"obj": object()}, 5)
    assert done and ans is not None and "crash" in ans and "TypeError" in ans["crash"]


def test_the_childs_answer_carries_mixed_in_enums_and_str_subclasses_as_json_did():
    """child.plain gives what json.dumps/loads gave: a (str, Enum) member or a str/int subclass with its own __str__ as its value."""

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

    class Mixed(str, enum.Enum):  # noqa: UP042 - the mixed-in form is the point: json wrote its value
        REFUSE = "refuse"

    value = {"state": Mixed.REFUSE, "names": ["bad\udcff\x1b[2J", ("a", 1)], 3: None}
    done, ans = Child(lambda: value).result(20.0)
    assert done and ans is not None and ans["ok"] == json.loads(json.dumps(value))


def test_a_child_that_closed_its_pipe_but_does_not_exit_is_not_waited_for_past_the_deadline():
    """Child.result returns within its deadline when the pipe is at EOF but the child never exits (its exit stuck in the driver)."""

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

def test_a_cancelled_child_is_gone():
    """cancel() kills a started check that is no longer wanted (broken settings in the parent)."""
    child = Child(lambda: time.sleep(30))
    child.cancel()
    end = time.monotonic() + 5
    while time.monotonic() < end:
        pid, _ = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.01)
    assert pid == child.pid


def test_the_gates_local_first_lookup_answers_as_vmlist_does(tmp_path):
    """EtcPve(local_first=True) (the gate's: no json for .vmlist) finds every guest where .vmlist puts it: a CT and
    a VM of this node from their config files, a guest of another node and an unknown vmid through .vmlist."""
    import os

    from pvegpu.adapters.etcpve import EtcPve
    from tests import pvelike

    root = pvelike.etc_pve(str(tmp_path / "pve"), "n1", {129: "arch: amd64\n"}, vms=(130,))
    os.makedirs(os.path.join(root, "nodes", "n2", "lxc"))
    with open(os.path.join(root, "nodes", "n2", "lxc", "131.conf"), "w") as f:
        f.write("arch: amd64\n")
    with open(os.path.join(root, ".vmlist")) as f:
        vmlist = json.load(f)
    vmlist["ids"]["131"] = {"node": "n2", "type": "lxc", "version": 1}
    with open(os.path.join(root, ".vmlist"), "w") as f:
        json.dump(vmlist, f)
    with open(os.path.join(root, "nodes", "n1", "qemu-server", "130.conf"), "w") as f:
        f.write("memory: 1024\n")
    plain, fast = EtcPve(root), EtcPve(root, local_first=True)
    for vmid in (129, 130, 131, 999):
        assert fast.where(vmid) == plain.where(vmid), vmid
    assert [fast.where(v).type for v in (129, 130)] == ["lxc", "qemu"]


def test_the_gates_verdict_does_not_wait_for_its_childs_exit():
    """reap=False (the start gate, which exits right after): the answer is returned as soon as the pipe is at EOF,
    while the child's exit still lingers (its NVML files closing); reap=True waits for it, up to the deadline."""
    import os
    import time

    def answers_then_lingers() -> dict:
        pid = os.fork()  # the answer is written by this process; the parent of it lingers as a slow exit would
        if pid:
            os.closerange(3, 65536)
            time.sleep(3)
            os._exit(0)
        return {"allow": True}

    for reap, slow in ((False, False), (True, True)):
        child = Child(answers_then_lingers)
        t0 = time.monotonic()
        try:
            done, ans = child.result(2.0, reap=reap)
            took = time.monotonic() - t0
        finally:
            kill_and_reap(child.pid)
        assert done and ans == {"ok": {"allow": True}}, reap
        assert (took >= 1.5) == slow, (reap, took)


def _no_fork() -> int:
    raise BlockingIOError(11, "Resource temporarily unavailable")


def test_a_start_gate_that_cannot_fork_its_check_refuses_with_the_gates_code(monkeypatch, capsys):
    """pre-start refuses with exit 10 (fail closed, one line) when the check's child cannot be forked (no pids left)."""
    monkeypatch.setattr(os, "fork", _no_fork)
    code = run(["hook", str(random.randint(100000, 999999)), "pre-start"])
    err = capsys.readouterr().err
    assert code == E.EXIT_REFUSED and "Traceback" not in err and "internal error" not in err


def test_a_post_stop_that_cannot_fork_its_check_never_fails_the_stop(monkeypatch, capsys):
    """post-stop exits 0 (a stop is never failed) when the check's child cannot be forked."""
    monkeypatch.setattr(os, "fork", _no_fork)
    code = run(["hook", str(random.randint(100000, 999999)), "post-stop"])
    err = capsys.readouterr().err
    assert code == E.EXIT_OK and "internal error" not in err
