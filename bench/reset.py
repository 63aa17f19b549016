"""Budget: ``pvegpu reset VMID`` takes ≤ the release floor + 0.25 s, and is ≥ 4× faster than the manual routine.

    python3 bench/reset.py [--reps 5] [--scenarios hold-20,ignore-term,two-cts] [--node auto|gpu|sim] [--pvegpu CMD]
                           [--scale 1.0] [--grace 3] [--methods manual,pvegpu,floor] [--out DIR]

Each scenario is built afresh for every run of every method; the methods of one repetition run one after the other,
the first taking turns (paired: the shared machine's load falls on all alike). Methods, each timed from its start to
its verdict:

- ``pvegpu``: ``pvegpu reset 301 --json``, a whole process (its JSON says clean or not, and where its time went);
- ``manual``: the routine an admin runs: ``pct exec 301 -- sh -c 'pkill -9 python; fuser -k /dev/nvidia*; sleep 3;
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits'``, clean when memory.used is back at idle;
- ``floor``: the physical floor: SIGKILL to every holder the scenario started (known, not searched for), NVML polled
  every 5 ms until it first shows the memory back. pvegpu must also hold clean for its settle window
  (``reset.settle``, 0.25 s by default): inside the floor + 0.25 s budget, that leaves nothing for the rest.
- ``restart`` (GPU node only, not in the budget): ``pct stop 301; pct start 301`` then the same nvidia-smi.

One second after each verdict the truth is read (NVML, and whether the target's holders are gone) and the processes
outside the target are checked: a method that called a dirty GPU clean, or hurt a neighbour, is marked.

- GPU node (``--node gpu``: root, an NVIDIA GPU, nvidia-ml-py, nsenter): PVE-like containers (bench/sbs_node.py) whose
  workloads are bench/cuda_hold.py (real CUDA contexts), pvegpu's API calls answered by bench/pvesh_shim.py
  (bench/sbs_gpu.py).
- simulated node (``--node sim``, anywhere): ``pvegpu sim create`` per run, ``pvegpu --simulate DIR reset 301 --json``;
  the floor polls the simulated NVML; the manual routine is ``kill -9`` of the CT's payload (what pkill finds inside
  the container; no ``pct exec``, no ``fuser -k``: a session has no PID namespace to keep it inside the container),
  ``sleep 3``, then bench/sim_smi.py standing in for nvidia-smi.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common as C  # noqa: E402
from bench import sbs_model as M  # noqa: E402
from bench import sbs_node as N  # noqa: E402
from bench.sbs_gpu import Bench  # noqa: E402
from bench.sim_smi import used_mib  # noqa: E402

DEFAULT_SCENARIOS = "hold-20,ignore-term,two-cts"
METHODS = ("manual", "pvegpu", "floor")
FLOOR_BUDGET = C.Budget("over_floor_s", 0.25)
MANUAL_BUDGET = C.Budget("times_faster", 4.0)
SIM_SMI = os.path.join(C.REPO, "bench", "sim_smi.py")
SIM_GAP = ("no NVIDIA GPU here: NVML is pvegpu's simulated driver (memory back 0.15 s after the last holder is seen dead, "
           "the latency measured on an H200), containers are process sessions, /dev/nvidia0 a private pty device, the Proxmox "
           "API is simulated; the manual routine has no `pct exec` and its nvidia-smi is bench/sim_smi.py (a Python process "
           "reading the simulated NVML)")
SIM_KIND = {"hold": "simple", "spawn": "simple", "fork": "orphan", "ignore-term": "ignore-term"}  # sbs_model kind → sim workload


def sim_scenario(s: M.Scenario, stand_ins: list[str]) -> dict | None:
    """The simulated node of a side-by-side scenario: CT 301 with its workloads on GPU 0 (CT 302 beside it with the
    neighbour's memory); None where the simulated node has no such thing (an fd-only holder, a host process, a
    nested cgroup, a respawning service the floor cannot stop, idle crowds)."""
    if s.kind not in SIM_KIND or s.host_gib or s.idle:
        return None
    n = s.workers if s.kind == "spawn" else 1
    target = [{"kind": SIM_KIND[s.kind], "gpu": 0, "mib": round(s.gib * 1024 / n)} for _ in range(n)]
    cts = [{"vmid": M.TARGET, "name": f"ct{M.TARGET}", "status": "running", "gpus": [0], "workloads": target}]
    if s.neighbour_gib:
        cts.append({"vmid": M.NEIGHBOUR, "name": f"ct{M.NEIGHBOUR}", "status": "running", "gpus": [0],
                    "workloads": [{"kind": "simple", "gpu": 0, "mib": round(s.neighbour_gib * 1024)}]})
    return {"node": "bench", "gpus": C.sim_gpus(1, stand_ins), "containers": cts}


class DriverTick:
    """While it runs, the simulated NVML is read every ``every`` seconds, as a driver notices a holder's death by
    itself: the simulated driver counts its release latency from the first reading that sees the holder dead, so
    without a reader the manual routine's one nvidia-smi, 3 s after its kill, would be that first reading."""

    def __init__(self, root: str, every: float = 0.02) -> None:
        self.root, self.every = root, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.stop.wait(self.every):
            try:
                used_mib(self.root)
            except Exception:  # noqa: BLE001 - a reading that fails now is retried at the next tick
                pass

    def __enter__(self) -> DriverTick:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def alive(pid: int) -> bool:
    """That pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class SimBench:
    """The reset side by side on simulated nodes: one fresh node per run."""

    def __init__(self, pvegpu: list[str]) -> None:
        self.pvegpu = pvegpu
        self.used_mib = used_mib  # the simulated NVML, read in this process (the floor polls it)
        self.pty = C.PrivateDevices(1)  # GPU 0 of every node: recognised by device number, as /dev/nvidia0 is

    def run(self, s: M.Scenario, method: str, rep: int = 0) -> M.Run:
        r = M.Run(s.key, method, rep)
        scenario = sim_scenario(s, self.pty.paths)
        if scenario is None or method not in METHODS:
            r.verdict, r.detail = "skipped", "not on a simulated node"
            return M.finish(r)
        try:
            with C.SimNode(self.pvegpu, scenario) as node:
                self._run(node, s, method, r)
        except Exception as exc:  # one broken run must not stop the others; it is recorded as such
            r.verdict, r.detail = "error", f"{type(exc).__name__}: {exc}"
        return M.finish(r)

    def _run(self, node: C.SimNode, s: M.Scenario, method: str, r: M.Run) -> None:
        _, p = C.timed(node.cmd("audit", "--json"), timeout=120)  # untimed: who holds what before the method
        if p.returncode not in (0, 8):
            raise RuntimeError(f"audit before the run: exit {p.returncode}: {p.stderr.strip()[-300:]}")
        target = sorted(C.holder_pids(p.stdout, M.TARGET))
        outside = sorted(C.holder_pids(p.stdout, M.NEIGHBOUR))
        r.keep_mib = s.neighbour_gib * 1024
        used = self.used_mib(node.dir).get(0)
        r.allocated_mib = (used or 0.0) - r.keep_mib
        before = {pid: (st, N.comm(pid), f"CT {M.NEIGHBOUR}") for pid in outside if (st := N.start_time(pid)) is not None}
        fn = {"pvegpu": self.pvegpu_reset, "manual": self.manual, "floor": self.floor}[method]
        if method == "manual":  # nothing else reads the simulated NVML while its routine sleeps
            with DriverTick(node.dir):
                r.wall_s, r.verdict, r.detail, r.extra = fn(node, target, r.keep_mib)
        else:
            r.wall_s, r.verdict, r.detail, r.extra = fn(node, target, r.keep_mib)
        time.sleep(1.0)
        r.truth = M.Truth(self.used_mib(node.dir).get(0), [], [pid for pid in target if alive(pid)])
        r.collateral = M.collateral(before, {pid: N.start_time(pid) for pid in before})

    def pvegpu_reset(self, node: C.SimNode, target: list[int], keep_mib: float) -> tuple[float, str, str, dict]:
        t0 = time.monotonic()
        wall, p = C.timed(node.cmd("reset", str(M.TARGET), "--json"), timeout=300)
        verdict, detail, extra = M.verdict_from_pvegpu(p.returncode, p.stdout)
        extra |= M.pvegpu_phases(p.stdout, t0, wall)
        if verdict == "error":
            extra["stderr_tail"] = p.stderr[-800:]
        return wall, verdict, detail, extra

    def manual(self, node: C.SimNode, target: list[int], keep_mib: float) -> tuple[float, str, str, dict]:
        routine = (f"kill -9 {' '.join(map(str, target))} 2>/dev/null; sleep 3; "
                   f"{shlex.join([sys.executable, SIM_SMI, node.dir])}")
        wall, p = C.timed(["sh", "-c", routine], timeout=120)
        verdict, detail = M.verdict_from_smi(p.stdout, 0, idle_mib=0.0)  # the GPU's idle, as the admin knows it
        return wall, verdict, detail, {"routine": routine}

    def floor(self, node: C.SimNode, target: list[int], keep_mib: float) -> tuple[float, str, str, dict]:
        t = time.perf_counter()
        for pid in target:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            used = self.used_mib(node.dir).get(0)
            release = time.perf_counter() - t
            if used is not None and used <= keep_mib + M.THRESHOLD_MIB:
                return release, "clean", f"memory back {release:.3f} s after SIGKILL", {"release_s": round(release, 4)}
            if release > 30:
                return release, "not clean", f"memory not back 30 s after SIGKILL ({used} MiB)", {}
            time.sleep(0.005)

    def close(self) -> None:
        self.pty.close()


def walls(runs: list[M.Run], verdicts: tuple[str, ...] = ("clean", "not clean")) -> list[float]:
    return [r.wall_s for r in runs if r.wall_s is not None and r.verdict in verdicts]


def budget_rows(runs: list[M.Run], titles: dict[str, str]) -> list[C.Row]:
    """Two rows per scenario: pvegpu against the floor (+ 0.25 s), and against the manual routine (≥ 4× faster). A
    pvegpu run that was not clean, or whose verdict the truth contradicts, fails both."""
    rows = []
    for key in dict.fromkeys(r.scenario for r in runs):
        by = {m: [r for r in runs if r.scenario == key and r.method == m] for m in ("pvegpu", "manual", "floor")}
        failures = [f"run {r.rep + 1}: {r.verdict} ({r.judgement}): {r.detail}"
                    for r in by["pvegpu"] if r.verdict != "clean" or r.judgement != "right"]
        title = titles.get(key, key)
        rows.append(C.Row(f"reset, {title}", walls(by["pvegpu"]), floor=walls(by["floor"], ("clean",)),
                          budget=FLOOR_BUDGET, failures=failures))
        rows.append(C.Row(f"reset, {title}", walls(by["pvegpu"]), against="manual routine", other=walls(by["manual"]),
                          budget=MANUAL_BUDGET, failures=failures))
    return rows


def phases_table(runs: list[M.Run]) -> str:
    """Where pvegpu's wall time went (medians over its runs of each scenario): start-up and exit, the reset itself,
    the memory's return as the reset saw it, and its settle window."""
    lines = ["| scenario | pvegpu wall | start-up + exit | reset (its own elapsed) | memory back after | settle window |",
             "|---|---|---|---|---|---|"]
    for key in dict.fromkeys(r.scenario for r in runs):
        mine = [r for r in runs if r.scenario == key and r.method == "pvegpu" and r.wall_s is not None]

        def med(name: str, rs: list[M.Run] = mine) -> str:
            return C.fmt_s(C.median([float(r.extra[name]) for r in rs if isinstance(r.extra.get(name), (int, float))]))

        lines.append(f"| {key} | {C.fmt_s(C.median(walls(mine)))} | {med('startup_s')} | {med('reset_s')} | {med('memory_back_s')} "
                     f"| {med('settle_s')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each scenario and method (default 5)")
    ap.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help="comma-separated keys: " + ",".join(s.key for s in M.SCENARIOS))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ",".join(M.METHODS) + " (restart: GPU node only)")
    ap.add_argument("--node", choices=("auto", "gpu", "sim"), default="auto", help="auto: the GPU node when a GPU answers here")
    ap.add_argument("--pvegpu", default="", help="the pvegpu command (default: the entry point beside this python, else PATH's)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every allocation (a GPU smaller than 120 GiB)")
    ap.add_argument("--grace", type=float, default=3.0, help="reset.grace on the GPU node (SIGTERM → SIGKILL)")
    ap.add_argument("--raw", default="", help="also write every run, raw, as JSON to this file")
    ap.add_argument("--out", default="", help="directory for <date>-reset.md (e.g. bench/results)")
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    if bad := [m for m in methods if m not in M.METHODS]:
        ap.error(f"unknown method(s) {bad}; known: {', '.join(M.METHODS)}")
    try:
        chosen = M.scenarios([k for k in a.scenarios.split(",") if k] or None, a.scale)
    except ValueError as exc:
        ap.error(str(exc))
    node = C.choose_node(a.node)
    gpu = node == "gpu"
    if gpu and os.geteuid() != 0:
        print("Error: the GPU node's scenarios need root (cgroups, namespaces, signals)\nHint: sudo, or --node sim", file=sys.stderr)
        return 2
    C.on_sigterm_exit()
    pvegpu = C.pvegpu_command(a.pvegpu)
    bench: Bench | SimBench = Bench(a.grace, pvegpu) if gpu else SimBench(pvegpu)
    rep = C.Report("Budget: `pvegpu reset` against the release floor and the manual routine", C.command_line(argv),
                   "GPU node: real NVML and CUDA holders, PVE-like containers" if gpu else "simulated node (`pvegpu sim create`, one per run)",
                   "" if gpu else SIM_GAP, pvegpu)
    runs: list[M.Run] = []
    try:
        for rep_no in range(a.reps):
            for s in chosen:
                for m in C.rotated(methods, rep_no):
                    r = bench.run(s, m, rep_no)
                    runs.append(r)
                    print(f"{s.key:12s} {m:8s} {r.wall_s or 0:7.3f} s  {r.verdict:10s} {r.judgement:12s} {r.detail}",
                          file=sys.stderr, flush=True)
    finally:
        bench.close()
    if a.raw:
        with open(a.raw, "w") as f:
            f.write(M.to_json({"command": rep.command, "node": node}, runs))
    titles = {s.key: s.title for s in M.SCENARIOS}
    rep.add(C.table(budget_rows(runs, titles)))
    rep.add("")
    rep.add("Where pvegpu's time went (from its `--json` report: `elapsed_s`, the verify step):")
    rep.add("")
    rep.add(phases_table(runs))
    rep.add("")
    rep.add("Every run (wall time to verdict, the verdict, whether the truth one second later agreed, processes outside "
            "the target hurt):")
    rep.add("")
    rep.add(M.summary_table(runs, titles))
    rep.add("")
    rep.add(M.detail_table(runs))
    C.finish(rep, a.out, "reset")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
