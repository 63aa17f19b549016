"""A failing GPU is a row, never the whole node gone: pvegpu's NVML reader (nvidia-ml-py) on a stand-in driver that
fails per GPU, as each command opens it (the gate's and reset's bounded reader, the audit's with details), and what
audit, the gate and reset make of it. A driver without the PCI info call gives a GPU of bus '?', a failing minor
read a lost GPU named by its index, a failing GPU count an error in the driver's words.

The stand-in node has four GPUs: index 0 healthy; index 1 lost at enumeration (no handle: its minor is unknown);
index 2 listed but its memory read fails; index 3 listed but its UUID read fails.
"""

from __future__ import annotations

import sys
import types

import pytest

from pvegpu import wiring
from pvegpu.adapters import nvml
from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.adapters.nvml import NvmlProbe
from pvegpu.audit.model import FlagKind
from pvegpu.audit.prom import render
from pvegpu.audit.render import audit_table
from pvegpu.audit.run import audit_document, run_audit
from pvegpu.core import errors as E
from pvegpu.core.model import MIB
from pvegpu.core.settings import Settings
from pvegpu.gate.decide import GatePolicy, GatePorts, evaluate
from pvegpu.reset import Ports, ResetPolicy, reset
from tests.fakes import FakeClock, FakeHost, FakePve
from tests.test_audit import NODES, FakeFiles
from tests.test_audit_outputs import samples

GPUS = [
    {"minor": 0, "uuid": "GPU-ok-0"},
    {"lost": True},
    {"minor": 2, "uuid": "GPU-read-2", "read_fails": True},
    {"minor": 3, "uuid": "GPU-uuid-3", "uuid_fails": True},
]
LOST, READ = "GPU is lost", "Unknown Error"


class _Err(Exception):
    pass


def fake_pynvml(gpus=GPUS):
    """A stand-in pynvml over ``gpus``: raises NVMLError where the spec says the driver fails."""
    m = types.SimpleNamespace(NVMLError=_Err, nvmlMemory_v2=2)
    m.NVMLError_NotSupported = type("NS", (_Err,), {})
    m.NVMLError_FunctionNotFound = type("FNF", (_Err,), {})
    m.NVMLLibraryMismatchError = type("LM", (_Err,), {})

    def spec(h):
        return gpus[h]

    def handle(i):
        if gpus[i].get("lost"):
            raise _Err(LOST)
        return i

    def uuid(h):
        if spec(h).get("uuid_fails"):
            raise _Err(READ)
        return spec(h)["uuid"]

    def memory(h, version=None):
        if spec(h).get("read_fails") and version is not None:
            raise _Err(READ)
        return types.SimpleNamespace(total=1000 * MIB, used=h * 100 * MIB, reserved=0)

    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetMinorNumber = lambda h: spec(h)["minor"]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetUUID = uuid
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busIdLegacy=f"0000:{h + 1:02x}:00.0".encode())
    m.nvmlDeviceGetMemoryInfo = memory

    def remap(h):
        if spec(h).get("no_remap"):
            raise m.NVMLError_NotSupported()
        return (0, 0, *spec(h).get("remap", (0, 0)))

    def retired(h):
        raise m.NVMLError_NotSupported()

    m.nvmlDeviceGetRemappedRows = remap
    m.nvmlDeviceGetRetiredPagesPendingStatus = retired
    m.nvmlDeviceGetMigMode = lambda h: [1 if spec(h).get("mig") else 0, 0]
    m.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    m.NVML_DEVICE_MIG_ENABLE = 1
    for name in ("Compute", "Graphics", "MPSCompute"):
        setattr(m, f"nvmlDeviceGet{name}RunningProcesses", lambda h: [])
    return m


def use(monkeypatch, module):
    """``module`` as the pynvml pvegpu's NVML reader (``adapters/nvml.py``) drives, for this test."""
    monkeypatch.setattr(nvml, "pynvml", module)
    return module


def full_probe(monkeypatch, gpus=GPUS):
    """nvidia-ml-py's reader itself."""
    use(monkeypatch, fake_pynvml(gpus))
    return NvmlProbe()


def reader_probe(monkeypatch, gpus=GPUS):
    """The reader the gate and reset open (``wiring.nvml_reader``): bounded, NVML opened in its thread, begun early."""
    use(monkeypatch, fake_pynvml(gpus))
    probe = wiring.nvml_reader(Settings())
    probe.begin()
    return probe


def audit_probe(monkeypatch, gpus=GPUS):
    """The reader ``pvegpu audit`` opens (``world(s).audit_probe``): bounded, with details, started."""
    use(monkeypatch, fake_pynvml(gpus))
    probe = wiring.nvml_reader(Settings(), details=True)
    probe.start()
    return probe


ADAPTERS = pytest.mark.parametrize("make", [full_probe, reader_probe, audit_probe], ids=["nvidia-ml-py", "gate-reset", "audit"])


@ADAPTERS
def test_a_failing_gpu_never_hides_the_others(monkeypatch, make):
    """gpus(): the lost GPU is left out and named by index; the others are listed, whatever else fails on them."""
    p = make(monkeypatch)
    got = p.gpus()
    assert [(g.index, g.minor) for g in got] == [(0, 0), (2, 2), (3, 3)]
    assert list(p.lost) == [1] and LOST in p.lost[1] and p.failed == [p.lost[1]]
    assert [g.uuid for g in got] == ["GPU-ok-0", "GPU-read-2", "?"]


@ADAPTERS
def test_a_failing_read_is_an_unknown_sample_never_zero(monkeypatch, make):
    """sample(): the healthy GPU is read; a failed memory read and a failed identity read are unknown, with the reason."""
    p = make(monkeypatch)
    p.gpus()
    s = p.sample([0, 2, 3])
    assert s[0].known and s[0].used_bytes == 0 and s[0].processes == ()
    for m in (2, 3):
        assert not s[m].known and s[m].used_bytes is None and s[m].processes is None and READ in (s[m].error or "")


@ADAPTERS
def test_every_gpu_failing_is_an_error_for_the_node(monkeypatch, make):
    """When no GPU can be named at all, gpus() raises GpuQueryError (exit 5) naming each failure."""
    p = make(monkeypatch, [{"lost": True}, {"lost": True}])
    with pytest.raises(E.GpuQueryError, match="no GPU can be read") as exc:
        p.gpus()
    assert exc.value.exit_code == E.EXIT_GPU_UNKNOWN and list(p.lost) == [0, 1]


HEALTHY = [{"minor": 0, "uuid": "GPU-a", "remap": (1, 0)}, {"minor": 1, "uuid": "GPU-b", "mig": True, "no_remap": True},
           {"lost": True}, {"minor": 3, "uuid": "GPU-c", "read_fails": True}]


def test_the_audits_reader_reads_identity_and_health_unknowns_too(monkeypatch):
    """The audit's reader names each GPU it can (bus id, name, total), the lost one by index, samples the readable
    ones, and reads each GPU's health: what the driver cannot tell is None (unknown), never a value; a GPU it
    cannot name at all is a GpuQueryError."""
    audit = audit_probe(monkeypatch, HEALTHY)
    assert [(g.index, g.minor, g.uuid, g.bus_id, g.name, g.total_bytes) for g in audit.gpus()] == [
        (0, 0, "GPU-a", "0000:01:00.0", "NVIDIA H200", 1000 * MIB), (1, 1, "GPU-b", "0000:02:00.0", "NVIDIA H200", 1000 * MIB),
        (3, 3, "GPU-c", "0000:04:00.0", "NVIDIA H200", 1000 * MIB)]
    assert list(audit.lost) == [2] and LOST in audit.lost[2]
    a = audit.sample([0, 1, 3])
    assert a[0].used_bytes == 0 and a[1].used_bytes == 100 * MIB and a[3].used_bytes is None and READ in (a[3].error or "")
    h0, h1 = audit.health(0), audit.health(1)
    assert h0.remap_pending is True and h0.remap_failed is False and h0.retired_pages_pending is None
    assert h1.remap_pending is None and h1.mig_enabled is True and h0.driver_version == "580.159.04"
    assert audit.health(3).reserved_bytes is None
    with pytest.raises(E.GpuQueryError):  # a GPU NVML cannot name: its health is unknown, not a reading of all-None
        audit.health(7)


def test_the_gates_reader_reads_no_more_than_it_needs(monkeypatch):
    """Without details (the gate, reset) the reader reads no PCI info nor total: a GPU whose bus id read would fail
    still samples, and its bus id is empty; with details (the audit) that GPU is unknown."""
    calls = []
    m = use(monkeypatch, fake_pynvml([{"minor": 0, "uuid": "GPU-a"}]))

    def pci(h):
        calls.append("pci")
        raise m.NVMLError("Unknown Error")

    m.nvmlDeviceGetPciInfo = pci
    probe = NvmlProbe()
    (g,) = probe.gpus()
    assert not calls and g.bus_id == "" and g.total_bytes is None and probe.sample([0])[0].known
    detailed = NvmlProbe(details=True)
    (g,) = detailed.gpus()
    assert calls == ["pci"] and g.bus_id == "?" and not detailed.sample([0])[0].known


def test_bounded_probe_passes_the_lost_gpus_on(monkeypatch):
    """BoundedProbe shows the inner probe's lost GPUs (by index) and their reasons."""
    b = BoundedProbe(full_probe(monkeypatch), deadline=5)
    b.gpus()
    assert list(b.lost) == [1] and b.failed == [b.lost[1]]


def _node():
    host = FakeHost(FakeClock())
    pve = FakePve(host)
    return host, pve


def test_audit_shows_each_failing_gpu_as_a_row(monkeypatch):
    """Audit: one row per GPU (the lost one by index, minor unknown), each failing one flagged unreadable-gpu; the
    healthy GPU keeps its numbers; the textfile has gpu_up 0 for each failing GPU and no duplicate series."""
    host, pve = _node()
    pve.add_ct(129)
    rep = run_audit(pve=pve, probe=BoundedProbe(full_probe(monkeypatch), 5), host=host, files=FakeFiles(NODES))
    assert rep.error is None and [(g.index, g.minor) for g in rep.gpus] == [(0, 0), (1, -1), (2, 2), (3, 3)]
    ok, lost, unread, nouuid = rep.gpus
    assert ok.error is None and ok.used_bytes == 0
    assert LOST in (lost.error or "") and READ in (unread.error or "") and READ in (nouuid.error or "")
    assert sorted(f.subject for f in rep.flags if f.kind is FlagKind.UNREADABLE) == ["GPU 1", "GPU 2", "GPU 3"]
    doc = audit_document([rep], generated_at=1.0)
    m = samples(render(doc).decode())
    up = {(lb["uuid"], lb["minor"]): v for lb, v in m["pvegpu_gpu_up"]}
    assert up == {("GPU-ok-0", "0"): 1.0, ("?", "?"): 0.0, ("GPU-read-2", "2"): 0.0, ("?", "3"): 0.0}
    assert "/dev/nvidia?" in audit_table(doc)


def test_two_lost_gpus_do_not_make_a_duplicate_series(monkeypatch):
    """Two GPUs NVML cannot name: two rows, one gpu_up series for them (labels uuid and minor '?'), parseable."""
    host, pve = _node()
    gpus = [{"minor": 0, "uuid": "GPU-ok-0"}, {"lost": True}, {"lost": True}]
    rep = run_audit(pve=pve, probe=full_probe(monkeypatch, gpus), host=host, files=FakeFiles(NODES))
    assert [g.index for g in rep.gpus] == [0, 1, 2]
    text = render(audit_document([rep], generated_at=1.0)).decode()
    assert [line for line in text.splitlines() if line.startswith("pvegpu_gpu_up{")].__len__() == 2
    samples(text)


ONE = [{"minor": 0, "uuid": "GPU-ok-0"}]


def _audit_reader(monkeypatch, m):
    """The reader ``pvegpu audit`` opens (``world(s).audit_probe``: details, started) over the stand-in pynvml ``m``."""
    use(monkeypatch, m)
    probe = wiring.nvml_reader(Settings(), details=True)
    probe.start()
    return probe


def test_a_driver_without_pci_info_is_an_unknown_gpu_not_an_internal_error(monkeypatch):
    """A driver whose NVML lacks the PCI info call: the audit lists the GPU with bus '?' and unknown samples, never an error."""
    m = fake_pynvml(ONE)

    def pci(h):
        raise m.NVMLError_FunctionNotFound("Function Not Found")

    m.nvmlDeviceGetPciInfo = pci
    probe = _audit_reader(monkeypatch, m)
    (g,) = probe.gpus()
    assert g.bus_id == "?" and not probe.sample([0])[0].known
    host, pve = _node()
    pve.add_ct(129)
    rep = run_audit(pve=pve, probe=_audit_reader(monkeypatch, m), host=host, files=FakeFiles(NODES))
    assert [g.minor for g in rep.gpus] == [0]


def test_a_gpu_whose_minor_read_fails_is_named_lost_by_its_index(monkeypatch):
    """The audit's lost-GPU row text for a failing minor read: 'GPU 0: GPU is lost'."""
    m = fake_pynvml(ONE)

    def minor(h):
        raise _Err(LOST)

    m.nvmlDeviceGetMinorNumber = minor
    audit = _audit_reader(monkeypatch, m)
    with pytest.raises(E.GpuQueryError, match="no GPU can be read: GPU 0: GPU is lost"):
        audit.gpus()
    assert audit.lost == {0: "GPU 0: GPU is lost"}


def test_a_failing_gpu_count_is_reported_with_the_drivers_words(monkeypatch):
    """NVML that cannot count the GPUs: the audit's error says so, with the driver's words."""
    m = fake_pynvml(ONE)

    def count():
        raise _Err(READ)

    m.nvmlDeviceGetCount = count
    with pytest.raises(E.GpuQueryError) as exc:
        _audit_reader(monkeypatch, m).gpus()
    assert exc.value.message == f"NVML could not list the GPUs: {READ}"

@pytest.mark.parametrize("make", [full_probe, reader_probe], ids=["nvidia-ml-py", "gate-reader"])
def test_gate_refuses_only_for_a_granted_gpu_it_cannot_read(monkeypatch, make):
    """Gate: a CT granted only the healthy GPU starts; one granted a GPU NVML could not name, or one whose reads
    fail, is refused as unknown (fail closed)."""
    host, pve = _node()
    pve.add_ct(129, minors=(0,))
    pve.add_ct(130, minors=(1,))  # minor 1 is nowhere: NVML lost a GPU, which may be it
    pve.add_ct(131, minors=(2,))
    verdict = {v: evaluate(v, GatePorts(pve, make(monkeypatch), host), GatePolicy()).decision.allow for v in (129, 130, 131)}
    assert verdict == {129: True, 130: False, 131: False}


def test_reset_of_a_ct_granted_an_unreadable_gpu_exits_5_and_signals_nothing(monkeypatch):
    """Reset: a CT granted a GPU NVML could not name exits 5 (unknown) before any signal; one granted only the
    healthy GPU is clean."""
    host, pve = _node()
    clock = host.clock
    pve.add_ct(130, minors=(0, 1))
    host.add(130, init=True)
    p = host.add(130, minors={0})
    with pytest.raises(E.GpuQueryError, match="minor\\(s\\) 1, not listed by NVML") as exc:
        reset(130, Ports(pve, BoundedProbe(full_probe(monkeypatch), 5), host, clock), ResetPolicy(restart=False))
    assert exc.value.exit_code == E.EXIT_GPU_UNKNOWN and host.signals == [] and p.pid in host.procs
    pve.add_ct(129, minors=(0,))
    host.add(129, init=True)
    rep = reset(129, Ports(pve, BoundedProbe(full_probe(monkeypatch), 5), host, clock), ResetPolicy(restart=False, settle=0.0))
    assert rep.exit_code == 0 and host.signals == []
    pve.add_ct(131)
    pve.configs[131] = "arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\n"  # every GPU, the lost one too
    with pytest.raises(E.GpuQueryError, match="all GPUs") as exc:
        reset(131, Ports(pve, BoundedProbe(full_probe(monkeypatch), 5), host, clock), ResetPolicy(restart=False))
    assert exc.value.exit_code == E.EXIT_GPU_UNKNOWN and host.signals == []


def test_cli_reset_of_a_ct_granted_a_lost_gpu_exits_5_on_the_simulated_node(sim_node):
    """`pvegpu reset` through the command line on the simulated node: CT 130 is granted the GPU NVML lost: exit 5,
    one-line error, its holder on the healthy GPU is not signalled; CT 129 (the healthy GPU only) is clean."""
    import os
    import subprocess

    gpus = [{"minor": 0, "index": 0}, {"minor": 1, "index": 1, "lost": True}]
    n = sim_node({"node": "pve-sim", "gpus": gpus, "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 256}]},
        {"vmid": 130, "gpus": [0, 1], "workloads": [{"kind": "simple", "gpu": 0, "mib": 256}]}]})
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def cli(vmid):
        return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", n.root, "reset", str(vmid), "--no-restart"],
                              capture_output=True, text=True, cwd=repo, timeout=120)

    r = cli(130)
    assert r.returncode == E.EXIT_GPU_UNKNOWN and "GPU is lost" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "SIGTERM" not in r.stdout
    r = cli(129)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("make", [full_probe, reader_probe], ids=["nvidia-ml-py", "gate-reader"])
def test_gate_refuses_a_ct_granted_every_gpu_while_one_is_lost(monkeypatch, make):
    """Gate: a CT granted every GPU (`c 195:*`) while NVML lost one is refused as unknown, like a named grant."""
    host, pve = _node()
    pve.add_ct(131)
    pve.configs[131] = "arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\n"
    probe = make(monkeypatch, [{"minor": 0, "uuid": "GPU-ok-0"}, {"lost": True}])
    assert not evaluate(131, GatePorts(pve, probe, host), GatePolicy()).decision.allow
