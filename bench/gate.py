"""Budget: the start gate as PVE runs it takes ≤ 150 ms (median), printed beside ``nvidia-smi --query-gpu=index,
memory.used --format=csv`` timed in the same run.

    python3 bench/gate.py [--rounds 40] [--cases idle,shared] [--node auto|gpu|sim] [--pvegpu CMD] [--out DIR]

The gate is the guard ``pvegpu hook install`` writes (contrib/hookscripts/pvegpu-guard with its paths filled in),
run as PVE runs a hookscript: ``pvegpu-guard 301 pre-start``, ``PATH=/sbin:/bin:/usr/sbin:/usr/bin``, ``LC_ALL=C``,
stdin /dev/null, a whole process timed from spawn to exit; every run must allow the start (exit 0). Rounds are paired:
the gate and nvidia-smi alternate, the first of each round taking turns. Cases: ``idle`` (nothing holds CT 301's GPU)
and ``shared`` (CT 302, running, holds memory on the same GPU: the gate attributes it before it allows).

- GPU node (``--node gpu``, as root with an NVIDIA GPU): a PVE-like ``/etc/pve`` tree in a temporary directory holds
  CTs 301 and 302 granted GPU 0; ``pvegpu --config FILE hook install 301`` writes the guard into the tree's ``local``
  storage (``pct``/``pvesm`` are stand-ins that log and succeed). The guard reads those settings through
  ``PVEGPU_CONFIG`` (a node reads /etc/pvegpu/pvegpu.toml). ``shared``: CT 302 is a PVE-like container (cgroup
  ``/lxc/302/ns``, its own PID namespace, bench/sbs_node.py) running bench/cuda_hold.py (1 GiB, a real context).
- simulated node (``--node sim``, anywhere): ``pvegpu sim create``, ``pvegpu --simulate DIR hook install 301``, the
  guard run with ``PVEGPU_SIMULATE=DIR`` as the simulated start runs it; nvidia-smi: n/a (no GPU), paired instead with
  its stand-in bench/sim_smi.py (a Python process reading the simulated NVML), so the load shows on both alike.

The physical floor is what any gate built on pvegpu's stack pays before it reads anything: the guard's interpreter
(``-I -S``, its import path) importing ``dataclasses`` and nvidia-ml-py and, on a GPU node, ``nvmlInit()``.
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common as C  # noqa: E402
from bench import sbs_node as N  # noqa: E402
from tests.pvelike import etc_pve  # noqa: E402

TARGET, NEIGHBOUR = 301, 302
NODE = "bench"
GATE_BUDGET = C.Budget("at_most_s", 0.150)
CASES = {"idle": "CT 301's GPU idle (a clean start)", "shared": "GPU shared with running CT 302 (1 GiB to attribute)"}
SIM_GAP = ("no NVIDIA GPU here: NVML is pvegpu's simulated driver (files of the node's directory), a container is a process "
           "session, /dev/nvidia0 a private pty device (recognised by device number, as /dev/nvidia0 is); nvidia-smi: n/a (no GPU)")
SIM_SMI = os.path.join(C.REPO, "bench", "sim_smi.py")
SIM_AGAINST = f"nvidia-smi {C.NO_GPU}; its stand-in `bench/sim_smi.py DIR` (a Python process reading the simulated NVML)"
STUB = "#!/bin/sh\n# stand-in for PVE's {name}: log the call, succeed\necho \"{name} $*\" >> {log}\nexit 0\n"


def find_guard(root: str) -> str:
    """The guard ``hook install`` wrote under ``root`` (its snippets directory)."""
    for dirpath, _dirs, files in os.walk(root):
        if "pvegpu-guard" in files and os.path.basename(dirpath) == "snippets":
            return os.path.join(dirpath, "pvegpu-guard")
    raise RuntimeError(f"no snippets/pvegpu-guard under {root}: `pvegpu hook install` wrote none")


def install_checked(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``pvegpu ... hook install``; its output, or RuntimeError saying why it failed."""
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exit {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}")
    return p.stdout


def ct_conf(minor: int) -> str:
    return f"arch: amd64\ndev0: /dev/nvidia{minor},gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: gate\n"


class GpuCase:
    """One case on the GPU node: the PVE-like tree, the settings, the guard ``hook install`` wrote, CT 302's holder."""

    def __init__(self, pvegpu: list[str], case: str) -> None:
        self.tmp = tempfile.mkdtemp(prefix="bench-gate-")
        self.shared = case == "shared"
        try:
            self._build(pvegpu)
        except BaseException:
            self.close()
            raise

    def _build(self, pvegpu: list[str]) -> None:
        minor = gpu_minor(0)
        root = etc_pve(os.path.join(self.tmp, "pve"), NODE, {TARGET: ct_conf(minor), NEIGHBOUR: ct_conf(minor)})
        with open(os.path.join(root, "storage.cfg"), "w") as f:
            f.write(f"dir: local\n\tpath {self.tmp}\n\tcontent iso,vztmpl,backup,snippets\n")
        self.config = os.path.join(self.tmp, "pvegpu.toml")
        with open(self.config, "w") as f:
            f.write(f'pve_root = "{root}"\nnode = "{NODE}"\n')
        os.chmod(self.config, 0o644)  # a settings file is refused when others may write it: never the umask's choice
        bindir = os.path.join(self.tmp, "bin")
        os.makedirs(bindir)
        for name in ("pct", "pvesm"):
            path = os.path.join(bindir, name)
            with open(path, "w") as f:
                f.write(STUB.format(name=name, log=os.path.join(self.tmp, "pve-calls.log")))
            os.chmod(path, 0o755)
        self.installed = install_checked([*pvegpu, "--config", self.config, "hook", "install", str(TARGET)],
                                         dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", "")))
        self.guard = find_guard(self.tmp)
        self.env = {"PATH": C.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": self.config}
        if "LD_LIBRARY_PATH" in os.environ:  # where a node's driver library lives, if not in the loader's default path
            self.env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        if self.shared:
            self._start_holder()

    def _start_holder(self) -> None:
        ready = os.path.join(self.tmp, "ready")
        holder = os.path.join(C.REPO, "bench", "cuda_hold.py")
        init = N.start_ct(NEIGHBOUR, f"exec {sys.executable} {holder} --gib 1 --ready {ready}\n")
        end = time.monotonic() + 120
        while not os.path.exists(ready):
            if N.start_time(init) is None or time.monotonic() > end:
                raise RuntimeError(f"CT {NEIGHBOUR}'s CUDA holder did not get ready (bench/cuda_hold.py --gib 1)")
            time.sleep(0.05)

    def close(self) -> None:
        if self.shared:
            N.kill_ct(NEIGHBOUR)
        shutil.rmtree(self.tmp, ignore_errors=True)


class SimCase:
    """One case on a simulated node: CT 301 stopped on GPU 0 (``shared``: CT 302 running, holding 1 GiB there)."""

    def __init__(self, pvegpu: list[str], case: str) -> None:
        self.pty = C.PrivateDevices(1)
        try:
            self.node = C.SimNode(pvegpu, sim_scenario(case, self.pty.paths))
            try:
                self.installed = install_checked(self.node.cmd("hook", "install", str(TARGET)))
                self.guard = find_guard(self.node.dir)
            except BaseException:
                self.node.remove()
                raise
        except BaseException:
            self.pty.close()
            raise
        self.env = {"PATH": C.PVE_PATH, "LC_ALL": "C", "PVEGPU_SIMULATE": self.node.dir}

    def close(self) -> None:
        self.node.remove()
        self.pty.close()


def sim_scenario(case: str, stand_ins: list[str]) -> dict:
    """CT 301 stopped on GPU 0 (a private pty device); ``shared``: CT 302 running, its workload holding 1 GiB there."""
    cts = [{"vmid": TARGET, "name": "gate301", "status": "stopped", "gpus": [0], "workloads": []}]
    if case == "shared":
        cts.append({"vmid": NEIGHBOUR, "name": "shared302", "status": "running", "gpus": [0],
                    "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024}]})
    return {"node": NODE, "gpus": C.sim_gpus(1, stand_ins), "containers": cts}


def gpu_minor(index: int) -> int:
    """N of /dev/nvidiaN for GPU ``index`` (nvidia-ml-py, the official binding); 0 when it cannot be asked."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(index)))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any failure: the usual numbering
        return index


def measure(case: object, rounds: int, gpu: bool) -> tuple[dict[str, list[float]], Counter[str]]:
    """``rounds`` paired rounds of the gate (and nvidia-smi on a GPU node); the gate's exits, counted by outcome."""
    exits: Counter[str] = Counter()
    guard, env = case.guard, case.env  # type: ignore[attr-defined]

    def gate() -> float:
        dt, p = C.timed([guard, str(TARGET), "pre-start"], env=env, timeout=120)
        exits["allowed (exit 0)" if p.returncode == 0 else f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[:160]}"] += 1
        return dt

    smi_argv = C.SMI_GATE if gpu else [sys.executable, SIM_SMI, case.node.dir]  # type: ignore[attr-defined]

    def smi() -> float | None:
        dt, p = C.timed(smi_argv, timeout=60)
        return dt if p.returncode == 0 else None

    floor_argv = floor_command(guard, gpu)

    def floor() -> float | None:
        dt, p = C.timed(floor_argv, env=env, timeout=60)
        return dt if p.returncode == 0 else None

    methods = {"gate": gate, "nvidia-smi": smi, "floor": floor}
    for fn in methods.values():  # once untimed: the files and libraries in the page cache, as on a node in use
        fn()
    exits.clear()
    return C.paired(methods, rounds), exits


def floor_command(guard: str, gpu: bool) -> list[str]:
    """The floor of any gate written with pvegpu's stack: the guard's interpreter (``-I -S``, its import path) importing
    the standard library's dataclasses and nvidia-ml-py, and opening NVML where there is a GPU; no pvegpu code."""
    text = open(guard).read()
    python = next((ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("PVEGPU_PYTHON=")), "") or sys.executable
    path = next((ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("PVEGPU_PYTHONPATH=")), "")
    body = "import dataclasses, pynvml" + ("; pynvml.nvmlInit()" if gpu else "")
    return [python, "-I", "-S", "-c", f"import sys; sys.path[:0] = {path.split(':') if path else []!r}; {body}"]


def profile(case: object, out: str) -> None:
    """One more gate run with ``-X importtime`` and one under cProfile, into ``out``: where a missed budget goes."""
    guard, env = case.guard, case.env  # type: ignore[attr-defined]
    text = open(guard).read()
    stats = os.path.join(out, "gate.prof")
    variants = {"importtime": text.replace(" -I -S -c ", " -I -S -X importtime -c "),
                "cprofile": text.replace("from pvegpu.__main__ import main; main()",
                                         f"from pvegpu.cli import run; import cProfile; cProfile.run(\"run(sys.argv[1:])\", \"{stats}\")")}
    for name, body in variants.items():
        if body == text:
            print(f"gate profile: the guard has no direct-interpreter line; {name} skipped", file=sys.stderr)
            continue
        path = os.path.join(out, f"guard-{name}")
        with open(path, "w") as f:
            f.write(body)
        os.chmod(path, 0o755)
        p = subprocess.run([path, str(TARGET), "pre-start"], env=env, capture_output=True, text=True, timeout=120)
        with open(os.path.join(out, f"gate-{name}.txt"), "w") as f:
            f.write(p.stderr)
    if os.path.exists(stats):
        buf = io.StringIO()
        pstats.Stats(stats, stream=buf).sort_stats("cumulative").print_stats(45)
        with open(os.path.join(out, "gate-cprofile.txt"), "a") as f:
            f.write(buf.getvalue())


def row(case: str, times: dict[str, list[float]], exits: Counter[str], gpu: bool) -> C.Row:
    """The case's line: the gate beside nvidia-smi (on a simulated node: n/a, and its stand-in bench/sim_smi.py)."""
    failures = [f"{n} × {what}" for what, n in exits.items() if not what.startswith("allowed")]
    against = "`" + " ".join(C.SMI_GATE) + "`" if gpu else SIM_AGAINST
    return C.Row(f"gate, {CASES[case]}", times["gate"], against=against, other=times.get("nvidia-smi") or None,
                 other_note=C.NO_GPU, floor=times.get("floor") or None, budget=GATE_BUDGET, failures=failures)


def p90(xs: list[float]) -> float | None:
    return sorted(xs)[max(0, int(0.9 * len(xs)) - 1)] if xs else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="paired rounds per case (default 40)")
    ap.add_argument("--cases", default="idle,shared", help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--node", choices=("auto", "gpu", "sim"), default="auto", help="auto: the GPU node when a GPU answers here")
    ap.add_argument("--pvegpu", default="", help="the pvegpu command (default: the entry point beside this python, else PATH's)")
    ap.add_argument("--out", default="", help="directory for <date>-gate.md (e.g. bench/results)")
    ap.add_argument("--profile", default="", help="directory: after the rounds, one gate run with -X importtime and one under cProfile")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    if bad := [c for c in cases if c not in CASES]:
        ap.error(f"unknown case(s) {bad}; known: {', '.join(CASES)}")
    node = C.choose_node(a.node)
    gpu = node == "gpu"
    if gpu and os.geteuid() != 0:
        print("Error: the GPU node's cases need root (PVE-like containers, the guard runs as root)\nHint: sudo, or --node sim",
              file=sys.stderr)
        return 2
    C.on_sigterm_exit()
    pvegpu = C.pvegpu_command(a.pvegpu)
    rep = C.Report("Budget: the start gate as PVE runs it", C.command_line(argv),
                   "GPU node: real NVML, PVE-like containers" if gpu else "simulated node (`pvegpu sim create`)", "" if gpu else SIM_GAP,
                   pvegpu)
    rows, notes = [], []
    for case in cases:
        c = (GpuCase if gpu else SimCase)(pvegpu, case)
        try:
            times, exits = measure(c, a.rounds, gpu)
            if a.profile and case == cases[0]:
                profile(c, a.profile)
        finally:
            c.close()
        rows.append(row(case, times, exits, gpu))
        notes.append(f"- {case}: the gate's p90 {C.fmt_s(p90(times['gate']))}, "
                     f"{'nvidia-smi' if gpu else 'its stand-in'}'s p90 {C.fmt_s(p90(times.get('nvidia-smi', [])))}; exits: {dict(exits)}")
        print(f"gate {case}: {C.fmt_runs(times['gate'])}", file=sys.stderr, flush=True)
    rep.add(C.table(rows))
    rep.add("")
    rep.add("The guard is the one `pvegpu hook install` writes, run as PVE runs it (argv `GUARD 301 pre-start`, PATH "
            "/sbin:/bin:/usr/sbin:/usr/bin, LC_ALL=C, stdin /dev/null); each run is a whole process; rounds are paired with "
            "the comparison, the first of each round taking turns.")
    rep.add("")
    rep.add("\n".join(notes))
    C.finish(rep, a.out, "gate")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
