"""GPU health: the kernel log's Xid formats, the catalogue, the verdict's rule, the /dev/kmsg reader and the gate's refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pvegpu.adapters.kernlog import KmsgLog
from pvegpu.audit.prom import render
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import RECOVERY_ACTIONS, GpuHealth, GpuInfo, GpuSample
from pvegpu.gate.decide import GatePolicy, Situation, decide, gpu_health
from pvegpu.health import KernelEvents, Need, State, Verdict, bus_key, classify, judge, parse_lines, reset_record
from pvegpu.sim.state import SimState
from tests import pvelike
from tests.test_audit_outputs import samples
from tests.test_gate_decide import facts

BUS = "00000000:41:00.0"  # as NVML names it
# the driver's line formats (recorded from driver logs quoted in NVIDIA/NVSentinel#155, leptonai/gpud#1209 and users' reports)
XID79 = "NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
XID79_OLD = "NVRM: Xid (0000:41:00): 79, GPU has fallen off the bus."
FALLEN_AFTER = "NVRM: GPU 0000:41:00.0: GPU has fallen off the bus."
FALLEN_MANY = ("NVRM: The NVIDIA GPU 0000:41:00.0\\x0aNVRM: (PCI ID: 10de:2330) installed in this system has\\x0a"
               "NVRM: fallen off the bus and is not responding to commands.")
XID48 = "NVRM: Xid (PCI:0000:41:00): 48, pid=99, name=train, An uncorrectable double bit error (DBE) has been detected on GPU."
XID13 = "NVRM: Xid (PCI:0000:41:00): 13, pid=99, name=train, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0)"
XID119 = "NVRM: Xid (PCI:0000:41:00): 119, pid=99, name=train, Timeout after 6s of waiting for RPC response from GPU0 GSP!"
XID154_REBOOT = "NVRM: Xid (PCI:0000:41:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
XID154_NONE = "NVRM: Xid (PCI:0000:41:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
OTHER_GPU = "NVRM: Xid (PCI:0000:81:00): 79, pid=1, name=x, GPU has fallen off the bus."
WRITTEN = ("pvegpu: ", "GPU reset executed")  # records userspace writes to /dev/kmsg


def kmsg(*texts: str, first: int = 0) -> list[str]:
    """The records in /dev/kmsg's format: resets as written from userspace (facility user), the rest as the kernel's."""
    return [f"{14 if t.startswith(WRITTEN) else 3},{first + i},{(first + i) * 1000000},-;{t}" for i, t in enumerate(texts)]


def log(*texts: str, first: int = 0) -> KernelEvents:
    xids, resets = parse_lines(kmsg(*texts, first=first))
    return KernelEvents(tuple(xids), tuple(resets), complete=first == 0)


@pytest.mark.parametrize("line,code", [(XID79, 79), (XID79_OLD, 79), (FALLEN_MANY, 79), (XID48, 48), (XID13, 13), (XID119, 119),
                                       (XID154_REBOOT, 154)])
def test_parser_reads_each_driver_format_for_its_gpu(line, code):
    """Each of the driver's formats gives one Xid of GPU 0000:41:00 with its code; another GPU's line is not this GPU's."""
    xids, _ = log(line, OTHER_GPU).of(BUS)
    assert [x.code for x in xids] == [code]


def test_fallen_off_line_after_xid79_is_one_event_and_alone_is_xid79():
    """The driver's second "fallen off the bus" line after an Xid 79 is the same event; without the Xid line it is Xid 79."""
    assert [x.code for x in log(XID79, FALLEN_AFTER).of(BUS)[0]] == [79]
    assert [(x.code, x.need) for x in log(FALLEN_AFTER).of(BUS)[0]] == [(79, Need.REBOOT)]


def test_dictionary_lines_and_garbage_are_skipped():
    """Lines that are no record (kmsg dictionary lines, noise) give no event."""
    assert parse_lines([" SUBSYSTEM=pci", " DEVICE=+pci:0000:41:00.0", "garbage", "6,1,2,-;eth0 link up"]) == ([], [])


@pytest.mark.parametrize("bus", ["00000000:41:00.0", "0000:41:00.0", "PCI:0000:41:00", "41:00.0", "0000:41:00.1"])
def test_bus_ids_normalise_to_one_key(bus):
    """NVML's, sysfs's and the driver's forms of one GPU's bus id are one key (domain, bus, device; no function)."""
    assert bus_key(bus) == "0000:41:00"


@pytest.mark.parametrize("code,need", [(13, Need.APPLICATION), (31, Need.APPLICATION), (43, Need.APPLICATION), (45, Need.APPLICATION),
                                       (48, Need.RESET), (63, Need.RESET), (64, Need.RESET), (74, Need.RESET), (79, Need.REBOOT),
                                       (92, Need.WATCH), (94, Need.APPLICATION), (95, Need.RESET), (119, Need.RESET), (120, Need.RESET),
                                       (140, Need.RESET), (9999, Need.UNLISTED)])
def test_catalogue_buckets(code, need):
    """The catalogue's bucket for each code pvegpu acts on."""
    assert classify(code) is need


@pytest.mark.parametrize("text,need", [("changed from 0x0 (None) to 0x1 (GPU Reset Required)", Need.RESET),
                                       ("changed from 0x0 (None) to 0x2 (Node Reboot Required)", Need.REBOOT),
                                       ("changed from 0x0 (None) to 0x2 (OS Reboot)", Need.REBOOT),
                                       ("changed from 0x0 (None) to 0x1 (PF FLR)", Need.RESET),
                                       ("changed from 0x1 (GPU Reset Required) to 0x0 (None)", Need.NOTHING),
                                       ("something new", Need.REBOOT)])
def test_xid154_reads_the_new_recovery_action(text, need):
    """Xid 154 needs what its text says the driver's recovery action became; text pvegpu cannot read needs a reboot."""
    assert classify(154, text) is need


NONE = GpuHealth(recovery_action="none")


@pytest.mark.parametrize("health,texts,state", [
    (NONE, (), State.OK),
    (GpuHealth(), (), State.OK),  # a driver without the recovery-action field: the log alone
    (NONE, (XID13,), State.OK),  # an application error needs nothing of the GPU
    (NONE, (XID48,), State.NEEDS_RESET),
    (NONE, (XID79,), State.NEEDS_REBOOT),
    (NONE, (XID48, XID79), State.NEEDS_REBOOT),  # the worst wins
    (GpuHealth(recovery_action="gpu-reset"), (), State.NEEDS_RESET),
    (GpuHealth(recovery_action="node-reboot"), (), State.NEEDS_REBOOT),
    (GpuHealth(recovery_action="unknown-42"), (), State.NEEDS_REBOOT),
    (GpuHealth(lost=True), (), State.LOST),
    (NONE, (XID154_REBOOT,), State.NEEDS_REBOOT),
    (NONE, (XID48, XID154_NONE), State.OK),  # the driver cleared its action after the Xid
    (NONE, (OTHER_GPU,), State.OK),
])
def test_verdict_rule(health, texts, state):
    """The verdict by the rule of docs/health.md."""
    assert judge(health, log(*texts), BUS).state is state


def test_a_refusal_is_a_state_not_a_latch():
    """An Xid needs a reset; a reset record newer than it (and NVML saying none) clears it; a new Xid after it counts again."""
    assert judge(NONE, log(XID48), BUS).refuses
    assert judge(NONE, log(XID48, reset_record(BUS, "GPU-1")), BUS).state is State.OK
    assert judge(NONE, log(XID48, reset_record(BUS), XID119), BUS).state is State.NEEDS_RESET
    assert judge(GpuHealth(recovery_action="gpu-reset"), log(XID48, reset_record(BUS)), BUS).state is State.NEEDS_RESET
    assert judge(NONE, log(XID48, "GPU reset executed: GPU-1, success: true"), BUS, uuid="GPU-1").state is State.OK
    assert judge(NONE, log(XID48, "GPU reset executed: GPU-1, success: false"), BUS, uuid="GPU-1").refuses


def test_unknown_is_never_healthy():
    """An unreadable log is unknown; a wrapped log without NVML's recovery action is unknown; neither refuses."""
    unreadable = judge(NONE, KernelEvents(error="cannot read /dev/kmsg: Operation not permitted"), BUS)
    wrapped = judge(GpuHealth(), log(first=500), BUS)
    assert (unreadable.state, wrapped.state) == (State.UNKNOWN, State.UNKNOWN)
    assert not unreadable.refuses and not wrapped.refuses
    assert judge(NONE, log(first=500), BUS).state is State.OK  # NVML says none: the wrapped log's gap is covered


def test_reader_reads_a_kmsg_file_and_sees_whether_the_boot_is_whole(tmp_path):
    """The reader parses the kmsg format from a file (the simulated node's), dictionary lines and all; SEQ 0 first = whole boot."""
    p = tmp_path / "kmsg"
    p.write_text("\n".join(kmsg("boot", XID79) + [" SUBSYSTEM=pci"]) + "\n")
    ev = KmsgLog(str(p)).events()
    assert (ev.error, ev.complete, [x.code for x in ev.xids]) == (None, True, [79])
    p.write_text("\n".join(kmsg("late", XID48, first=7)) + "\n")
    assert KmsgLog(str(p)).events().complete is False


def test_reader_says_why_not_and_bounds_the_read(tmp_path):
    """A missing log, a FIFO or one past its bound is an error (unknown), never an empty log."""
    assert KmsgLog(str(tmp_path / "none")).events().error
    os.mkfifo(tmp_path / "fifo")
    assert KmsgLog(str(tmp_path / "fifo")).events().error
    p = tmp_path / "kmsg"
    p.write_text("\n".join(kmsg(*(["x" * 100] * 50))) + "\n")
    assert KmsgLog(str(p), max_records=10).events().error


def test_reader_write_appends_the_next_record(tmp_path):
    """``write`` adds one record with the next sequence number; the reset it records ends the GPU's Xid."""
    p = tmp_path / "kmsg"
    p.write_text("\n".join(kmsg(XID48)) + "\n")
    KmsgLog(str(p)).write(reset_record(BUS))
    ev = KmsgLog(str(p)).events()
    assert [r.seq for r in ev.resets] == [1] and judge(NONE, ev, BUS).state is State.OK


GPU = {"minor": 0, "index": 0}


def scenario(**gpu):
    return {"node": "pve-sim", "gpus": [GPU | gpu, {"minor": 1, "index": 1}],
            "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}, {"vmid": 130, "status": "stopped", "gpus": [1]}]}


def check(node, vmid=129, *extra, **env):
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", str(vmid), "--json", *extra],
                          capture_output=True, text=True, cwd=pvelike.REPO, timeout=120, env=os.environ | env)


def test_gate_refuses_after_xid79_and_allows_after_a_simulated_reset(sim_node):
    """Xid 79 logged on GPU 0: CT 129's start is refused (exit 10) naming it, CT 130 on GPU 1 starts; after a reset newer
    than the Xid (and NVML saying none) the start goes through again."""
    node = sim_node(scenario(xids=[{"code": 79, "at": 120}], recovery_action="node-reboot"))
    r = check(node)
    doc = json.loads(r.stdout)
    assert r.returncode == 10 and doc["gpus"][0]["health"]["state"] == "needs-reboot"
    assert [x["code"] for x in doc["gpus"][0]["health"]["xids"]] == [79]
    assert check(node, 130).returncode == 0
    state = SimState(node.root)
    state.set_gpus([g | {"recovery_action": "none"} if g["minor"] == 0 else g for g in state.gpus()])
    assert check(node).returncode == 10  # NVML says none, but no reset is newer than the Xid: still refused
    KmsgLog(os.path.join(node.root, "kmsg")).write(reset_record("0000:41:00.0"))
    r = check(node)
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"][0]["health"]["state"] == "ok"


def test_gate_health_warn_lets_it_start_and_lost_always_refuses(sim_node):
    """gate.health = warn starts onto a GPU that needs a reset, saying so; a GPU NVML reports lost refuses even then."""
    node = sim_node(scenario(recovery_action="gpu-reset"))
    r = check(node, PVEGPU_GATE_HEALTH="warn")
    assert r.returncode == 0 and any("gate.health = warn" in x for x in json.loads(r.stdout)["reasons"])
    d = decide(129, facts(), Situation(health={0: Verdict(State.LOST, "NVML says the GPU is lost")}), GatePolicy(health="warn"))
    assert not d.allow and "lost" in d.reasons[0]


def test_unreadable_kernel_log_is_unknown_and_does_not_refuse(sim_node):
    """A kernel log that cannot be read leaves health unknown (shown), and the start is not refused for it."""
    node = sim_node(scenario())
    os.unlink(os.path.join(node.root, "kmsg"))
    r = check(node)
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"][0]["health"]["state"] == "unknown"


def test_bad_gate_health_setting_is_a_config_error(sim_node):
    """gate.health must be refuse or warn: anything else is exit 2 with the key named."""
    node = sim_node(scenario())
    r = check(node, PVEGPU_GATE_HEALTH="maybe")
    assert r.returncode == 2 and "gate.health" in r.stderr


@pytest.mark.gpu
def test_real_kernel_log_and_nvml_find_nothing_fatal_on_a_healthy_node():
    """On a GPU node (root): /dev/kmsg reads, and no GPU's verdict needs a reset or a reboot or is lost."""
    pynvml = pytest.importorskip("pynvml")
    from pvegpu.adapters.nvml import NvmlProbe
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVML: {exc}")
    ev = KmsgLog().events()
    if ev.error and os.geteuid() != 0:
        pytest.skip(ev.error)
    assert ev.error is None, ev.error
    with NvmlProbe(details=True) as p:
        verdicts = {g.index: judge(p.health(g.minor), ev, g.bus_id, g.uuid, str(g.index)) for g in p.gpus()}
    assert verdicts and not [v for v in verdicts.values() if v.refuses], verdicts


def audit(node, *extra):
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "audit", "--json", *extra],
                       capture_output=True, text=True, cwd=pvelike.REPO, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_audit_flags_health_naming_the_guests_and_exports_it(sim_node):
    """Xid 79 on GPU 0 and NVML asking a reset of GPU 1: flags xid / needs-reboot / needs-reset name each GPU's guest (exit 8);
    the textfile carries the verdict per state, the recovery action and the Xid count by code."""
    node = sim_node(scenario(xids=[{"code": 79, "at": 60}, {"code": 13, "at": 30}]))
    state = SimState(node.root)
    state.set_gpus([g | {"recovery_action": "gpu-reset"} if g["minor"] == 1 else g | {"recovery_action": "none"} for g in state.gpus()])
    code, doc = audit(node)
    flags = {(f["kind"], f["subject"]) for f in doc["nodes"][0]["flags"]}
    assert code == 8 and {("xid", "GPU 0"), ("needs-reboot", "GPU 0"), ("needs-reset", "GPU 1")} <= flags
    assert next(f for f in doc["nodes"][0]["flags"] if f["kind"] == "needs-reset")["detail"].endswith("lxc/130")
    gpu0 = doc["nodes"][0]["gpus"][0]
    assert gpu0["health"]["verdict"]["state"] == "needs-reboot" and "xid" in gpu0["flags"]
    m = samples(render(doc).decode())
    key0, key1 = {"node": "pve-sim", "uuid": "GPU-sim-0", "minor": "0"}, {"node": "pve-sim", "uuid": "GPU-sim-1", "minor": "1"}
    assert (key0 | {"state": "needs-reboot"}, 1.0) in m["pvegpu_gpu_health"] and (key0 | {"state": "ok"}, 0.0) in m["pvegpu_gpu_health"]
    assert (key1 | {"action": "gpu-reset"}, 1.0) in m["pvegpu_gpu_recovery_action"]
    assert sorted(m["pvegpu_gpu_xids"], key=str) == sorted([(key0 | {"code": "79", "need": "reboot"}, 1.0),
                                                            (key0 | {"code": "13", "need": "application"}, 1.0)], key=str)


def test_healthy_node_raises_no_health_series(sim_node):
    """A healthy simulated node: every GPU's verdict is ok, no health flag, and no series the health alerts fire on is 1."""
    code, doc = audit(sim_node(scenario(recovery_action="none")))
    assert code == 0 and {g["health"]["verdict"]["state"] for g in doc["nodes"][0]["gpus"]} == {"ok"}
    m = samples(render(doc).decode())
    assert not [s for s in m["pvegpu_gpu_health"] if s[0]["state"] != "ok" and s[1]] and not m.get("pvegpu_gpu_xids")


def test_diagnosis_of_a_holder_stuck_after_a_fatal_xid_names_it_and_the_next_step():
    """A D-state holder on a GPU with Xid 119 logged: the diagnosis names the Xid, that no signal ends it, and gpu-reset as next step;
    without a health verdict it keeps the generic line."""
    from dataclasses import replace as dc_replace

    from pvegpu.core.leftover import LeftoverRule
    from pvegpu.reset.diagnosis import diagnose
    from pvegpu.reset.vocab import Kind
    from tests.test_reset_diagnosis import _facts, _holder

    h = _holder(4242, 129)
    stuck = dc_replace(h, info=dc_replace(h.info, state="D"))
    f = _facts(ct_holders=[stuck])
    v = judge(NONE, log(XID119.replace("0000:41:00", "0000:01:00")), f[0].gpu.bus_id, index="0")
    (d,) = [x for x in diagnose(129, f, LeftoverRule(), {0: v}) if x.kind is Kind.STUCK_IN_DRIVER]
    assert "Xid 119" in d.problem and "no signal" in d.problem and "pvegpu gpu-reset 0" in d.action
    (plain,) = [x for x in diagnose(129, f, LeftoverRule()) if x.kind is Kind.STUCK_IN_DRIVER]
    assert "Xid 119" not in plain.problem


def test_tenant_text_the_kernel_prints_is_neither_an_xid_nor_a_reset():
    """Tenant text inside a kernel record (a mount option the kernel rejects) or a userspace write names no Xid and no reset."""
    def says(text: str) -> str:  # what the kernel prints for ``mount -t tmpfs -o TEXT none /mnt`` in a user namespace
        return f"tmpfs: Unknown parameter '{text}'"
    forged = parse_lines(kmsg(says(XID79), says(FALLEN_AFTER), says(FALLEN_MANY.replace("\\x0a", " "))))
    assert forged == ([], [])
    user_xid = parse_lines([f"14,0,0,-;{XID79}", f"12,1,0,-;{FALLEN_AFTER}"])  # written to /dev/kmsg from userspace
    assert user_xid == ([], [])
    clears = parse_lines([f"3,0,0,-;{XID48}", f"3,1,0,-;{says(reset_record(BUS))}", f"3,2,0,-;{says('GPU reset executed: GPU-1')}"])
    assert clears[1] == []
    kernel_said_reset = parse_lines([f"3,0,0,-;{XID48}", f"3,1,0,-;{reset_record(BUS)}", "3,2,0,-;GPU reset executed: GPU-1"])
    assert kernel_said_reset[1] == []  # resets are written from userspace: a kernel record saying one is someone's text


def test_a_failed_nvml_health_reading_is_unknown_but_a_logged_fatal_xid_still_counts():
    """NVML's health reading failed (None): with a clean log the GPU is unknown, not ok (it may be the lost one); a fatal
    Xid in the log still says what it needs."""
    clean, fatal = judge(None, log(), BUS), judge(None, log(XID79), BUS)
    assert clean.state is State.UNKNOWN and not clean.refuses
    assert fatal.state is State.NEEDS_REBOOT


def test_gate_health_of_a_gpu_whose_nvml_reading_fails_is_unknown():
    """The gate's health verdicts: a GPU whose health read raises is unknown, the other GPU's read is judged as usual."""
    def health(minor):
        if minor == 0:
            raise GpuQueryError("GPU minor 0: NVML cannot name it", "hint")
        return NONE

    gpus = {m: GpuFacts(GpuInfo(m, m, f"GPU-{m}", BUS if m == 0 else "0000:42:00.0"), GpuSample(m, 0, ()))
            for m in (0, 1)}
    ports = SimpleNamespace(probe=SimpleNamespace(health=health), kernlog=SimpleNamespace(events=lambda: log()))
    got = gpu_health(gpus, ports)
    assert (got[0].state, got[1].state) == (State.UNKNOWN, State.OK)


def test_a_gpu_whose_health_reading_fails_is_unknown_in_check_and_flagged_by_audit(sim_node):
    """GPU 0's health reading fails (health_error): check of CT 129 shows unknown and is not refused for it; audit flags
    the GPU unreadable (attention, exit 8) with the verdict unknown; GPU 1 is judged as usual."""
    node = sim_node(scenario(health_error="NVML_ERROR_UNKNOWN"))
    r = check(node)
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"][0]["health"]["state"] == "unknown"
    a = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "audit", "--json"], capture_output=True,
                       text=True, cwd=pvelike.REPO, timeout=120)
    n = json.loads(a.stdout)["nodes"][0]
    assert a.returncode == 8 and [f["subject"] for f in n["flags"] if f["kind"] == "unreadable-gpu"] == ["GPU 0"]
    assert [g["health"]["verdict"]["state"] for g in sorted(n["gpus"], key=lambda g: g["index"])] == ["unknown", "ok"]


def test_a_gpu_that_fell_off_the_bus_refuses_even_with_on_unknown_allow_and_audit_says_so(sim_node):
    """GPU 0's memory and health readings both fail (GPU is lost) and the kernel log has its Xid 79: with gate.on_unknown
    = allow the start is still refused (needs a reboot), and the audit flags needs-reboot for it."""
    node = sim_node(scenario(fail="GPU is lost", health_error="GPU is lost", xids=[{"code": 79, "at": 120}]))
    r = check(node, PVEGPU_GATE_ON_UNKNOWN="allow")
    assert r.returncode == 10 and json.loads(r.stdout)["gpus"][0]["health"]["state"] == "needs-reboot"
    a = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "audit", "--json"], capture_output=True,
                       text=True, cwd=pvelike.REPO, timeout=120)
    n = json.loads(a.stdout)["nodes"][0]
    assert a.returncode == 8 and [f["subject"] for f in n["flags"] if f["kind"] == "needs-reboot"] == ["GPU 0"]


@pytest.mark.parametrize("value", sorted(RECOVERY_ACTIONS))
def test_xid154_and_nvml_judge_each_recovery_action_value_alike(value):
    """Xid 154's "to 0xN (...)" needs what NVML's recovery action N needs: one table, not two."""
    from pvegpu.health.catalogue import recovery_need, xid154_need

    assert xid154_need(f"changed from 0x0 (None) to 0x{value:x} (Something)") is recovery_need(RECOVERY_ACTIONS[value])


def test_where_containers_firewalls_may_log_nvml_has_the_last_word_on_a_logged_xid(tmp_path):
    """nf_log_all_netns = 1: a container's LOG rule can write "NVRM: Xid ... 79" as a kernel record, so with NVML saying
    none the Xid does not refuse (noted); without NVML's action it still counts (fail closed); with 0 it counts."""
    forged = "NVRM: Xid (PCI:0000:41:00): 79, IN=eth0 OUT= MAC=00 SRC=10.0.0.2 DST=10.0.0.1"
    kmsg_file = tmp_path / "kmsg"
    kmsg_file.write_text("".join(line + "\n" for line in kmsg(forged)))
    sysctl = tmp_path / "nf_log_all_netns"
    sysctl.write_text("1\n")
    ev = KmsgLog(str(kmsg_file), nf_log_all_netns=str(sysctl)).events()
    assert ev.forgeable and [x.code for x in ev.xids] == [79]
    assert judge(NONE, ev, BUS).state is State.OK and judge(NONE, ev, BUS).notes
    assert judge(GpuHealth(), ev, BUS).state is State.NEEDS_REBOOT
    sysctl.write_text("0\n")
    ev0 = KmsgLog(str(kmsg_file), nf_log_all_netns=str(sysctl)).events()
    assert not ev0.forgeable and judge(NONE, ev0, BUS).state is State.NEEDS_REBOOT
    assert not KmsgLog(str(kmsg_file), nf_log_all_netns=str(tmp_path / "absent")).events().forgeable
