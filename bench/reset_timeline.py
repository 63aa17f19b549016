"""When each step of ``pvegpu reset`` happens, from the process's start to its exit (root; a GPU node, or any machine
with ``--stand-in LIB``).

    python3 bench/reset_timeline.py [N] [--tree DIR] [--stand-in DIR] [--importtime]

Copies the checkout (or ``--tree DIR``) with a mark at each step (``gate_timeline.instrument``), then N times: starts a
PVE-like container (``sbs_node.start_ct``) whose payload holds the GPU, and runs ``reset VMID --json`` as the
benchmark runs it (``--config``, the local API backend through the pvesh stand-in). Prints each step's median time
since the spawn. On a GPU node the holder is ``bench/cuda_hold.py`` (1 GiB); with ``--stand-in DIR`` (a directory
holding a stand-in ``libnvidia-ml.so.1`` that lists ``$FNVML_PID`` while it lives) the holder is a plain process,
to see pvegpu's own steps on a machine without a GPU. ``--importtime``: one more run under ``-X importtime``, its
slowest imports by cumulative time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import sbs_node as N  # noqa: E402
from bench.gate_timeline import instrument, read_marks, summary  # noqa: E402
from bench.pvesh_shim import launcher as pvesh_launcher  # noqa: E402
from tests.pvelike import etc_pve  # noqa: E402

VMID = 129
MARKS = [
    ("pvegpu/__main__.py", "from .frontdoor import main as front", "main", False),
    ("pvegpu/__main__.py", "os._exit(code)  # all output", "exit", False),
    ("pvegpu/frontdoor.py", "    argv = sys.argv[1:] if argv is None else argv", "frontdoor", False),
    ("pvegpu/resetcmd.py", "    values = parse(args)", "resetcmd", False),
    ("pvegpu/resetcmd.py", "    s = wiring.settings(opts, overrides(values))", "settings", True),
    ("pvegpu/resetcmd.py", "    world = wiring.world(s", "world", True),
    ("pvegpu/resetcmd.py", "    guest = world.pve.where(vmid)", "located", True),
    ("pvegpu/resetcmd.py", "        world.warm_up()", "warm", True),
    ("pvegpu/resetcmd.py", "    log = configure(verbose=verbose", "imported", False),
    ("pvegpu/resetcmd.py", "        ports.lock, ports.interrupts = lock, signals", "locked", False),
    ("pvegpu/resetcmd.py", "        signals.done = True  # the report is final", "reset done", False),
    ("pvegpu/adapters/nvml.py", "            self.N.nvmlInit()", "W thread", False),  # NVML's start, in its thread
    ("pvegpu/adapters/nvml.py", "            self.N.nvmlInit()", "W nvml", True),
    ("pvegpu/reset/find.py", "    run.located = loc = locate(run.vmid", "R find", False),
    ("pvegpu/reset/find.py", "    run.located = loc = locate(run.vmid", "R located", True),
    ("pvegpu/reset/find.py", "    facts = r.before = run.inspect()", "R first reading", True),
    ("pvegpu/reset/stop.py", "            killed |= signal_round(run, rounds, todo)", "R round", False),
    ("pvegpu/reset/stop.py", "        decided = run.targets(facts)  # the one rule", "R targets", True),
    ("pvegpu/reset/machine.py", "    stopped = stop_and_verify(run, facts)", "R earlier noted", False),
    ("pvegpu/reset/run.py", "        facts = inspect_gpus(self.vmid, self.located.gpus", "R inspect", False),
    ("pvegpu/holders.py", "    samples = probe.sample(minors)", "R sampled", True),
    ("pvegpu/adapters/procfs.py", "            info = self._describe_now(ident.pid)", "S describe", False),
    ("pvegpu/adapters/procfs.py", "            info = self._describe_now(ident.pid)", "S described", True),
    ("pvegpu/adapters/procfs.py", "pidfd_send_signal(pidfd, sig)", "signal", True),
]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="When each step of `pvegpu reset` happens (marks in a copy of the tree).")
    ap.add_argument("n", nargs="?", type=int, default=15, help="runs (default 15)")
    ap.add_argument("--tree", default=REPO, help="the checkout to time (default: this one)")
    ap.add_argument("--stand-in", default="", help="a directory holding a stand-in libnvidia-ml.so.1 (no GPU here)")
    ap.add_argument("--importtime", action="store_true", help="one more run under -X importtime: its slowest imports")
    a = ap.parse_args()
    n, importtime = a.n, a.importtime
    opts = {"--tree": os.path.abspath(a.tree), "--stand-in": os.path.abspath(a.stand_in) if a.stand_in else ""}
    tmp = tempfile.mkdtemp(prefix="rtl-")
    marks = os.path.join(tmp, "marks")
    copy = os.path.join(tmp, "tree")
    instrument(opts["--tree"], copy, marks, MARKS)
    conf = "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: rtl\n"
    root = etc_pve(os.path.join(tmp, "pve"), "rtl", {VMID: conf})
    cfg = os.path.join(tmp, "pvegpu.toml")
    with open(cfg, "w") as f:
        f.write(f'pve_root = "{root}"\nnode = "rtl"\n[api]\nbackend = "local"\n[reset]\nlock_dir = "{tmp}/locks"\n')
    time.sleep(2.1)  # a settings file changed in the last 2 s gets no snapshot (adapters/settingsfile): as on a node
    shim = os.path.join(tmp, "bin")
    os.makedirs(shim)
    pvesh_launcher(shim, REPO, sys.executable)
    env = dict(os.environ, PATH=shim + os.pathsep + os.environ.get("PATH", ""), SBS_PVESH_LOG=os.path.join(tmp, "pvesh.log"),
               SBS_PYTHON=sys.executable)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if opts["--stand-in"]:  # the holder holds /dev/full (1:7), which the copy's device table takes for GPU 0
        env["LD_LIBRARY_PATH"] = opts["--stand-in"]
        payload = f"exec {sys.executable} -c 'import os, time; f = os.open(\"/dev/full\", os.O_RDONLY); time.sleep(1000)'"
        path = os.path.join(copy, "pvegpu/adapters/devscan.py")
        with open(path) as f:
            text = f.read().replace("dict(gpus) if gpus is not None else None", "dict(gpus) if gpus is not None else {(1, 7): 0}")
        with open(path, "w") as f:
            f.write(text)
    else:
        payload = f"exec {sys.executable} {REPO}/bench/cuda_hold.py --gib 1 --ready {tmp}/ready"
    guard = f"import sys; sys.path[:0] = [{copy!r}]; from pvegpu.__main__ import main; main()"
    runs: list[dict[str, float]] = []
    slow: list[str] = []
    try:
        for r in range(n + importtime):
            N.kill_ct(VMID)
            if os.path.exists(f"{tmp}/ready"):  # the last run's holder said it was ready: this one has to say so itself
                os.unlink(f"{tmp}/ready")
            init = N.start_ct(VMID, payload)
            holder = _payload(init, tmp, bool(opts["--stand-in"]))
            env["FNVML_PID"] = str(holder)
            if os.path.exists(marks):
                os.unlink(marks)
            argv = [sys.executable, "-I", "-S", *(["-X", "importtime"] if r == n else []), "-c", guard, "--config", cfg, "reset",
                    str(VMID), "--json"]
            t0 = time.perf_counter() * 1000
            p = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
            end = time.perf_counter() * 1000 - t0
            if r == n:
                if os.environ.get("RTL_IMPORTS"):  # the whole -X importtime text, for a closer look
                    with open(os.environ["RTL_IMPORTS"], "w") as f:
                        f.write(p.stderr)
                slow = sorted((ln for ln in p.stderr.splitlines() if ln.startswith("import time:") and "|" in ln and "cumulative" not in ln),
                              key=lambda ln: -int(ln.split("|")[1]))[:25]
                continue
            got = read_marks(marks, t0, end)
            try:
                rep = json.loads(p.stdout)
                got["(report) outcome " + str(rep.get("outcome"))] = end
            except ValueError:
                print("no report:", p.stdout[-300:], p.stderr[-500:])
            runs.append(got)
        print(f"reset {VMID} --json, {n} runs")
        summary(runs)
        for ln in slow:
            print("  " + ln)
    finally:
        N.kill_ct(VMID)
        shutil.rmtree(tmp, ignore_errors=True)


def _payload(init: int, tmp: str, stand_in: bool) -> int:
    """The container's payload pid (the holder), once it runs (and, on a GPU, holds its memory)."""
    start = time.monotonic()
    end, said = start + 30, False
    while time.monotonic() < end:
        if not said and time.monotonic() - start > 1:
            print(f"reset_timeline: waiting for CT {VMID}'s holder to start{'' if stand_in else ' and hold its GPU memory'} (30 s at most)",
                  file=sys.stderr)
            said = True
        pids = [p for p in N.ct_pids(VMID) if p != init]
        if pids and (stand_in or os.path.exists(f"{tmp}/ready")):
            return pids[0]
        time.sleep(0.01)
    raise RuntimeError("the container's payload did not start")


if __name__ == "__main__":
    main()
