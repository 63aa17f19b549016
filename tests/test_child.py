"""The gate's forked child (adapters/child.py): what its answer looks like across the pipe."""

from __future__ import annotations

import json

from pvegpu.adapters.child import Child, call_in_child
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


def test_a_cancelled_child_is_gone():
    """cancel() kills a started check that is no longer wanted (broken settings in the parent)."""
    import os
    import time

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
