"""The reset side by side on a GPU node (root, an NVIDIA GPU, nvidia-ml-py, nvidia-smi, nsenter, fuser).

Builds each scenario from a verified idle GPU, runs one method, reads the truth one second after the
verdict with host NVML (the official nvidia-ml-py binding) plus a /proc scan, checks the processes outside
the target, and tears everything down. What the numbers mean is bench/sbs_model.py; bench/reset.py drives it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench import sbs_model as M
from bench import sbs_node as N
from bench.pvesh_shim import launcher as pvesh_launcher
from tests.pvelike import etc_pve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLDER = os.path.join(REPO, "bench", "cuda_hold.py")
MIB = 1 << 20
NODE = "sbs"


class Nvml:
    """Host NVML for GPU index ``index``: v2 used memory and the listed processes."""

    def __init__(self, index: int = 0) -> None:
        import pynvml  # nvidia-ml-py, the official binding: needed on a GPU node only

        self.nv = pynvml
        pynvml.nvmlInit()
        self.index = index
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.minor = pynvml.nvmlDeviceGetMinorNumber(self.h)

    def used_mib(self) -> float | None:
        try:
            return self.nv.nvmlDeviceGetMemoryInfo(self.h, version=self.nv.nvmlMemory_v2).used / MIB
        except self.nv.NVMLError:
            return None

    def listed(self) -> list[tuple[int, float]]:
        out: dict[int, float] = {}
        for fn in (self.nv.nvmlDeviceGetComputeRunningProcesses, self.nv.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in fn(self.h):
                    out[p.pid] = (p.usedGpuMemory or 0) / MIB
            except self.nv.NVMLError:
                pass
        return sorted(out.items())


def smi() -> str:
    return subprocess.run(M.SMI_QUERY, capture_output=True, text=True, timeout=30).stdout


class Bench:
    """One benchmark session: the PVE-like tree, pvegpu's settings, the pvesh stand-in, the idle GPU."""

    def __init__(self, grace: float, pvegpu: list[str], python: str = sys.executable, index: int = 0) -> None:
        self.nvml = Nvml(index)
        self.python = python
        self.tmp = tempfile.mkdtemp(prefix="sbs-")
        conf = f"arch: amd64\ndev0: /dev/nvidia{self.nvml.minor},gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: sbs\n"
        self.pve_root = etc_pve(os.path.join(self.tmp, "pve"), NODE, {M.TARGET: conf, M.NEIGHBOUR: conf})
        self.config = os.path.join(self.tmp, "pvegpu.toml")
        with open(self.config, "w") as f:
            f.write(f'pve_root = "{self.pve_root}"\nnode = "{NODE}"\n[api]\nbackend = "local"\n[reset]\ngrace = {grace}\n')
        os.chmod(self.config, 0o644)  # a settings file is refused when others may write it: never the umask's choice
        shim_dir = os.path.join(self.tmp, "bin")
        os.makedirs(shim_dir)
        pvesh_launcher(shim_dir, REPO, python)
        self.pvesh_log = os.path.join(self.tmp, "pvesh.log")
        self.env = dict(os.environ, PATH=shim_dir + os.pathsep + os.environ.get("PATH", ""), SBS_PVESH_LOG=self.pvesh_log,
                        SBS_PYTHON=python, PYTHONPATH=REPO)
        self.pvegpu_argv = pvegpu
        self.kill = M.PKILL if shutil.which("pkill") else M.KILL_LOOP
        self.host_procs: list[subprocess.Popen] = []
        self.teardown()
        self.idle_mib = self.wait_baseline(idle=None)
        self.smi_idle = M.parse_smi(smi()).get(index, 0.0)
        self.devs = {(195, self.nvml.minor), (195, 255)}
        self.prime_settings(written=os.stat(self.config).st_mtime)

    def prime_settings(self, written: float) -> None:
        """Have pvegpu read its settings once, untimed, as every command after a node's first does (a settings file
        younger than 2 s is read afresh each time: the wait is that long at most)."""
        wait = written + 2.1 - time.time()
        if wait > 1:
            print(f"reset: waiting {wait:.1f} s for the settings file to be 2 s old", file=sys.stderr, flush=True)
        time.sleep(max(0.0, wait))
        subprocess.run([*self.pvegpu_argv, "--config", self.config, "reset", "999999999", "--dry-run", "--json"], env=self.env,
                       capture_output=True, timeout=60, stdin=subprocess.DEVNULL)  # no such guest: settings read, nothing done

    # -- state ------------------------------------------------------------------------------------
    def wait_baseline(self, idle: float | None, timeout: float = 30) -> float:
        """Wait until NVML lists nothing and (once known) used is back at idle; returns used."""
        end = time.monotonic() + timeout
        while True:
            used = self.nvml.used_mib()
            ref = used if idle is None else idle  # the first call learns idle: only "nothing listed" is checked
            why = M.baseline_problem(used, [p for p, _ in self.nvml.listed()], ref if ref is not None else 0.0)
            if why is None:
                assert used is not None
                return used
            if time.monotonic() > end:
                raise RuntimeError(f"GPU not at its idle baseline after {timeout:g} s: {why}")
            time.sleep(0.05)

    def teardown(self) -> None:
        for p in self.host_procs:
            p.kill()
            p.wait()
        self.host_procs.clear()
        for v in (M.TARGET, M.NEIGHBOUR):
            N.kill_ct(v)

    def _wait_ready(self, ready_dir: str, count: int, at_least_mib: float, alive: list[int], timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while True:
            n = len([f for f in os.listdir(ready_dir) if f.startswith("ready")])
            used = self.nvml.used_mib() or 0.0
            if n >= count and used >= at_least_mib:
                return
            dead = [p for p in alive if N.start_time(p) is None]
            if dead:
                raise RuntimeError(f"workload died before it was ready (pid {dead}); see {ready_dir}")
            if time.monotonic() > end:
                raise RuntimeError(f"workload not ready after {timeout:g} s: {n}/{count} markers, {used:.0f} MiB used")
            time.sleep(0.05)

    def _holder_ct(self, vmid: int, s: M.Scenario, gib: float) -> None:
        ready = tempfile.mkdtemp(dir=self.tmp, prefix=f"ready-{vmid}-")
        script = M.workload_script(s, self.python, HOLDER, ready, self.nvml.minor, N.ns_cgroup(vmid))
        if vmid != M.TARGET:  # a neighbour: one plain holder
            script = "exec " + " ".join(M.holder_argv(self.python, HOLDER, gib, ready + "/ready")) + "\n"
        subs = (M.NESTED_CGROUP,) if s.kind == "nested" and vmid == M.TARGET else ()
        init = N.start_ct(vmid, script, self.python, subs)
        want = (self.nvml.used_mib() or 0.0) + gib * 1024 * 0.9
        self._wait_ready(ready, M.ready_count(s) if vmid == M.TARGET else 1, want, [init])

    def setup(self, s: M.Scenario) -> tuple[float, float]:
        """Build the scenario from the idle GPU; returns (keep_mib, allocated_mib)."""
        self.wait_baseline(self.idle_mib)
        if s.neighbour_gib:
            self._holder_ct(M.NEIGHBOUR, s, s.neighbour_gib)
        if s.host_gib:
            ready = tempfile.mkdtemp(dir=self.tmp, prefix="ready-host-")
            want = (self.nvml.used_mib() or 0.0) + s.host_gib * 1024 * 0.9
            p = subprocess.Popen(M.holder_argv(self.python, HOLDER, s.host_gib, ready + "/ready"), stdin=subprocess.DEVNULL)
            self.host_procs.append(p)
            self._wait_ready(ready, 1, want, [p.pid])
        keep = self.nvml.used_mib() or 0.0
        self._keep = keep
        self._holder_ct(M.TARGET, s, s.gib)
        if s.kind == "respawn":
            time.sleep(0.2)
        return keep, (self.nvml.used_mib() or 0.0) - keep

    def outside(self) -> dict[int, tuple[int, str, str]]:
        """Every process outside the target that the scenario started (a neighbour CT, host holders)."""
        pids = N.ct_pids(M.NEIGHBOUR) + [p.pid for p in self.host_procs]
        return N.identities(pids, M.TARGET)

    def truth(self) -> M.Truth:
        listed = [{"pid": pid, "owner": N.owner(pid, M.TARGET), "mib": round(mib)} for pid, mib in self.nvml.listed()]
        holders = N.device_holders([p for p in N.ct_pids(M.TARGET) if p != N.find_init(M.TARGET)], self.devs)
        return M.Truth(self.nvml.used_mib(), listed, holders)

    # -- the three methods ------------------------------------------------------------------------
    def manual(self) -> tuple[float, str, str, dict]:
        """pct exec VMID -- sh -c 'pkill -9 python; fuser -k /dev/nvidia*; sleep 3; nvidia-smi --query-gpu=...'"""
        init = N.find_init(M.TARGET)
        routine = M.MANUAL_ROUTINE.format(kill=self.kill)
        t = time.perf_counter()
        p = subprocess.run(["nsenter", "-t", str(init), "-m", "-p", "--", "sh", "-c", routine], capture_output=True, text=True, timeout=60)
        wall = time.perf_counter() - t
        verdict, detail = M.verdict_from_smi(p.stdout, self.nvml.index, self.smi_idle)
        return wall, verdict, detail, {"routine": routine}

    def restart(self) -> tuple[float, str, str, dict]:
        """pct stop VMID; pct start VMID; nvidia-smi --query-gpu=index,memory.used"""
        t = time.perf_counter()
        stopped = N.kill_ct(M.TARGET)
        N.start_ct(M.TARGET, "", self.python)
        out = smi()
        wall = time.perf_counter() - t
        verdict, detail = M.verdict_from_smi(out, self.nvml.index, self.smi_idle)
        if not stopped:
            verdict, detail = "not clean", "processes survived the stop; " + detail
        return wall, verdict, detail, {}

    def pvegpu(self) -> tuple[float, str, str, dict]:
        """pvegpu --config FILE reset VMID --json, as a whole process."""
        open(self.pvesh_log, "w").close()
        argv = [*self.pvegpu_argv, "--config", self.config, "reset", str(M.TARGET), "--json"]
        t0 = time.monotonic()
        t = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        verdict, detail, extra = M.verdict_from_pvegpu(p.returncode, p.stdout)
        with open(self.pvesh_log) as f:
            extra["api_calls"] = f.read().split("\n")[:-1]
        extra |= M.pvegpu_phases(p.stdout, t0, wall)
        if verdict == "error":
            extra["stderr_tail"] = p.stderr[-800:]
        return wall, verdict, detail, extra

    def floor(self) -> tuple[float, str, str, dict]:
        """The physical floor: SIGKILL to every process of the target but its init (known, not searched for), NVML
        polled every 5 ms until it first shows the memory back to what others keep."""
        init = N.find_init(M.TARGET)
        pids = [p for p in N.ct_pids(M.TARGET) if p != init]
        t = time.perf_counter()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            used = self.nvml.used_mib()
            back = used is not None and used <= self._keep + M.THRESHOLD_MIB and not {p for p, _ in self.nvml.listed()} & set(pids)
            release = time.perf_counter() - t
            if back:
                return release, "clean", f"memory back {release:.3f} s after SIGKILL", {"release_s": round(release, 4)}
            if release > 30:
                return release, "not clean", f"memory not back 30 s after SIGKILL ({used} MiB)", {}
            time.sleep(0.005)

    def run(self, s: M.Scenario, method: str, rep: int = 0) -> M.Run:
        r = M.Run(s.key, method, rep)
        try:
            r.keep_mib, r.allocated_mib = self.setup(s)
            before = self.outside()
            fn = {"manual": self.manual, "restart": self.restart, "pvegpu": self.pvegpu, "floor": self.floor}[method]
            r.wall_s, r.verdict, r.detail, r.extra = fn()
            time.sleep(1.0)
            r.truth = self.truth()
            r.collateral = M.collateral(before, {p: N.start_time(p) for p in before})
        except Exception as exc:  # one broken run must not stop the others; it is recorded as such
            r.verdict, r.detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self.teardown()
        return M.finish(r)

    def close(self) -> None:
        self.teardown()
        shutil.rmtree(self.tmp, ignore_errors=True)
