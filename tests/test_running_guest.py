"""A running guest's own memory is never leftover, and a whole-GPU reset (``pvegpu gpu-reset``, which ends the work of
every process on that GPU) is advised only for a GPU no live process uses: the gate, the reset's diagnosis and the
audit name the GPU's users instead (issue 30, item 7). Pure: facts in, verdicts out, on the stateful fakes."""

from __future__ import annotations

from pvegpu.audit.model import FlagKind
from pvegpu.audit.run import run_audit
from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import LeftoverRule, gpu_reset_advice
from pvegpu.core.model import MIB, GpuHealth, GpuInfo, GpuSample, Holder, NvmlProcess, Place, Placement, ProcIdentity, ProcInfo
from pvegpu.gate.decide import GatePolicy, GatePorts, GateState, Situation, decide, evaluate
from pvegpu.reset.diagnosis import diagnose
from pvegpu.reset.vocab import Kind
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve

GPU = GpuInfo(0, 0, "GPU-0", "0000:41:00.0")
RESET = "pvegpu gpu-reset"


def _holder(pid: int, vmid: int) -> Holder:
    info = ProcInfo(ProcIdentity(pid, pid), "python3", "S", Placement(Place.CONTAINER, vmid), f"/lxc/{vmid}/ns", 7)
    return Holder(info, frozenset({0}), frozenset({"nvml", "fd", "maps"}))


def _facts(used_mib: int, own_mib: int = 0, neighbour_mib: int = 0) -> GpuFacts:
    """GPU 0 with CT 129's listed job (``own_mib``), CT 130's (``neighbour_mib``) and ``used_mib`` in all."""
    procs = tuple(p for p in (NvmlProcess(500, own_mib * MIB) if own_mib else None,
                              NvmlProcess(600, neighbour_mib * MIB) if neighbour_mib else None) if p is not None)
    return GpuFacts(GPU, GpuSample(0, used_mib * MIB, procs), ct_holders=[_holder(500, 129)] if own_mib else [],
                    other_holders=[_holder(600, 130)] if neighbour_mib else [], ct_listed_bytes=own_mib * MIB,
                    foreign_bytes=neighbour_mib * MIB, contexts_outside=1 if neighbour_mib else 0)


def test_running_containers_own_memory_is_no_leftover_and_no_refusal_to_fix():
    """check of a running CT holding 3.6 GiB beside a neighbour: state running, no start decided, nothing to fix."""
    d = decide(129, {0: _facts(3686 + 1024 + 15, own_mib=3686, neighbour_mib=1024)}, Situation(ct_pids=(41, 500), running_init=41),
               GatePolicy())
    assert (d.allow, d.running_init, d.per_gpu) == (False, 41, {0: GateState.RUNNING})
    assert d.fix == []


def test_running_container_names_memory_beyond_every_running_process_without_a_gpu_reset():
    """2 GiB more than any running process accounts for, on a GPU the CT and a neighbour use: said, and the advice
    names the users instead of a GPU reset."""
    d = decide(129, {0: _facts(3686 + 1024 + 2048, own_mib=3686, neighbour_mib=1024)}, Situation(running_init=41), GatePolicy())
    assert d.per_gpu == {0: GateState.RUNNING} and len(d.fix) == 1
    assert RESET not in d.fix[0] and "CT 130" in d.fix[0] and "CT 129" in d.fix[0]


def test_check_of_a_running_container_reports_running_with_its_json():
    """evaluate() on a running CT (its init alive) gives running: true in JSON and each GPU's state running."""
    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host), FakePve(host)
    pve.add_ct(129)
    host.add(129, init=True, comm="init")
    probe.context(0, 3686, host.add(129, minors={0}))
    doc = evaluate(129, GatePorts(pve, probe, host), GatePolicy()).to_json()
    assert doc["running"] is True and doc["allow"] is False and [g["state"] for g in doc["gpus"]] == ["running"]
    assert doc["fix"] == []


def test_stopped_containers_leftover_on_a_shared_gpu_advises_no_gpu_reset():
    """A stopped CT's start onto 2 GiB of leftover beside a running neighbour: refused, and the fix names the
    neighbour instead of `pvegpu gpu-reset`; on a GPU nobody uses, the reset is the advice."""
    shared = decide(129, {0: _facts(1024 + 2048, neighbour_mib=1024)}, Situation(), GatePolicy())
    assert shared.per_gpu == {0: GateState.REFUSED}
    assert not any(RESET in f for f in shared.fix) and any("CT 130" in f for f in shared.fix)
    idle = decide(129, {0: _facts(2048)}, Situation(), GatePolicy())
    assert idle.per_gpu == {0: GateState.REFUSED} and any(f"{RESET} 0" in f for f in idle.fix)


def test_gpu_reset_advice_only_for_a_gpu_no_process_uses():
    """The one advice: `pvegpu gpu-reset N` for an idle GPU; its users (place and pid) for a used one."""
    assert f"{RESET} 0" in gpu_reset_advice(_facts(2048))
    used = gpu_reset_advice(_facts(3072, neighbour_mib=1024))
    assert RESET not in used and "CT 130" in used and "pid 600" in used


def test_driver_leak_diagnosis_on_a_shared_gpu_names_the_users():
    """The target's leak with no holder left, on a GPU a neighbour uses: DRIVER_LEAK, and its action names the
    neighbour, not a GPU reset that would end the neighbour's work."""
    [leak] = [d for d in diagnose(129, {0: _facts(1024 + 2048, neighbour_mib=1024)}, LeftoverRule()) if d.kind is Kind.DRIVER_LEAK]
    assert RESET not in leak.action and "CT 130" in leak.action
    [alone] = [d for d in diagnose(129, {0: _facts(2048)}, LeftoverRule()) if d.kind is Kind.DRIVER_LEAK]
    assert RESET in alone.action


def test_audit_advice_on_a_used_gpu_names_its_users():
    """Audit: unattributed memory and a pending row-remap reset on a GPU two containers use: each flag's advice
    names them and suggests no GPU reset; the same findings on an idle GPU advise `pvegpu gpu-reset 0`."""
    def audit(with_users: bool):
        host = FakeHost(FakeClock())
        probe, pve = FakeProbe(host), FakePve(host)
        for vmid in (129, 130):
            pve.add_ct(vmid)
            host.add(vmid, init=True, comm="init")
            if with_users:
                probe.context(0, 1024, host.add(vmid, minors={0}))
        probe.leak[0] = 2048 * MIB
        probe.health = lambda minor: GpuHealth(remap_pending=True)
        rep = run_audit(pve=pve, probe=probe, host=host)
        return {f.kind: f.to_json()["advice"] for f in rep.flags if f.kind in (FlagKind.UNATTRIBUTED, FlagKind.HEALTH)}

    used = audit(True)
    assert set(used) == {FlagKind.UNATTRIBUTED, FlagKind.HEALTH}
    assert all(RESET not in a and "CT 129" in a and "CT 130" in a for a in used.values()), used
    idle = audit(False)
    assert set(idle) == {FlagKind.UNATTRIBUTED, FlagKind.HEALTH} and all(f"{RESET} 0" in a for a in idle.values()), idle
