"""`pvegpu audit` against `fuser -v` and `lsof` on the same node, same run, at 2,000 and 20,000 processes (issue 20).

Usage (root): python3 bench/bench_audit_sbs.py [--sizes 2000,20000] [--rounds 5] [--lsof-rounds 3] [--out DIR]
                                              [--base DIR] [--python PY]

The node: 100 containers as real cgroups ``/lxc/<vmid>/ns`` holding SIZE/100 real sleeping processes each
(``/bin/sleep``, started with ``posix_spawn``). Half of the containers are granted a GPU; in those whose GPU has a
stand-in character device (GPUs 0-3: ``/dev/full``, ``/dev/random``, ``/dev/urandom``, ``/dev/zero``) the first
4 processes hold it open, as CUDA workers hold ``/dev/nvidiaN``; NVML is a stand-in listing the first of them with
1 GiB. Configs come from an ``/etc/pve``-like tree. In rounds, interleaved, each as a whole process unless said:

- ``fuser -v`` on the four stand-in devices (what ``fuser -v /dev/nvidia*`` is on a GPU node);
- ``lsof`` on the same devices;
- the audit in this process (``run_audit``: holders by fd and maps of every process, placement, configs, flags),
  with the scan spread over forked workers (the default) and serial (``workers=1``);
- the audit as a whole process: interpreter start, pvegpu's imports, the same ``run_audit``, its JSON on stdout
  (the stand-in NVML instead of the driver; no CLI), and that process's own time for ``run_audit``;
- ``pvegpu audit --json`` as a user runs it, a whole process through the entry point (``bench/audit_cli.py``: the
  CLI of this checkout, NVML's calls answered by the stand-in, the four stand-in devices as the GPUs' device
  numbers), with the scan over forked workers (the default) and serial; ``--python PY`` names the interpreter
  (a venv without this checkout's editable install, as the .deb's: the editable finder costs ~8 ms at start-up);
- with ``--base DIR`` (a checkout of an older release with this script and ``audit_cli.py`` copied into its
  ``bench/``): the same processes on that release's code, same rounds, for a before/after in one run.

Prints one table per size (median, min, ratio to ``fuser -v`` in the same run) and writes it to DIR if given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import marshal
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.bench_audit import GPUS, STAND_INS, CountingPve, StandInNvml  # noqa: E402
from tests import pvelike  # noqa: E402

CTS = 100
HOLDERS_PER_CT = 4
SLEEP = "/bin/sleep"


def one_audit(state: str) -> None:
    """The whole-process variant: read the node's description, run the audit, print its JSON."""
    from pvegpu.adapters.nodefiles import LocalNodeFiles
    from pvegpu.adapters.procfs import DeviceTable, ProcHost
    from pvegpu.audit import run_audit
    from pvegpu.contract import dumps

    with open(state) as f:
        s = json.load(f)
    table = DeviceTable({(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)})
    files = LocalNodeFiles(s["root"], dev_map={f"/dev/nvidia{m}": "/dev/full" for m in range(GPUS)} | {"/dev/nvidiactl": "/dev/full"})
    t = time.perf_counter()
    rep = run_audit(pve=CountingPve(s["root"], node="bench"), probe=StandInNvml({int(k): v for k, v in s["owners"].items()}),
                    host=ProcHost(table), files=files)
    audit_s = time.perf_counter() - t
    sys.stdout.write(dumps(rep.to_json()))
    sys.stdout.flush()
    sys.stderr.write(f"\naudit_s {audit_s:.6f}\n")
    sys.stderr.flush()
    os._exit(0)


def spawn_node(size: int, base: int) -> tuple[list[int], dict[int, list[int]], list[int]]:
    """SIZE sleeping processes in 100 container cgroups; returns (pids, owners by GPU, vmids)."""
    vmids = [base + i for i in range(CTS)]
    per = size // CTS
    pids: list[int] = []
    owners: dict[int, list[int]] = {}
    for i, v in enumerate(vmids):
        cg = pvelike.cgroup_dir(v)
        os.makedirs(cg, exist_ok=True)
        gpu = i % GPUS
        dev = STAND_INS[gpu] if i % 2 == 0 and gpu < len(STAND_INS) else None
        with open(os.path.join(cg, "cgroup.procs"), "w") as procs:
            for j in range(per):
                acts = [(os.POSIX_SPAWN_OPEN, 3, dev, os.O_RDONLY, 0)] if dev and j < HOLDERS_PER_CT else []
                pid = os.posix_spawn(SLEEP, [SLEEP, "3600"], {"PATH": "/usr/bin:/bin"}, file_actions=acts)
                procs.write(f"{pid}\n")
                procs.flush()
                pids.append(pid)
                if dev and j == 0:
                    owners.setdefault(gpu, []).append(pid)
    return pids, owners, vmids


def _host(cls: type, table: object, workers: int | None) -> object:
    """ProcHost with ``workers`` (a release before issue 20 has no such argument: its one serial scan)."""
    try:
        return cls(table, workers=workers)
    except TypeError:
        return cls(table)


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, env=env)
    return time.perf_counter() - t, r


def cli_holders(stdout: bytes) -> int:
    """Container holders in an ``audit --json`` document (what the in-process rows count)."""
    doc = json.loads(stdout)
    return sum(len([h for h in g["holders"] if h["place"] == "lxc"]) for n in doc["nodes"] for g in n["gpus"])


def site_path(python: str) -> str:
    """What ``site`` adds to ``python``'s path (its site-packages and what their ``.pth`` files name), joined by
    ``os.pathsep``: what the .deb's launcher names for its venv."""
    code = "import sys; bare = set(sys.path); import site; site.main(); print(__import__('os').pathsep.join(p for p in sys.path if p not in bare))"
    return subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def measure(size: int, rounds: int, lsof_rounds: int, base_repo: str = "", python: str = sys.executable,
            launcher: bool = True) -> dict[str, object]:
    from pvegpu.adapters.nodefiles import LocalNodeFiles
    from pvegpu.adapters.procfs import DeviceTable, ProcHost
    try:
        from pvegpu.adapters.scanpool import cores, shares
    except ImportError:  # a release before issue 20: serial only
        def cores() -> int:
            return os.cpu_count() or 1

        def shares(count: int) -> int:
            return 1
    from pvegpu.audit import run_audit

    base = 600000 + (os.getpid() % 1000) * 100
    tmp = tempfile.mkdtemp(prefix="pvegpu-bench-sbs-")
    pids: list[int] = []
    vmids = [base + i for i in range(CTS)]
    try:
        confs = {v: f"arch: amd64\nhostname: ct{i}\ndev0: /dev/nvidia{i % GPUS},gid=44\ndev1: /dev/nvidiactl,gid=44\n"
                 for i, v in enumerate(vmids) if i % 2 == 0} | {v: f"arch: amd64\nhostname: ct{i}\n" for i, v in enumerate(vmids) if i % 2}
        root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", confs)
        t0 = time.perf_counter()
        pids, owners, vmids = spawn_node(size, base)
        setup = time.perf_counter() - t0
        time.sleep(1.0)  # every sleeper exec'd and settled
        nprocs = len([n for n in os.listdir("/proc") if n.isdigit()])
        state = os.path.join(tmp, "state.json")
        with open(state, "w") as f:
            json.dump({"root": root, "owners": owners}, f)
        with open(state + ".marshal", "wb") as f:  # the same owners for audit_cli.py, read without json
            marshal.dump({int(k): list(v) for k, v in owners.items()}, f)
        table = DeviceTable({(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)})
        files = LocalNodeFiles(root, dev_map={f"/dev/nvidia{m}": "/dev/full" for m in range(GPUS)} | {"/dev/nvidiactl": "/dev/full"})
        probe, pve = StandInNvml(owners), CountingPve(root, node="bench")
        rows: dict[str, list[float]] = {k: [] for k in LABELS}
        holders: dict[str, int] = {}
        for path in (REPO, base_repo):  # as installed: bytecode compiled once (the .deb runs compileall)
            if path:
                subprocess.run([python, "-m", "compileall", "-q", os.path.join(path, "pvegpu")], capture_output=True)
        cli_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PVEGPU_PVE_ROOT": root}
        cli_python = [python]
        if launcher:  # as the .deb runs pvegpu: the interpreter -IS, the site-packages named (packaging/launcher.py)
            cli_python += ["-I", "-S"]
            cli_env["BENCH_SITE_PATH"] = site_path(python)
        clis = [(key, path, env) for key, path, env in (
            ("cli", REPO, cli_env), ("cli_serial", REPO, cli_env | {"BENCH_SCAN_WORKERS": "1"}), ("base_cli", base_repo, cli_env))
            if path]
        codes: dict[str, set[int]] = {}
        for r in range(rounds):
            dt, out = timed(["fuser", "-v", *STAND_INS])
            rows["fuser"].append(dt)
            holders["fuser"] = len([w for w in out.stdout.split() if w.isdigit()])
            if r < lsof_rounds:
                dt, out = timed(["lsof", "-w", *STAND_INS])
                rows["lsof"].append(dt)
                holders["lsof"] = max(0, len(out.stdout.splitlines()) - 1)
            for key, workers in (("audit", None), ("serial", 1)):
                t = time.perf_counter()
                rep = run_audit(pve=pve, probe=probe, host=_host(ProcHost, table, workers), files=files)
                rows[key].append(time.perf_counter() - t)
                holders[key] = sum(len([h for h in g.holders if h.place == "lxc"]) for g in rep.gpus)
            for key, path in (("process", REPO), ("base", base_repo)):
                if not path:
                    continue
                dt, out = timed([sys.executable, os.path.join(path, "bench", "bench_audit_sbs.py"), "--one", state],
                                dict(os.environ, PYTHONPATH=path))
                if out.returncode != 0:
                    raise RuntimeError(out.stderr.decode()[-2000:])
                rows[key].append(dt)
                rows[key + "_audit"].append(float(out.stderr.split()[-1]))
            for key, path, env in clis:
                dt, out = timed([*cli_python, os.path.join(path, "bench", "audit_cli.py"), state, "audit", "--json"], env)
                codes.setdefault(key, set()).add(out.returncode)
                if out.returncode not in (0, 8):
                    raise RuntimeError(out.stderr.decode()[-2000:])
                rows[key].append(dt)
                holders[key] = cli_holders(out.stdout)
        return {"size": size, "procs": nprocs, "setup_s": round(setup, 1), "rows": rows, "holders": holders, "codes": codes,
                "shares": shares(nprocs), "cores": cores(), "load": os.getloadavg()}
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pids:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        for v in vmids:
            pvelike.destroy_ct(v)


LABELS = {
    "fuser": "`fuser -v` on the 4 stand-in devices (whole process)",
    "lsof": "`lsof -w` on the same devices (whole process)",
    "audit": "audit, in process, scan over forked workers (default)",
    "serial": "audit, in process, serial scan (`workers=1`)",
    "process": "audit as a whole process (start-up + imports + audit + JSON)",
    "process_audit": "the same process's audit alone (its first, in a fresh process)",
    "base": "base (`--base`): audit as a whole process",
    "base_audit": "base: that process's audit alone",
    "cli": "`pvegpu audit --json`, the CLI as a user runs it (whole process; scan over forked workers)",
    "cli_serial": "the same CLI, serial scan",
    "base_cli": "base (`--base`): `pvegpu audit --json`, the CLI (whole process)",
}


def table(res: dict[str, object]) -> str:
    rows = res["rows"]
    assert isinstance(rows, dict)
    ref, ref_min = statistics.median(rows["fuser"]), min(rows["fuser"])
    out = [f"**{res['size']:,} sleeping processes** ({res['procs']:,} on the host, {res['cores']} cores, {res['shares']} "
           f"scan shares, load {', '.join(f'{x:.1f}' for x in res['load'])}; holders found: {res['holders']})", "",
           f"(exit codes of the CLI: {res.get('codes')})", "",
           "| method | median | min | ÷ `fuser -v` (median) | ÷ `fuser -v` (min) |", "|---|---|---|---|---|"]
    for key, label in LABELS.items():
        ts = rows[key]
        if ts:
            out.append(f"| {label} | {statistics.median(ts) * 1000:.0f} ms | {min(ts) * 1000:.0f} ms | "
                       f"{statistics.median(ts) / ref:.2f}× | {min(ts) / ref_min:.2f}× |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2000,20000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lsof-rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--base", default="", help="a checkout of an older release (with this script copied into its bench/) to run beside")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the CLI processes (default: this one)")
    ap.add_argument("--site", action="store_true", help="run the CLI with site (pip's console script), not -IS as the .deb's launcher")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one_audit(a.one)
    if os.geteuid() != 0:
        print("Error: needs root (cgroups)\nHint: run it with sudo", file=sys.stderr)
        return 2
    when = datetime.datetime.now(datetime.UTC)
    head = (f"{when:%Y-%m-%d %H:%M} UTC, {platform.node()}: {os.cpu_count()} CPUs, Linux {platform.release()}, "
            f"Python {sys.version.split()[0]}; CLI interpreter {a.python}"
            f"{' with site' if a.site else ' -I -S, its site-packages named (as the .deb launcher runs it)'}\n\n`{' '.join(sys.argv)}`\n")
    print(head, flush=True)
    text = head + "\n"
    for size in (int(x) for x in a.sizes.split(",") if x):
        t = table(measure(size, a.rounds, a.lsof_rounds, os.path.abspath(a.base) if a.base else "", a.python, not a.site))
        print(t, flush=True)
        text += t + "\n"
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"audit_sbs-{when:%Y-%m-%d-%H%M%S}-{a.sizes.replace(',', '-')}.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
