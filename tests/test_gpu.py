"""Real CUDA holders in PVE-like containers (cgroup /lxc/<vmid>/ns + PID namespace) on a real GPU.

Marker ``gpu``: skipped where NVML or CUDA is missing (CI has no GPU); run on the device H200.
Set PVEGPU_RESULTS=<file> to append a (scenario, outcome, wall time) row per scenario.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.etcpve import EtcPve
from pvegpu.adapters.procfs import ProcHost
from pvegpu.core.model import MIB
from pvegpu.reset import Ports, ResetPolicy, reset
from tests import pvelike


def _nvml_ok() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces"),
]

ALLOC = "import torch,time,signal,os\n{pre}\nx=torch.empty({gib}<<30,dtype=torch.uint8,device='cuda'); x.fill_(1); torch.cuda.synchronize()\n{post}\ntime.sleep(3600)\n"
SPAWN = """
import torch, torch.multiprocessing as mp, time
def work(i):
    x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize(); time.sleep(3600)
if __name__ == '__main__':
    mp.set_start_method('spawn'); ps = [mp.Process(target=work, args=(i,)) for i in range(3)]
    [p.start() for p in ps]; time.sleep(3600)
"""


class NoApi:
    """PveApi stand-in that reads the real /etc/pve-like tree and refuses power actions (none expected)."""

    def __init__(self, root: str) -> None:
        self.etc = EtcPve(root)
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self.etc, name)

    def ct_status(self, guest):
        from pvegpu.core.model import CtStatus

        return CtStatus("running")

    def ct_stop(self, guest):
        self.calls.append("stop")
        raise AssertionError("no restart expected")

    ct_start = ct_stop


def _used_mib() -> float:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used / MIB


def _wait_used(at_least_mib: float, deadline: float = 120) -> None:
    end = time.monotonic() + deadline
    while _used_mib() < at_least_mib:
        assert time.monotonic() < end, f"workload did not allocate {at_least_mib} MiB in {deadline} s"
        time.sleep(0.2)


def _minor0() -> int:
    import pynvml

    return pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(0))


def _record(name: str, rep, extra: dict | None = None) -> None:
    path = os.environ.get("PVEGPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": name, "outcome": rep.outcome, "exit": rep.exit_code, "wall_s": round(rep.elapsed, 3),
                                "signalled": len([s for s in rep.signalled if s["result"] == "sent"])} | (extra or {})) + "\n")


@pytest.fixture
def node(tmp_path):
    minor = _minor0()
    conf = f"arch: amd64\ndev0: /dev/nvidia{minor},gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: gpu\n"
    root = pvelike.etc_pve(str(tmp_path / "pve"), "dev-h200", {301: conf, 302: conf, 303: conf})
    cts: list[int] = []
    host_procs: list[subprocess.Popen] = []
    before = _used_mib()
    yield root, cts, host_procs
    for p in host_procs:
        p.kill()
        p.wait()
    for v in cts:
        pvelike.destroy_ct(v)
    end = time.monotonic() + 30  # let the driver hand the memory back before the next test measures
    while _used_mib() > before + 64 and time.monotonic() < end:
        time.sleep(0.1)


def _reset(root: str, vmid: int, grace: float = 3.0):
    from pvegpu.adapters.nvml import NvmlProbe

    api = NoApi(root)
    with NvmlProbe() as probe:
        rep = reset(vmid, Ports(api, probe, ProcHost(), SystemClock()), ResetPolicy(grace=grace, timeout=20, restart=False))
    assert api.calls == []
    return rep


def _baseline() -> float:
    return _used_mib()


def _run_ct(node, vmid: int, code: str) -> None:
    root, cts, _ = node
    cts.append(vmid)
    script = os.path.join(os.path.dirname(root), f"workload-{vmid}.py")
    with open(script, "w") as f:
        f.write(code)
    pvelike.start_ct(vmid, [sys.executable, script])


@pytest.mark.parametrize("name,code,gib", [
    ("single process", ALLOC.format(pre="", gib=2, post=""), 2),
    ("torch spawn workers (3)", SPAWN, 3),
    ("fork after CUDA init, parent exits", ALLOC.format(pre="", gib=2, post="import os\nif os.fork(): os._exit(0)"), 2),
    ("ignores SIGTERM", ALLOC.format(pre="signal.signal(signal.SIGTERM, signal.SIG_IGN)", gib=2, post=""), 2),
], ids=["single", "spawn", "fork-after-init", "ignore-term"])
def test_reset_frees_container_holders(node, name, code, gib):
    """pvegpu reset frees every real CUDA holder of the container and says clean only when NVML agrees."""
    root = node[0]
    base = _baseline()
    _run_ct(node, 301, code)
    _wait_used(base + gib * 1024 * 0.9)
    rep = _reset(root, 301)
    _record(name, rep)
    assert rep.outcome == "clean", rep.diagnosis
    assert _used_mib() <= base + 64
    assert all(s["cgroup"].startswith("/lxc/301/") for s in rep.signalled)


def test_reset_spares_second_container_and_host_process(node):
    """Holders of another container and of the host keep their memory; only the target is signalled."""
    root, _cts, host_procs = node
    base = _baseline()
    _run_ct(node, 301, ALLOC.format(pre="", gib=2, post=""))
    _run_ct(node, 302, ALLOC.format(pre="", gib=3, post=""))
    host_procs.append(subprocess.Popen([sys.executable, "-c", ALLOC.format(pre="", gib=1, post="")]))
    _wait_used(base + 5.6 * 1024)
    others = set(pvelike.ct_procs(302)) | {host_procs[0].pid}
    rep = _reset(root, 301)
    _record("second container + host process share the GPU", rep, {"kept_mib": round(_used_mib() - base)})
    assert rep.outcome == "clean", rep.diagnosis
    assert not {s["pid"] for s in rep.signalled} & others
    assert host_procs[0].poll() is None and all(os.path.exists(f"/proc/{p}") for p in pvelike.ct_procs(302))
    assert _used_mib() >= base + 3.5 * 1024  # 302's 3 GiB and the host's 1 GiB are still there


def test_gate_refuses_leftover_then_allows_after_reset(node, tmp_path):
    """The guard refuses a start while a fork-after-init child holds memory, and allows it after reset."""
    root = node[0]
    base = _baseline()
    code = ALLOC.format(pre="", gib=2, post="import os\nif os.fork(): os._exit(0)")
    _run_ct(node, 303, code)
    _wait_used(base + 1.8 * 1024)
    guard = pvelike.guard(str(tmp_path), pvelike.launcher(str(tmp_path)))
    cfg = tmp_path / "pvegpu.toml"
    cfg.write_text(f'pve_root = "{root}"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    env = {"PVEGPU_CONFIG": str(cfg)}
    refused = pvelike.run_as_pve(guard, 303, "pre-start", env)
    assert refused.returncode == 10 and "refusing to start CT 303" in refused.stderr
    rep = _reset(root, 303)
    assert rep.outcome == "clean"
    allowed = pvelike.run_as_pve(guard, 303, "pre-start", env)
    # the container's stand-in init is still in the cgroup; a real stop removes it
    pvelike.destroy_ct(303)
    allowed = pvelike.run_as_pve(guard, 303, "pre-start", env)
    assert allowed.returncode == 0, allowed.stderr
    _record("gate: fork-after-init leftover refused, allowed after reset", rep, {"refused_exit": refused.returncode, "allowed_exit": allowed.returncode})


def _guard_env(tmp_path, root: str, extra: str = "") -> tuple[str, dict[str, str]]:
    guard = pvelike.guard(str(tmp_path), pvelike.launcher(str(tmp_path)))
    cfg = tmp_path / "gate.toml"
    cfg.write_text(f'pve_root = "{root}"\n{extra}')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    return guard, {"PVEGPU_CONFIG": str(cfg)}


@pytest.mark.parametrize("case", ["clean", "shared", "exclusive", "host-process", "host-process-refused", "survivor-in-cgroup"])
def test_gate_on_real_gpu(node, tmp_path, case):
    """The guard, run as PVE runs it, allows clean and shared GPUs and a host CUDA job as a sharer (the default
    gate.host_users = share), and refuses exclusive sharing, a host job with gate.host_users = refuse, and a
    process left in the container's cgroup."""
    root = node[0]
    base = _baseline()
    extra = ""
    if case in ("shared", "exclusive"):
        _run_ct(node, 302, ALLOC.format(pre="", gib=1, post=""))
        _wait_used(base + 900)
        extra = "[gate]\nexclusive = [301]\n" if case == "exclusive" else ""
    elif case in ("host-process", "host-process-refused"):
        extra = "[gate]\nhost_users = \"refuse\"\n" if case == "host-process-refused" else ""
        node[2].append(subprocess.Popen([sys.executable, "-c", ALLOC.format(pre="", gib=1, post="")]))
        _wait_used(base + 900)
    elif case == "survivor-in-cgroup":
        _run_ct(node, 301, ALLOC.format(pre="", gib=1, post=""))
        _wait_used(base + 900)
    guard, env = _guard_env(tmp_path, root, extra)
    t = time.perf_counter()
    r = pvelike.run_as_pve(guard, 301, "pre-start", env)
    wall = time.perf_counter() - t
    want = 0 if case in ("clean", "shared", "host-process") else 10
    assert r.returncode == want, r.stdout + r.stderr
    path = os.environ.get("PVEGPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": f"gate: {case}", "outcome": "allowed" if r.returncode == 0 else "refused",
                                "exit": r.returncode, "wall_s": round(wall, 3)}) + "\n")


NESTED_EXIT_MAIN = """
import torch, threading, time, ctypes
def work():
    x = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize(); time.sleep(3600)
threading.Thread(target=work).start()
time.sleep(15)
ctypes.CDLL(None).pthread_exit(None)  # the main thread exits; the worker keeps the context
"""


def test_nested_pid_namespace_init_is_stopped(node):
    """A CUDA holder that is PID 1 of a PID namespace nested in the container (docker/podman in the CT) is
    payload: reset stops it, well before its timeout, and never restarts the container."""
    root, cts, _ = node
    base = _baseline()
    script = os.path.join(os.path.dirname(root), "nested.py")
    with open(script, "w") as f:
        f.write(ALLOC.format(pre="", gib=2, post=""))
    cts.append(301)
    pvelike.start_ct(301, ["unshare", "--pid", "--fork", sys.executable, script])
    _wait_used(base + 1.8 * 1024)
    rep = _reset(root, 301)
    _record("holder is PID 1 of a nested PID namespace", rep)
    assert rep.outcome == "clean", rep.diagnosis
    assert rep.elapsed < 10 and _used_mib() <= base + 64
    assert any(s["signal"] == "SIGKILL" or s["signal"] == "SIGTERM" for s in rep.signalled)


def test_process_whose_main_thread_exited_is_stopped(node):
    """A CUDA process whose main thread exited (leader is a zombie, a thread holds the context) is a live
    holder: reset signals it through its pidfd and the memory comes back."""
    root = node[0]
    base = _baseline()
    _run_ct(node, 301, NESTED_EXIT_MAIN)
    _wait_used(base + 1.8 * 1024)
    time.sleep(16)  # until the main thread has exited
    rep = _reset(root, 301)
    _record("holder whose main thread exited", rep)
    assert rep.outcome == "clean", rep.diagnosis
    assert _used_mib() <= base + 64


def test_neighbours_fork_child_on_shared_gpu(node, tmp_path):
    """A fork-inherited context in a neighbour container (NVML lists only its dead parent, whose session the child
    is in): resetting this container is clean at once, the neighbour is untouched, and this container's start is
    allowed as shared."""
    root = node[0]
    base = _baseline()
    _run_ct(node, 302, ALLOC.format(pre="", gib=2, post="import os\nos.setsid()\nif os.fork(): os._exit(0)"))  # a service's fork child
    _run_ct(node, 301, ALLOC.format(pre="", gib=1, post=""))
    _wait_used(base + 2.8 * 1024)
    neighbour = set(pvelike.ct_procs(302))
    rep = _reset(root, 301)
    _record("neighbour's fork-inherited context on the shared GPU", rep, {"kept_mib": round(_used_mib() - base)})
    assert rep.outcome == "clean" and rep.exit_code == 0, rep.diagnosis
    assert rep.elapsed < 5 and not {s["pid"] for s in rep.signalled} & neighbour
    assert _used_mib() >= base + 1.8 * 1024  # the neighbour's 2 GiB stay
    pvelike.destroy_ct(301)
    guard, env = _guard_env(tmp_path, root)
    r = pvelike.run_as_pve(guard, 301, "pre-start", env)
    assert r.returncode == 0 and "shared with CT 302" in r.stdout, r.stdout + r.stderr
