"""When each step of the start gate happens, in the hook's parent and in its forked child (root, GPU node).

    python3 bench/gate_timeline.py [N] [--tree DIR]

Copies the checkout (or ``--tree DIR``) to a temporary directory, adds a mark at each step (a line appended to a
file: the step, the pid, ``perf_counter`` in ms; the child's stdio is /dev/null), and runs the hookscript as PVE
runs it N times (a node of one container, ``/etc/pvegpu/pvegpu.toml`` read through its snapshot). Prints
each step's median time since the spawn, parent (P) or child (C) and, for the child's NVML thread (W), what
it waited for. The marks cost a few µs each; the copy is the checkout's code, the marks aside.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests import pvelike  # noqa: E402

# (file, anchor, mark, after): a mark is put before (or after) the first line holding the anchor
MARKS = [
    ("pvegpu/__main__.py", "from .frontdoor import main as front", "P main", False),
    ("pvegpu/__main__.py", "os._exit(code)  # all output", "P exit", False),
    ("pvegpu/hook.py", "child = start_check(vmid, opts) if args[1]", "P fork", False),
    ("pvegpu/hook.py", "child = start_check(vmid, opts) if args[1]", "P forked", True),
    ("pvegpu/hook.py", "return _pre_start(vmid, s, child, out, err)", "P settings", False),
    ("pvegpu/hook.py", "v = collect(child, s)\n        allow, text", "P collect", False),
    ("pvegpu/hook.py", "allow, text = bool(v[\"allow\"]), str(v[\"text\"])", "P answer", False),
    ("pvegpu/adapters/child.py", "null = os.open(os.devnull, os.O_RDWR)", "C start", False),
    ("pvegpu/adapters/child.py", "_write_all(w, data)", "C write", False),
    ("pvegpu/hook.py", "ports = wiring.gate_ports(s)", "C settings", False),
    ("pvegpu/hook.py", "ports = wiring.gate_ports(s)", "C ports", True),
    ("pvegpu/gate.py", "pids = ports.host.ct_pids(vmid)", "C config", False),
    ("pvegpu/gate.py", "pids = ports.host.ct_pids(vmid)", "C ct_pids", True),
    ("pvegpu/gate.py", "init = next((p for p in pids", "C facts", False),
    ("pvegpu/gate.py", "return CheckResult(vmid, decide(vmid, facts", "C decide", False),
    ("pvegpu/holders.py", "samples = probe.sample(minors)", "C sampled", True),
    ("pvegpu/adapters/bounded.py", "            self._wait(opening, None)", "C join", False),  # the first reading waits for NVML's start
    ("pvegpu/adapters/bounded.py", "            self._wait(opening, None)", "C joined", True),
    ("pvegpu/adapters/nvml.py", "            self.N.nvmlInit()", "W init", False),  # NVML's start, in its thread
    ("pvegpu/adapters/nvml.py", "            self.N.nvmlInit()", "W started", True),
]


def guard_for(tmp: str, tree: str, name: str) -> str:
    """The hookscript with its fast path's pvegpu directory pointing at checkout ``tree`` (nvidia-ml-py's stays)."""
    path = pvelike.guard(tmp, pvelike.launcher(tmp))
    with open(path) as f:
        text = f.read().replace(f"PVEGPU_PYTHONPATH={REPO}", f"PVEGPU_PYTHONPATH={tree}")
    out = os.path.join(tmp, name)
    with open(out, "w") as f:
        f.write(text)
    os.chmod(out, 0o755)
    return out


def instrument(src: str, dst: str, marks_file: str, marks: list[tuple[str, str, str, bool]] = MARKS) -> None:
    """``src``'s pvegpu copied to ``dst`` with ``marks`` (file, anchor, name, after) added, appending to ``marks_file``."""
    shutil.copytree(os.path.join(src, "pvegpu"), os.path.join(dst, "pvegpu"), ignore=shutil.ignore_patterns("__pycache__"))
    stmt = ("import os as _o, time as _t; _o.write(_o.open(%r, 1089, 0o644), b'%%s %%d %%.3f\\n' %% (%r, _o.getpid(), "
            "_t.perf_counter() * 1000))")
    for rel, anchor, name, after in marks:
        path = os.path.join(dst, rel)
        with open(path) as f:
            text = f.read()
        i = text.find(anchor)
        if i < 0:
            raise SystemExit(f"gate_timeline: {rel}: anchor not found: {anchor!r}")
        start = text.rfind("\n", 0, i) + 1
        indent = re.match(r"\s*", text[start:]).group(0)  # type: ignore[union-attr]
        line = indent + stmt % (marks_file, name.encode()) + "\n"
        at = text.index("\n", i + len(anchor.rstrip("\n")) - 1) + 1 if after else start
        text = text[:at] + line + text[at:]
        with open(path, "w") as f:
            f.write(text)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(dst, "pvegpu")], check=True)


def read_marks(path: str, t0: float, end: float) -> dict[str, float]:
    """One run's marks as ms since the spawn ``t0`` (a step seen again is ``NAME #2``, ``#3``...), and its exit ``end``."""
    got: dict[str, float] = {"END (exit seen)": end}
    seen: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _pid, at = line.rsplit(" ", 2)
            seen[name] = seen.get(name, 0) + 1
            got.setdefault(name if seen[name] == 1 else f"{name} #{seen[name]}", float(at) - t0)
    return got


def summary(runs: list[dict[str, float]]) -> None:
    """Each step's median and minimum over the runs, in the order of their medians."""
    names = sorted({k for r in runs for k in r}, key=lambda k: statistics.median(r[k] for r in runs if k in r))
    for name in names:
        vals = [r[name] for r in runs if name in r]
        print(f"  {name:24s} {statistics.median(vals):7.2f} ms  (min {min(vals):6.2f}, {len(vals)} runs)")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="When each step of the start gate happens (marks in a copy of the tree).")
    ap.add_argument("n", nargs="?", type=int, default=25, help="runs (default 25)")
    ap.add_argument("--tree", default=REPO, help="the checkout to time (default: this one)")
    a = ap.parse_args()
    n, tree = a.n, os.path.abspath(a.tree)
    tmp = tempfile.mkdtemp()
    marks = os.path.join(tmp, "marks")
    copy = os.path.join(tmp, "tree")
    instrument(tree, copy, marks)
    conf = "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: bench\n"
    root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: conf})
    cfg = os.path.join(tmp, "pvegpu.toml")
    with open(cfg, "w") as f:
        f.write(f'pve_root = "{root}"\n[reset]\nlock_dir = "{tmp}/locks"\n[gate]\noverride_dir = "{tmp}/allow"\n')
    env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg} | {k: v for k, v in os.environ.items() if k == "LD_LIBRARY_PATH"}
    guard = guard_for(tmp, copy, "guard")
    time.sleep(2.1)  # a settings file changed in the last 2 s gets no snapshot (adapters/settingsfile): as on a node
    subprocess.run([guard, "129", "pre-start"], stdin=subprocess.DEVNULL, capture_output=True, env=env)  # writes it
    runs: list[dict[str, float]] = []
    try:
        for _ in range(n):
            if os.path.exists(marks):
                os.unlink(marks)
            t0 = time.perf_counter() * 1000
            p = subprocess.run([guard, "129", "pre-start"], stdin=subprocess.DEVNULL, capture_output=True, env=env)
            runs.append(read_marks(marks, t0, time.perf_counter() * 1000 - t0))
            time.sleep(0.02)
        print(f"hookscript 129 pre-start, {n} runs, exit {p.returncode}: {p.stdout.decode().strip()[:100]}")
        summary(runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
