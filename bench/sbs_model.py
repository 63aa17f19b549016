"""The reset side by side: the pure part (scenarios, verdict vs truth, collateral, baseline, tables).

No GPU, no root, no I/O: everything here is tested on CPU in tests/test_bench_harness.py. bench/reset.py measures
(bench/sbs_gpu.py on a GPU node, a simulated node elsewhere); this module decides what the measurements mean and
renders them.

Manual equivalents: the *manual* method is ``pct exec VMID -- sh -c 'pkill -9 python; fuser -k /dev/nvidia*;
sleep 3; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits'``; the *restart* method is
``pct stop VMID && pct start VMID`` then the same ``nvidia-smi``; the *pvegpu* method is ``pvegpu reset VMID``.
The *floor* is the physical limit of any verified reset: SIGKILL to every holder the scenario started (an oracle
that needs no search), NVML polled until it first shows the memory back (the driver's release time). pvegpu then
waits its settle window (``reset.settle``: clean must hold that long before anyone may call it clean); the floor does
not.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from dataclasses import asdict, dataclass, field, replace

from pvegpu.core.contract import dumps

THRESHOLD_MIB = 64  # residual memory still counted as clean (pvegpu's reset.threshold_mib default)
METHODS = ("manual", "restart", "pvegpu", "floor")
TARGET, NEIGHBOUR = 301, 302
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
MANUAL_ROUTINE = ("{kill}; fuser -k /dev/nvidia* >/dev/null 2>&1; sleep 3; "
                  "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
PKILL = "pkill -9 python"
# the same as pkill -9 python where procps is missing: every process whose name contains "python"
KILL_LOOP = ('for d in /proc/[0-9]*; do case "$(cat $d/comm 2>/dev/null)" in *python*) kill -9 "${d#/proc/}" 2>/dev/null;; esac; done')


@dataclass(frozen=True)
class Scenario:
    """One situation on the GPU. ``kind`` names the target workload; neighbour_gib / host_gib add other
    holders of the same GPU that every method must leave alone."""

    key: str
    title: str
    kind: str  # hold | spawn | fork | ignore-term | fd-only | respawn | nested | crowd
    gib: float  # GPU memory the target's workload allocates in total (0: none)
    workers: int = 1
    neighbour_gib: float = 0.0  # a second container on the same GPU
    host_gib: float = 0.0  # a host process on the same GPU
    idle: int = 0  # idle processes beside the holder in the target


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("hold-20", "one holder, 20 GiB", "hold", 20),
    Scenario("hold-100", "one holder, 100 GiB", "hold", 100),
    Scenario("spawn", "spawn workers (3 × 4 GiB)", "spawn", 12, workers=3),
    Scenario("fork", "fork-after-init child, parent exited (8 GiB)", "fork", 8),
    Scenario("ignore-term", "holder ignores SIGTERM (8 GiB)", "ignore-term", 8),
    Scenario("fd-only", "fd-only holder (device open, no context)", "fd-only", 0),
    Scenario("two-cts", "two CTs share the GPU, reset one (8 + 12 GiB)", "hold", 8, neighbour_gib=12),
    Scenario("host-proc", "host process on the GPU (8 GiB CT + 6 GiB host)", "hold", 8, host_gib=6),
    Scenario("respawn", "respawning worker (4 GiB, service loop)", "respawn", 4),
    Scenario("nested", "holder in ns/system.slice/app.service (8 GiB)", "nested", 8),
    Scenario("crowd", "300 idle processes beside an 8 GiB holder", "hold", 8, idle=300),
)
NESTED_CGROUP = "system.slice/app.service"


def scenarios(keys: list[str] | None = None, scale: float = 1.0) -> list[Scenario]:
    """The scenarios to run, in the table's order; ``scale`` shrinks every allocation (a smaller GPU)."""
    known = {s.key: s for s in SCENARIOS}
    unknown = [k for k in keys or [] if k not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[k] for k in keys] if keys else list(SCENARIOS)
    if scale == 1.0:
        return chosen
    return [replace(s, gib=s.gib * scale, neighbour_gib=s.neighbour_gib * scale, host_gib=s.host_gib * scale) for s in chosen]


def holder_argv(python: str, holder: str, gib: float, ready: str, *flags: str) -> list[str]:
    """The command line of one cuda_hold.py process."""
    return [python, holder, "--gib", f"{gib:g}", "--ready", ready, *flags]


def workload_script(s: Scenario, python: str, holder: str, ready_dir: str, minor: int, cgroup_dir: str) -> str:
    """The shell script the target container runs (its only payload; the init runs it as its child)."""
    q = shlex.quote
    ready = f"{ready_dir}/ready"
    lines = []
    if s.idle:
        lines.append(f"i=0; while [ $i -lt {s.idle} ]; do sleep 86400 & i=$((i+1)); done")
    if s.kind == "nested":
        lines.append(f"echo $$ > {q(cgroup_dir + '/' + NESTED_CGROUP + '/cgroup.procs')}")
    if s.kind == "fd-only":
        lines.append(f"exec 3<>/dev/nvidiactl 4<>/dev/nvidia{minor}; touch {q(ready)}; exec sleep 86400")
    elif s.kind == "respawn":  # a service manager: restart the worker 0.1 s after it dies, forever
        argv = holder_argv(python, holder, s.gib, ready)
        lines.append(f"while :; do {' '.join(map(q, argv))}; sleep 0.1; done")
    else:
        flags = {"spawn": ["--workers", str(s.workers)], "fork": ["--fork-after-init"], "ignore-term": ["--ignore-term"]}.get(s.kind, [])
        lines.append("exec " + " ".join(map(q, holder_argv(python, holder, s.gib, ready, *flags))))
    return "\n".join(lines) + "\n"


def ready_count(s: Scenario) -> int:
    """How many ready markers the target's workload writes once it holds its memory."""
    return s.workers if s.kind == "spawn" else 1


# -- measurements and their meaning -------------------------------------------------------------------


@dataclass
class Truth:
    """What the GPU really looks like one second after a method's verdict (host NVML + a /proc scan)."""

    used_mib: float | None  # NVML v2 used of the target GPU; None: could not be read
    listed: list[dict] = field(default_factory=list)  # NVML-listed processes: {pid, owner, mib}
    target_holders: list[int] = field(default_factory=list)  # host PIDs in the target's cgroup with /dev/nvidia* open


@dataclass
class Run:
    """One method on one scenario."""

    scenario: str
    method: str
    rep: int = 0
    wall_s: float | None = None  # start of the method to its verdict
    verdict: str = "error"  # clean | not clean | error | skipped
    detail: str = ""
    allocated_mib: float = 0.0  # target's memory before the method (NVML used above keep_mib)
    keep_mib: float = 0.0  # NVML used that belongs to others (baseline + neighbours) and must stay
    truth: Truth | None = None
    truth_clean: bool | None = None
    judgement: str = ""
    collateral: list[dict] = field(default_factory=list)  # outside processes gone after the method
    extra: dict = field(default_factory=dict)  # method specifics (pvegpu's internal elapsed, API calls, ...)


def verdict_from_smi(smi_out: str, index: int, idle_mib: float, threshold: int = THRESHOLD_MIB) -> tuple[str, str]:
    """What an admin concludes from ``nvidia-smi --query-gpu=index,memory.used``: clean when the GPU's
    memory.used is back at its idle value. Returns (verdict, detail)."""
    used = parse_smi(smi_out).get(index)
    if used is None:
        return "error", f"nvidia-smi printed no line for GPU {index}: {smi_out.strip()[:200]!r}"
    return ("clean" if used <= idle_mib + threshold else "not clean"), f"nvidia-smi: {used:g} MiB used (idle {idle_mib:g})"


def parse_smi(text: str) -> dict[int, float]:
    """``0, 1234`` lines → {0: 1234.0}; lines that do not parse are left out."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            out[int(parts[0])] = float(parts[1])
        except ValueError:
            continue
    return out


def verdict_from_pvegpu(rc: int, stdout: str) -> tuple[str, str, dict]:
    """``pvegpu reset --json``: clean only when it exits 0 with outcome clean."""
    try:
        rep = json.loads(stdout)
    except ValueError:
        return "error", f"exit {rc}, no JSON report: {stdout.strip()[:200]!r}", {}
    outcome = str(rep.get("outcome", ""))
    extra = {"outcome": outcome, "exit_code": rc, "elapsed_s": rep.get("elapsed_s"), "restarted": bool(rep.get("restarted")),
             "signalled": len([s for s in rep.get("signalled", []) if s.get("result") == "sent"])}
    verdict = "clean" if rc == 0 and outcome.startswith("clean") else "not clean"
    return verdict, f"exit {rc}: {outcome}" + (" (after a restart)" if extra["restarted"] else ""), extra


def truth_clean(t: Truth, keep_mib: float, threshold: int = THRESHOLD_MIB) -> bool | None:
    """The target is clean when none of its processes holds the GPU (NVML list or fd scan) and the memory
    in use is no more than what others held before it started. None: the GPU could not be read."""
    if t.used_mib is None:
        return None
    if t.target_holders or any(p.get("owner") == "target" for p in t.listed):
        return False
    return t.used_mib <= keep_mib + threshold


def judge(verdict: str, truth: bool | None) -> str:
    """Compare a method's verdict with the truth: right, false clean (the dangerous one), false alarm."""
    if verdict not in ("clean", "not clean"):
        return "no verdict"
    if truth is None:
        return "truth unknown"
    said_clean = verdict == "clean"
    if said_clean == truth:
        return "right"
    return "FALSE CLEAN" if said_clean else "false alarm"


def collateral(before: dict[int, tuple[int, str, str]], after: dict[int, int | None]) -> list[dict]:
    """Outside processes hurt by a method. ``before``: pid → (start time, comm, owner) of every process
    outside the target that existed before; ``after``: pid → start time now (None: gone). A PID that now
    belongs to a different process (another start time) counts as gone."""
    hurt = []
    for pid, (start, comm, owner) in sorted(before.items()):
        now = after.get(pid)
        if now is None or now != start:
            hurt.append({"pid": pid, "comm": comm, "owner": owner})
    return hurt


def baseline_problem(used_mib: float | None, listed_pids: list[int], idle_mib: float, threshold: int = THRESHOLD_MIB) -> str | None:
    """Why the GPU is not at its verified idle state (None: it is). Each run starts from there."""
    if used_mib is None:
        return "the GPU cannot be read"
    if listed_pids:
        return f"NVML lists process(es) {', '.join(map(str, sorted(listed_pids)))}"
    if used_mib > idle_mib + threshold:
        return f"{used_mib:g} MiB used, idle is {idle_mib:g} MiB"
    return None


def finish(run: Run, threshold: int = THRESHOLD_MIB) -> Run:
    """Fill in truth_clean and the judgement from the run's verdict and truth."""
    run.truth_clean = truth_clean(run.truth, run.keep_mib, threshold) if run.truth else None
    run.judgement = judge(run.verdict, run.truth_clean)
    return run


# -- output -------------------------------------------------------------------------------------------


def to_json(meta: dict, runs: list[Run]) -> str:
    return dumps({"meta": meta, "runs": [asdict(r) for r in runs]})


def from_json(text: str) -> tuple[dict, list[Run]]:
    data = json.loads(text)
    runs = []
    for r in data["runs"]:
        t = r.pop("truth")
        runs.append(Run(**r, truth=Truth(**t) if t else None))
    return data["meta"], runs


def _cell(r: Run) -> str:
    wall = "–" if r.wall_s is None else f"{r.wall_s:.2f} s"
    mark = "" if r.judgement == "right" else f" **{r.judgement}**"
    hurt = f", hurt {len(r.collateral)}" if r.collateral else ""
    return f"{wall} {r.verdict}{mark}{hurt}"


def _median_wall(runs: list[Run]) -> float | None:
    ws = [r.wall_s for r in runs if r.wall_s is not None and r.verdict in ("clean", "not clean")]
    return statistics.median(ws) if ws else None


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b <= 0 else f"{a / b:.1f}×"


def over(a: float | None, b: float | None) -> str:
    """How much longer ``a`` took than ``b`` (pvegpu over the floor), in seconds."""
    return "–" if a is None or b is None else f"{a - b:+.2f} s"


def summary_table(runs: list[Run], titles: dict[str, str] | None = None) -> str:
    """One row per scenario: each method's wall time to verdict, its verdict (and whether it was wrong),
    processes outside the target it hurt, and how many times slower than pvegpu the others were."""
    titles = titles or {s.key: s.title for s in SCENARIOS}
    keys = list(dict.fromkeys(r.scenario for r in runs))
    head = "| scenario | " + " | ".join(METHODS) + " | manual ÷ pvegpu | restart ÷ pvegpu | pvegpu − floor |"
    lines = [head, "|" + "---|" * (len(METHODS) + 4)]
    for k in keys:
        by = {m: [r for r in runs if r.scenario == k and r.method == m] for m in METHODS}
        cells = [" / ".join(_cell(r) for r in by[m]) or "–" for m in METHODS]
        med = {m: _median_wall(by[m]) for m in METHODS}
        lines.append(f"| {titles.get(k, k)} | " + " | ".join(cells)
                     + f" | {ratio(med['manual'], med['pvegpu'])} | {ratio(med['restart'], med['pvegpu'])} | {over(med['pvegpu'], med['floor'])} |")
    return "\n".join(lines)


def detail_table(runs: list[Run]) -> str:
    """Every run: verdict with its evidence, the truth one second later, the judgement, collateral."""
    lines = ["| scenario | method | wall | verdict | target MiB before | truth 1 s later: used / others' | listed PIDs (owner) | target holders | judgement | hurt outside |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        t = r.truth
        used = "unknown" if t is None or t.used_mib is None else f"{t.used_mib:.0f}"
        listed = "–" if t is None or not t.listed else ", ".join(f"{p['pid']} ({p['owner']})" for p in t.listed)
        holders = "–" if t is None or not t.target_holders else ", ".join(map(str, t.target_holders))
        hurt = ", ".join(f"{h['pid']} {h['comm']} ({h['owner']})" for h in r.collateral) or "none"
        wall = "–" if r.wall_s is None else f"{r.wall_s:.3f} s"
        lines.append(f"| {r.scenario} | {r.method} | {wall} | {r.verdict}: {r.detail} | {r.allocated_mib:.0f} | {used} / {r.keep_mib:.0f} "
                     f"| {listed} | {holders} | {r.judgement} | {hurt} |")
    return "\n".join(lines)


def pvegpu_phases(stdout: str, t0: float, wall: float) -> dict:
    """Where a ``pvegpu reset --json`` process spent its wall time: start-up and exit (interpreter, imports,
    settings, NVML init, teardown: wall minus the reset's own elapsed), the reset itself, and the first signal
    (``signalled[].t`` is CLOCK_MONOTONIC, shared with the harness, which started the process at t0)."""
    try:
        rep = json.loads(stdout)
    except ValueError:
        return {}
    out: dict = {}
    elapsed = rep.get("elapsed_s")
    if isinstance(elapsed, (int, float)):
        out["reset_s"] = round(elapsed, 3)
        out["startup_s"] = round(wall - elapsed, 3)
    ts = [s["t"] for s in rep.get("signalled", []) if isinstance(s.get("t"), (int, float))]
    if ts:
        out["first_signal_s"] = round(min(ts) - t0, 3)
    for st in rep.get("steps", []):
        if st.get("name") == "verify" and "seconds" in st:
            out["memory_back_s"] = st["seconds"]
            held = re.search(r"held for ([0-9.]+) s", str(st.get("msg", "")))
            if held:
                out["settle_s"] = float(held.group(1))
    return out

