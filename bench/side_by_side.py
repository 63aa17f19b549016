"""Side by side on a real GPU: the manual routine, a container restart and ``pvegpu reset``, same scenarios,
same run, each from a verified idle GPU (issue 11).

Usage, as root on an NVIDIA Linux host (with the Python that has nvidia-ml-py and pvegpu's dependencies):

    python3 bench/side_by_side.py --out DIR [--scenarios hold-20,fork,...] [--methods manual,restart,pvegpu]
                                  [--reps 1] [--scale 1.0] [--grace 3] [--profile]

Writes DIR/side_by_side-<date>.json (every run, raw) and DIR/side_by_side-<date>.md (the tables) and prints
the tables. Containers 301 and 302 are built as cgroups /lxc/<vmid>/ns with their own PID and mount
namespace; anything left of them is stopped first. The GPU must be idle (nothing listed by NVML).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import sbs_model as M  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON and markdown results")
    ap.add_argument("--scenarios", default="", help="comma-separated keys (default: all): " + ",".join(s.key for s in M.SCENARIOS))
    ap.add_argument("--methods", default=",".join(M.METHODS))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every allocation (a GPU smaller than 120 GiB)")
    ap.add_argument("--grace", type=float, default=3.0, help="pvegpu's reset.grace (SIGTERM → SIGKILL)")
    ap.add_argument("--name", default="", help="file name stem of the results (default side_by_side-<date>)")
    ap.add_argument("--profile", action="store_true", help="one more pvegpu run of the first scenario under -X importtime")
    ap.add_argument("--pvegpu", default="", help="the pvegpu command to time, e.g. /opt/pvegpu/bin/pvegpu (default: the .deb's launcher "
                    "for this checkout: this python -IS, the checkout and this python's site-packages named)")
    a = ap.parse_args(argv)
    methods = [m for m in a.methods.split(",") if m]
    if bad := [m for m in methods if m not in M.METHODS]:
        ap.error(f"unknown method(s) {bad}; known: {', '.join(M.METHODS)}")
    a.methods = methods
    try:
        a.scenario_list = M.scenarios([k for k in a.scenarios.split(",") if k] or None, a.scale)
    except ValueError as exc:
        ap.error(str(exc))
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        print("Error: needs root (cgroups, namespaces, signals)\nHint: run it with sudo on the GPU host", file=sys.stderr)
        return 2
    from bench.sbs_gpu import Bench

    b = Bench(a.grace, pvegpu=a.pvegpu.split() or None)
    when = datetime.datetime.now(datetime.UTC)
    meta = {"when": when.strftime("%Y-%m-%d %H:%M UTC"), "command": "python3 bench/side_by_side.py " + shlex.join(argv),
            "kernel": platform.release(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "idle_nvml_mib": round(b.idle_mib, 1), "idle_smi_mib": b.smi_idle, "grace_s": a.grace,
            "manual_routine": M.MANUAL_ROUTINE.format(kill=b.kill), "threshold_mib": M.THRESHOLD_MIB} | b.nvml.machine()
    meta["machine"] = f"{meta['gpu']} ({meta['total_mib']} MiB), {meta['cpus']} CPUs, Linux {meta['kernel']}, Python {meta['python']}"
    runs: list[M.Run] = []
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, a.name or f"side_by_side-{when:%Y-%m-%d}")
    try:
        for s in a.scenario_list:
            for rep in range(a.reps):
                for m in a.methods:
                    r = b.run(s, m, rep)
                    runs.append(r)
                    print(f"{s.key:12s} {m:8s} {r.wall_s or 0:7.3f} s  {r.verdict:10s} {r.judgement:12s} {r.detail}", flush=True)
                    save(stem, meta, runs)  # after every run: a run cut short still leaves its results
        if a.profile and "pvegpu" in a.methods:
            runs.append(b.run(a.scenario_list[0], "pvegpu", 0, profile=True))
    finally:
        b.close()
    print(save(stem, meta, runs))
    return 0


def save(stem: str, meta: dict, runs: list[M.Run]) -> str:
    """Write stem.json (raw) and stem.md (tables); returns the markdown."""
    with open(stem + ".json", "w") as f:
        f.write(M.to_json(meta, runs))
    text = M.markdown(meta, runs)
    with open(stem + ".md", "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
