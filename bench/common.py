"""What the three budget scripts (gate.py, reset.py, audit.py) share: pvegpu driven as a whole process, paired rounds,
the machine and the commit measured, a simulated node made and removed through pvegpu's own CLI, and the report:
one markdown table per budget (pvegpu, what it is compared with, the physical floor where there is one, the ratio,
the budget, met or not).

Budgets are measured, never asserted in tests: a missed budget is a line in the report, not a failure.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tests.pvelike import private_device

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"  # what PVE gives a hookscript
NO_GPU = "n/a (no GPU)"
SMI_GATE = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"]


# -- running and timing ------------------------------------------------------------------------------------------


def timed(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall time of one whole process (start to exit, as an admin waits for it) and what it did; stdin is /dev/null."""
    t = time.perf_counter()
    p = subprocess.run(list(argv), capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=timeout)
    return time.perf_counter() - t, p


def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round ``r`` of a paired run: every name once, the first moving one place on each round, so no method always
    runs first (after the other's caches, or when the shared machine happens to be busy)."""
    k = r % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def rotation(names: Sequence[str], rounds: int) -> list[str]:
    """``rounds`` rounds of ``rotated``, one after the other."""
    return [n for r in range(rounds) for n in rotated(names, r)]


def paired(methods: dict[str, Callable[[], float | None]], rounds: int) -> dict[str, list[float]]:
    """Run each method once per round, interleaved (``rotation``); seconds per run, by method. A method returning
    None did not give a time (its failure is its own to record)."""
    out: dict[str, list[float]] = {m: [] for m in methods}
    for name in rotation(list(methods), rounds):
        s = methods[name]()
        if s is not None:
            out[name].append(s)
    return out


def on_sigterm_exit() -> None:
    """A SIGTERM (a batch's ``timeout``) ends the script through its ``finally`` blocks: nothing it started is left."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def pvegpu_command(given: str = "") -> list[str]:
    """The pvegpu to time: ``given`` (split as a shell would), else the entry point beside this interpreter (a venv's
    ``bin/pvegpu``), else the one on PATH, else ``python -m pvegpu``."""
    if given:
        return shlex.split(given)
    beside = os.path.join(os.path.dirname(sys.executable), "pvegpu")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("pvegpu")
    return [found] if found else [sys.executable, "-m", "pvegpu"]


def has_gpu() -> bool:
    """An NVIDIA GPU answers here (``nvidia-smi -L`` lists one)."""
    if not shutil.which("nvidia-smi"):
        return False
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and "GPU" in p.stdout


def choose_node(asked: str, gpu: Callable[[], bool] = has_gpu) -> str:
    """``gpu`` or ``sim``: what was asked, or (``auto``) the GPU node when a GPU answers here."""
    if asked in ("gpu", "sim"):
        return asked
    return "gpu" if gpu() else "sim"


# -- statistics and the table ------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt_s(x: float | None) -> str:
    """Seconds as an admin reads them: ms below a second, seconds above."""
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_runs(xs: Sequence[float] | None, missing: str = "–") -> str:
    """``median 42 ms (min 38 ms, 40 runs)``, or ``missing`` when there are none."""
    if not xs:
        return missing
    return f"median {fmt_s(median(xs))} (min {fmt_s(min(xs))}, {len(xs)} run{'s' if len(xs) != 1 else ''})"


@dataclass(frozen=True)
class Budget:
    """One budget of issue 29 item 6. ``kind``:

    - ``at_most_s``: pvegpu's median ≤ ``limit`` seconds (the gate);
    - ``over_floor_s``: pvegpu's median ≤ the floor's median + ``limit`` seconds (the reset);
    - ``times_faster``: the other method's median ÷ pvegpu's ≥ ``limit`` (the reset against the manual routine);
    - ``times_other``: pvegpu's median ÷ the other's ≤ ``limit`` (the audit against ``fuser -v``).
    """

    kind: str
    limit: float

    def text(self, other: str = "") -> str:
        if self.kind == "at_most_s":
            return f"≤ {fmt_s(self.limit)}"
        if self.kind == "over_floor_s":
            return f"≤ floor + {self.limit:g} s"
        if self.kind == "times_faster":
            return f"≥ {self.limit:g}× faster than {other or 'the other'}"
        if self.kind == "times_other":
            return f"≤ {self.limit:g}× {other or 'the other'}"
        raise ValueError(f"unknown budget kind {self.kind!r}")

    def ratio(self, ours: float | None, other: float | None, floor: float | None) -> str:
        """The figure the budget is about: pvegpu over the floor (s), or a ratio of medians."""
        if self.kind == "over_floor_s":
            return "–" if ours is None or floor is None else f"floor {ours - floor:+.2f} s"
        if self.kind == "times_faster":
            return "–" if ours is None or other is None or ours <= 0 else f"{other / ours:.1f}× faster"
        if ours is None or other is None or other <= 0:
            return "–"
        return f"{ours / other:.2f}×"

    def met(self, ours: float | None, other: float | None, floor: float | None) -> bool | None:
        """None: not measurable here (a missing median)."""
        if ours is None:
            return None
        if self.kind == "at_most_s":
            return ours <= self.limit
        if self.kind == "over_floor_s":
            return None if floor is None else ours <= floor + self.limit
        if other is None or ours <= 0 or other <= 0:
            return None
        if self.kind == "times_faster":
            return other / ours >= self.limit
        return ours / other <= self.limit


@dataclass
class Row:
    """One line of a budget table: pvegpu's runs (seconds), what it is compared with, the floor, the budget.
    ``other``/``floor`` None: not measured here, ``other_note`` says why (``n/a (no GPU)``). ``failures``: runs
    that did not do the job (a refused clean start, a reset that was not clean...): the budget is then not met."""

    measure: str
    pvegpu: list[float]
    against: str = ""
    other: list[float] | None = None
    other_note: str = ""
    floor: list[float] | None = None
    budget: Budget | None = None
    failures: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        ours, other, floor = median(self.pvegpu), median(self.other or []), median(self.floor or [])
        against = "–" if not self.against else f"{self.against}: {fmt_runs(self.other, self.other_note or '–')}"
        if self.budget is None:
            ratio = "–" if ours is None or other is None or other <= 0 else f"{ours / other:.2f}×"
            budget, met = "–", "–"
        else:
            ratio = self.budget.ratio(ours, other, floor)
            budget = self.budget.text(self.against.split(":")[0] if self.against else "")
            ok = self.budget.met(ours, other, floor)
            if self.failures:
                met = f"**no**: {'; '.join(self.failures)}"
            else:
                met = "n/a" if ok is None else ("yes" if ok else "**no**")
        return [self.measure, fmt_runs(self.pvegpu), against, fmt_runs(self.floor), ratio, budget, met]


TABLE_HEAD = ["measure", "pvegpu", "against", "physical floor", "ratio", "budget", "met"]


def table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r.cells()) + " |" for r in rows]
    return "\n".join(lines)


# -- the machine, the commit, the load ---------------------------------------------------------------------------


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of /proc/cpuinfo (x86), else its ``Model``/``CPU part`` (arm), else "unknown CPU"."""
    for key in ("model name", "Model", "cpu model", "CPU part"):
        for line in cpuinfo.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return " ".join(value.split())
    return "unknown CPU"


def gpu_line(smi_csv: str) -> str:
    """``nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader`` → ``2 × NVIDIA H200 (143771
    MiB), driver 580.159.04``; one part per distinct GPU."""
    seen: dict[tuple[str, str, str], int] = {}
    for line in smi_csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0]:
            seen[(parts[0], parts[1], parts[2])] = seen.get((parts[0], parts[1], parts[2]), 0) + 1
    if not seen:
        return NO_GPU
    return "; ".join(f"{n} × {name} ({mem}), driver {drv}" for (name, drv, mem), n in seen.items())


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_model(f.read())
    except OSError:
        cpu = platform.processor() or "unknown CPU"
    gpu = NO_GPU
    if shutil.which("nvidia-smi"):
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            gpu = gpu_line(p.stdout) if p.returncode == 0 else NO_GPU
        except (OSError, subprocess.TimeoutExpired):
            pass
    return (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}; GPU: {gpu}")


def commit(repo: str = REPO) -> str:
    """The checkout's commit (``+ uncommitted changes`` when tracked files differ from it); without git here (a copy
    of the tree on a GPU machine), ``$PVEGPU_COMMIT`` or "unknown"."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("PVEGPU_COMMIT") or "unknown (no git here; set PVEGPU_COMMIT)"


def pvegpu_version(pvegpu: list[str]) -> str:
    try:
        p = subprocess.run([*pvegpu, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({exc})"
    return (p.stdout.strip() or p.stderr.strip()).splitlines()[0] if (p.stdout or p.stderr).strip() else f"? (exit {p.returncode})"


def load() -> str:
    """``uptime``'s line (the load of the shared machine), else the load averages."""
    try:
        p = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10)
        if p.returncode == 0 and p.stdout.strip():
            return " ".join(p.stdout.split())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class Report:
    """The header every result file opens with, then the tables and notes."""

    title: str
    command: str
    node: str  # "GPU node" or "simulated node"
    gap: str  # what differs from a GPU node ("" on one)
    pvegpu: list[str]
    when: datetime.datetime = field(default_factory=now)
    load_before: str = field(default_factory=load)
    load_after: str = ""
    body: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.body.append(text)

    def markdown(self, machine_line: str | None = None, commit_line: str | None = None, version: str | None = None) -> str:
        head = [f"# {self.title}", "",
                f"- date: {self.when:%Y-%m-%d %H:%M} UTC",
                f"- machine: {machine() if machine_line is None else machine_line}",
                f"- pvegpu: commit {commit() if commit_line is None else commit_line}; "
                f"`{shlex.join(self.pvegpu)}` ({pvegpu_version(self.pvegpu) if version is None else version})",
                f"- node: {self.node}" + (f". Gap to a GPU node: {self.gap}" if self.gap else ""),
                f"- load (`uptime`): before: {self.load_before}; after: {self.load_after or load()}",
                f"- command: `{self.command}`", ""]
        return "\n".join(head + self.body).rstrip("\n") + "\n"


def result_path(out_dir: str, budget: str, when: datetime.datetime) -> str:
    """``OUT/<date>-<budget>.md``; a file already there (an earlier run that day) is kept: ``-2``, ``-3``... follow."""
    base = os.path.join(out_dir, f"{when:%Y-%m-%d}-{budget}")
    path, n = base + ".md", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.md"
    return path


def finish(rep: Report, out_dir: str, budget: str) -> str:
    """Print the report; write it to ``out_dir`` when given. Returns the markdown."""
    rep.load_after = load()
    text = rep.markdown()
    print(text, flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = result_path(out_dir, budget, rep.when)
        with open(path, "w") as f:
            f.write(text)
        print(f"written: {path}", file=sys.stderr)
    return text


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, from the repository root (paths inside it relative)."""
    def rel(path: str) -> str:
        full = os.path.abspath(path)
        return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else path

    script = rel(sys.argv[0]) if sys.argv and sys.argv[0] else "bench/?"
    return shlex.join([rel(sys.executable), script, *argv])


# -- the simulated node, through pvegpu's CLI -----------------------------------------------------------------------


class SimNode:
    """A simulated node built by ``pvegpu sim create DIR --scenario FILE`` and removed by ``pvegpu sim remove DIR``:
    containers are real processes (a session each), NVML and the Proxmox API are pvegpu's simulations."""

    def __init__(self, pvegpu: list[str], scenario: dict, parent: str | None = None) -> None:
        self.pvegpu = pvegpu
        self.parent = tempfile.mkdtemp(prefix="bench-sim-", dir=parent)
        self.dir = os.path.join(self.parent, "node")
        self.scenario = scenario
        path = os.path.join(self.parent, "scenario.json")
        with open(path, "w") as f:
            json.dump(scenario, f)
        p = subprocess.run([*pvegpu, "sim", "create", self.dir, "--scenario", path], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            shutil.rmtree(self.parent, ignore_errors=True)
            raise RuntimeError(f"pvegpu sim create failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1000:]}")

    def cmd(self, *args: str) -> list[str]:
        """``pvegpu --simulate DIR ARGS...`` (the global option before the command)."""
        return [*self.pvegpu, "--simulate", self.dir, *args]

    def stand_ins(self) -> list[str]:
        """What the node's GPUs play, by minor (what its workloads hold open): the scenario's ``stand_in``, else the
        node's own ``dev/nvidia<minor>`` file."""
        return [str(g.get("stand_in") or os.path.join(self.dir, "dev", f"nvidia{g['minor']}"))
                for g in sorted(self.scenario["gpus"], key=lambda g: g["minor"])]

    def remove(self) -> None:
        if os.path.isdir(self.dir):
            subprocess.run([*self.pvegpu, "sim", "remove", self.dir], capture_output=True, text=True, timeout=120)
        shutil.rmtree(self.parent, ignore_errors=True)

    def __enter__(self) -> SimNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class PrivateDevices:
    """``n`` character devices no other process on the machine holds (high-index ptys: ``pvelike.private_device``),
    the simulated node's GPUs: an fd of one is recognised by its device number, as one of /dev/nvidiaN on a node, and
    ``fuser`` is run on them as on /dev/nvidia*. They exist while this object keeps their masters open."""

    def __init__(self, n: int) -> None:
        self.masters: list[int] = []
        self.paths: list[str] = []
        for _ in range(n):
            master, path, _rdev = private_device()
            self.masters.append(master)
            self.paths.append(path)

    def close(self) -> None:
        for fd in self.masters:
            os.close(fd)
        self.masters = []

    def __enter__(self) -> PrivateDevices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sim_gpus(n: int, stand_ins: Sequence[str] = (), name: str = "Simulated H200", total_mib: int = 143771) -> list[dict]:
    """The ``gpus`` of a scenario: GPU i plays ``stand_ins[i]`` when given (else the node's own stand-in file)."""
    return [{"minor": i, "index": i, "name": name, "total_mib": total_mib} | ({"stand_in": stand_ins[i]} if i < len(stand_ins) else {})
            for i in range(n)]


def holder_pids(audit_json: str, vmid: int | None = None) -> dict[int, float]:
    """pid → MiB NVML credits it (0 when none) of every holder in a ``pvegpu audit --json`` document (only those of
    container ``vmid`` when given)."""
    doc = json.loads(audit_json)
    out: dict[int, float] = {}
    for node in doc.get("nodes", []):
        for g in node.get("gpus", []):
            for h in g.get("holders", []) or []:
                if vmid is None or h.get("vmid") == vmid:
                    out[int(h["pid"])] = out.get(int(h["pid"]), 0.0) + float(h.get("used_mib") or 0)
    return out


def fuser_pids(stdout: str) -> set[int]:
    """The PIDs ``fuser`` prints on stdout (each may carry access letters: ``1234m``); -v's table goes to stderr."""
    return {int(m) for m in re.findall(r"(?<![\w/])(\d+)[a-zA-Z]*(?![\w/])", stdout)}
