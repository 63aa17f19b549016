"""Budget: ``pvegpu audit`` on a node of 2,000 processes takes ≤ 1.5× ``fuser -v /dev/nvidia*``, at 20,000 ≤ 1×.

    python3 bench/audit.py [--sizes 2000,20000] [--rounds 9] [--holders 100] [--node auto|gpu|sim] [--pvegpu CMD]
                           [--out DIR] [--profile DIR]

For each size the node is filled up to that many processes (``/proc`` counted, everything already running included)
with sleeping ``/bin/sleep`` processes; ``--holders`` of them hold a GPU's device open (fd only, as a CUDA worker holds
``/dev/nvidiaN``), spread over the GPUs. Then, paired (interleaved, the first of each round taking turns), each a whole
process: ``pvegpu audit`` as an admin types it (the table, every GPU, every holder with its guest, the configs), and
``fuser -v`` on the GPU devices (which only lists who has them open). Before the rounds, one untimed
``pvegpu audit --json`` and one ``fuser`` say whether both found the same holders.

- GPU node (``--node gpu``: root, an NVIDIA GPU): the sleepers sit in 100 PVE-like container cgroups (``/lxc/<vmid>/ns``)
  whose configs a PVE-like ``/etc/pve`` tree holds (half of them granted a GPU); one more PVE-like container runs
  bench/cuda_hold.py (1 GiB, a real CUDA context); ``pvegpu --config FILE audit`` against ``fuser -v /dev/nvidia*``.
- simulated node (``--node sim``, anywhere): ``pvegpu sim create`` with 8 GPUs and 100 containers (8 running, each with a
  1 GiB workload), its GPUs are private pty devices (character devices no other process holds, recognised by device
  number as /dev/nvidiaN is); ``pvegpu --simulate DIR audit`` against ``fuser -v`` on those 8 devices. The scan reads
  every process of the machine either way.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common as C  # noqa: E402
from bench import sbs_node as N  # noqa: E402
from tests import pvelike  # noqa: E402

BUDGETS = {2000: C.Budget("times_other", 1.5), 20000: C.Budget("times_other", 1.0)}
CTS, GPUS = 100, 8
SLEEP = "/bin/sleep"
NODE = "bench"
SIM_GAP = ("no NVIDIA GPU here: NVML is pvegpu's simulated driver (files of the node's directory), a container is a process "
           "session (the sleepers are host processes), the GPUs' device nodes are private pty devices (character devices "
           "recognised by device number, as /dev/nvidiaN on a node), so `fuser -v` is run on those")


def budget_for(size: int) -> C.Budget | None:
    return BUDGETS.get(size)


def process_count() -> int:
    return sum(1 for n in os.listdir("/proc") if n.isdigit())


def to_spawn(size: int, present: int, holders: int) -> int:
    """Sleepers to start so the node has ``size`` processes (at least the holders)."""
    return max(size - present, holders)


def gpu_of(ct: int, gpus: int) -> int | None:
    """The GPU container ``ct`` (an index) is granted: the even ones, spread over the GPUs in turn; the odd ones none."""
    return (ct // 2) % gpus if gpus and ct % 2 == 0 else None


def plan(count: int, holders: int, devices: list[str]) -> list[tuple[int, str | None]]:
    """(container index, device held open or None) of each sleeper: the first ``holders`` sit in the containers
    granted a GPU (``gpu_of``), in turn, each holding its container's GPU; the others in container i % CTS, holding
    nothing."""
    out: list[tuple[int, str | None]] = []
    for i in range(count):
        if i < holders and devices:
            ct = 2 * (i % (CTS // 2))
            out.append((ct, devices[gpu_of(ct, len(devices)) or 0]))
        else:
            out.append((i % CTS, None))
    return out


class Crowd:
    """The sleepers; in ``cgroups`` mode spread over ``CTS`` PVE-like container cgroups (vmids ``base``..)."""

    def __init__(self, sleepers: list[tuple[int, str | None]], base: int, cgroups: bool) -> None:
        self.pids: list[int] = []
        self.base, self.cgroups = base, cgroups
        self.vmids = [base + i for i in range(CTS)] if cgroups else []
        procs = []
        try:
            for v in self.vmids:
                os.makedirs(pvelike.cgroup_dir(v), exist_ok=True)
                procs.append(open(os.path.join(pvelike.cgroup_dir(v), "cgroup.procs"), "w"))
            null = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
            for ct, dev in sleepers:
                acts = null + ([(os.POSIX_SPAWN_OPEN, 3, dev, os.O_RDONLY | os.O_NOCTTY, 0)] if dev else [])
                pid = os.posix_spawn(SLEEP, [SLEEP, "3600"], {"PATH": C.PVE_PATH}, file_actions=acts)
                self.pids.append(pid)
                if procs:
                    procs[ct].write(f"{pid}\n")
                    procs[ct].flush()
        except BaseException:
            self.close()
            raise
        finally:
            for f in procs:
                f.close()

    def close(self) -> None:
        for p in self.pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.pids:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        self.pids = []
        for v in self.vmids:
            pvelike.destroy_ct(v)


class GpuNode:
    """The PVE-like tree for the crowd's containers and one with a real CUDA holder; ``pvegpu --config FILE audit``."""

    def __init__(self, pvegpu: list[str]) -> None:
        self.tmp = tempfile.mkdtemp(prefix="bench-audit-")
        self.base = 600000 + (os.getpid() % 1000) * 200
        self.cuda_vmid = self.base + CTS
        self.gpus = sorted(glob.glob("/dev/nvidia[0-9]*"), key=lambda p: int(p.removeprefix("/dev/nvidia")))
        confs = {self.base + i: self._conf(i, gpu_of(i, len(self.gpus))) for i in range(CTS)} | {self.cuda_vmid: self._conf(CTS, 0)}
        root = pvelike.etc_pve(os.path.join(self.tmp, "pve"), NODE, confs)
        self.config = os.path.join(self.tmp, "pvegpu.toml")
        with open(self.config, "w") as f:
            f.write(f'pve_root = "{root}"\nnode = "{NODE}"\n')
        os.chmod(self.config, 0o644)  # a settings file is refused when others may write it: never the umask's choice
        self.audit = [*pvegpu, "--config", self.config, "audit"]
        self.fuser = ["fuser", "-v", *sorted(glob.glob("/dev/nvidia*"))]
        self.devices = self.gpus
        try:
            self._start_holder()
        except BaseException:
            self.close()
            raise

    def _start_holder(self) -> None:
        ready = os.path.join(self.tmp, "ready")
        init = N.start_ct(self.cuda_vmid, f"exec {sys.executable} {C.REPO}/bench/cuda_hold.py --gib 1 --ready {ready}\n")
        end = time.monotonic() + 120
        while not os.path.exists(ready):
            if N.start_time(init) is None or time.monotonic() > end:
                raise RuntimeError("the CUDA holder (bench/cuda_hold.py --gib 1) did not get ready")
            time.sleep(0.05)

    def _conf(self, i: int, gpu: int | None) -> str:
        dev = f"dev0: {self.gpus[gpu]},gid=44\ndev1: /dev/nvidiactl,gid=44\n" if gpu is not None and self.gpus else ""
        return f"arch: amd64\nhostname: ct{i}\n{dev}"

    def close(self) -> None:
        N.kill_ct(self.cuda_vmid)
        shutil.rmtree(self.tmp, ignore_errors=True)


class SimNode:
    """A simulated node of 8 GPUs (private pty devices) and 100 containers; ``pvegpu --simulate DIR audit``."""

    def __init__(self, pvegpu: list[str]) -> None:
        self.ptys = C.PrivateDevices(GPUS)
        try:
            self.node = C.SimNode(pvegpu, sim_scenario(self.ptys.paths))
        except BaseException:
            self.ptys.close()
            raise
        self.base = 0
        self.devices = self.node.stand_ins()
        self.audit = self.node.cmd("audit")
        self.fuser = ["fuser", "-v", *self.devices]

    def close(self) -> None:
        self.node.remove()
        self.ptys.close()


def sim_scenario(stand_ins: list[str]) -> dict:
    """100 containers: the first 8 running with a 1 GiB workload each (on GPU i), the even ones of the rest granted a GPU."""
    cts = [{"vmid": 2000 + i, "name": f"ct{i}", "status": "running" if i < GPUS else "stopped",
            "gpus": [i] if i < GPUS else [g for g in [gpu_of(i, GPUS)] if g is not None],
            "workloads": [{"kind": "simple", "gpu": i % GPUS, "mib": 1024}] if i < GPUS else []} for i in range(CTS)]
    return {"node": NODE, "gpus": C.sim_gpus(GPUS, stand_ins), "containers": cts}


def agreement(audit_json: str, fuser_stdout: str) -> str:
    """How the holders the audit names compare with the PIDs fuser names."""
    ours, theirs = set(C.holder_pids(audit_json)), C.fuser_pids(fuser_stdout)
    both = ours & theirs
    text = f"audit: {len(ours)} holders, fuser: {len(theirs)} PIDs, in both: {len(both)}"
    if ours - theirs:
        text += f"; only the audit: {len(ours - theirs)}"
    if theirs - ours:
        text += f"; only fuser: {len(theirs - ours)} (e.g. holders of /dev/nvidiactl or /dev/nvidia-uvm alone, which hold no GPU)"
    return text


def profile(cmd: list[str], size: int, out: str) -> None:
    """One more audit run with ``-X importtime`` and one under cProfile (on the node of ``size`` processes), into ``out``:
    where a missed budget goes. ``cmd`` starts with pvegpu's launcher (its ``#!PYTHON -IS`` line names the interpreter)."""
    script, rest = cmd[0], cmd[1:]
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    entry = "from pvegpu.__main__ import main"  # pvegpu's main ends in os._exit: the profile runs pvegpu.cli.run instead
    if not text.startswith("#!") or entry not in text:
        print(f"audit profile: {script} is not pvegpu's launcher or console script; skipped", file=sys.stderr)
        return
    python, *flags = text.splitlines()[0][2:].split()
    stats = os.path.join(out, f"audit-{size}.prof")
    code = text.split(entry)[0] + f"import cProfile\nfrom pvegpu.cli import run\ncProfile.run('run(sys.argv[1:])', {stats!r})\n"
    runs = {"importtime": [python, *flags, "-X", "importtime", script, *rest],
            "cprofile": [python, *flags, "-c", code, *rest]}
    for name, argv in runs.items():
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        with open(os.path.join(out, f"audit-{size}-{name}.txt"), "w") as f:
            f.write(p.stderr if name == "importtime" else p.stderr[-2000:])
    if os.path.exists(stats):
        buf = io.StringIO()
        pstats.Stats(stats, stream=buf).sort_stats("cumulative").print_stats(60)
        buf.write("\n-- by own time\n")
        pstats.Stats(stats, stream=buf).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out, f"audit-{size}-cprofile.txt"), "a") as f:
            f.write(buf.getvalue())


def measure(node: GpuNode | SimNode, size: int, rounds: int, holders: int, cgroups: bool,
            profile_dir: str = "") -> tuple[C.Row, str]:
    sleepers = plan(to_spawn(size, process_count(), holders), holders, node.devices)
    crowd = Crowd(sleepers, node.base, cgroups)
    try:
        time.sleep(1.0)  # every sleeper exec'd
        count = process_count()
        _, a = C.timed([*node.audit, "--json"], timeout=600)
        _, f = C.timed(node.fuser, timeout=600)
        agree = agreement(a.stdout, f.stdout) if a.returncode in (0, 8) else f"audit --json: exit {a.returncode}: {a.stderr.strip()[-300:]}"
        exits: Counter[int] = Counter()

        def audit() -> float:
            dt, p = C.timed(node.audit, timeout=600)
            exits[p.returncode] += 1
            return dt

        def fuser() -> float:
            return C.timed(node.fuser, timeout=600)[0]

        load = os.getloadavg()[0]
        times = C.paired({"audit": audit, "fuser": fuser}, rounds)
        load_text = f"1-minute load {load:.1f} before the rounds, {os.getloadavg()[0]:.1f} after"
        if profile_dir:
            profile(node.audit, size, profile_dir)
    finally:
        crowd.close()
    failures = [f"{n} × exit {code}" for code, n in exits.items() if code not in (0, 8)]
    against = "`fuser -v /dev/nvidia*`" if isinstance(node, GpuNode) else "`fuser -v` on the 8 stand-in devices"
    row = C.Row(f"`pvegpu audit`, node of {size:,} processes", times["audit"], against=against, other=times["fuser"],
                budget=budget_for(size), failures=failures)
    note = (f"- {size:,}: {count:,} processes on the machine during the rounds ({len(sleepers):,} sleepers started, "
            f"{sum(1 for _, d in sleepers if d)} holding a GPU device), {load_text}; audit exits {dict(exits)}; {agree}")
    return row, note


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2000,20000", help="processes on the node, comma-separated (default 2000,20000)")
    ap.add_argument("--rounds", type=int, default=9, help="paired rounds per size (default 9)")
    ap.add_argument("--holders", type=int, default=100, help="sleepers holding a GPU device open (default 100)")
    ap.add_argument("--node", choices=("auto", "gpu", "sim"), default="auto", help="auto: the GPU node when a GPU answers here")
    ap.add_argument("--pvegpu", default="", help="the pvegpu command (default: the entry point beside this python, else PATH's)")
    ap.add_argument("--out", default="", help="directory for <date>-audit.md (e.g. bench/results)")
    ap.add_argument("--profile", default="", help="directory: after each size's rounds, one audit run with -X importtime and one under cProfile")
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x]
    except ValueError:
        ap.error(f"--sizes: whole numbers, comma-separated, not {a.sizes!r}")
    gpu = C.choose_node(a.node) == "gpu"
    if gpu and os.geteuid() != 0:
        print("Error: the GPU node's containers need root (cgroups)\nHint: sudo, or --node sim", file=sys.stderr)
        return 2
    C.on_sigterm_exit()
    pvegpu = C.pvegpu_command(a.pvegpu)
    rep = C.Report("Budget: `pvegpu audit` against `fuser -v /dev/nvidia*`", C.command_line(argv),
                   "GPU node: real NVML, PVE-like containers" if gpu else "simulated node (`pvegpu sim create`)", "" if gpu else SIM_GAP,
                   pvegpu)
    node: GpuNode | SimNode = GpuNode(pvegpu) if gpu else SimNode(pvegpu)
    rows, notes = [], []
    try:
        for size in sizes:
            row, note = measure(node, size, a.rounds, a.holders, cgroups=gpu, profile_dir=a.profile)
            rows.append(row)
            notes.append(note)
            print(f"audit {size}: {C.fmt_runs(row.pvegpu)}; fuser: {C.fmt_runs(row.other)}", file=sys.stderr, flush=True)
    finally:
        node.close()
    rep.add(C.table(rows))
    rep.add("")
    rep.add("Each run is a whole process; rounds are paired (the audit and fuser alternate, the first of each round taking "
            "turns). The ratio is the audit's median over fuser's.")
    rep.add("")
    rep.add("\n".join(notes))
    C.finish(rep, a.out, "audit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
