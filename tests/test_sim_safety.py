"""The simulated node is no attack path and works under any umask: `sim create` makes its own 0700 directory and
writes through its descriptor (a planted link redirects nothing), `--simulate DIR` takes only a node the caller owns
alone, a reset or stop signals only the node's own sessions, a failed `sim create` removes what it made, and the
leak scenario (in `sim create` and `demo`) concludes in seconds."""

from __future__ import annotations

import functools
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from pvegpu import wiring
from pvegpu.core.errors import PveApiError, UsageError
from pvegpu.core.model import MIB, Guest
from pvegpu.sim import lifecycle, pve
from pvegpu.sim import scenario as sc
from pvegpu.sim.state import SimState
from pvegpu.sim.workload import start_ticks
from tests.pvelike import REPO

IDLE = {"node": "s", "gpus": [{"minor": 0, "index": 0}], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]}

VICTIM = """
import os, signal, sys
stand_in, marker = sys.argv[1], sys.argv[2]
child = os.fork()
if child == 0:
    fd = os.open(stand_in, os.O_RDONLY)  # holds the node's GPU, as a container's job would
    signal.signal(signal.SIGTERM, lambda *a: open(marker, "a").write("TERM\\n"))
    print(os.getpid(), flush=True)
    while True:
        signal.pause()
os.waitpid(child, 0)
"""


def _pvegpu(*args, env=None, timeout=90, umask=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=clean | (env or {}), preexec_fn=None if umask is None else (lambda: os.umask(umask)))


@pytest.fixture
def made(tmp_path):
    """`pvegpu sim create` of a scenario into tmp_path/node-N (under ``umask`` if given); removed afterwards."""
    made = []

    def create(scenario="demo", umask=None):
        root = str(tmp_path / f"node-{len(made)}")
        r = _pvegpu("sim", "create", root, "--scenario", scenario, umask=umask)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        made.append(root)
        return root

    yield create
    for root in made:
        if os.path.isfile(os.path.join(root, "scenario.json")):
            try:
                sc.SimNode(root).teardown()
            except UsageError:
                pass  # a test left it unusable on purpose; its own cleanup stopped its processes


@pytest.fixture
def victim(tmp_path):
    """A process outside any simulated node (its own session) holding a node's stand-in, that notes every SIGTERM."""
    procs = []

    def start(stand_in):
        marker = tmp_path / f"victim-{len(procs)}.signals"
        leader = subprocess.Popen([sys.executable, "-c", VICTIM, stand_in, str(marker)], start_new_session=True, stdout=subprocess.PIPE)
        procs.append(leader)
        child = int(leader.stdout.readline())
        return leader, child, marker

    yield start
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _name_victim_as_ct_129(root: str, leader: int, child: int) -> None:
    """Edit CT 129's state as a user can edit their own node's: its session and init are the victim's, and the
    simulated driver lists the victim's child with 512 MiB."""
    state = SimState(root)
    ct = state.ct(129)
    ct.update(status="running", sid=leader, init_pid=leader, init_start=start_ticks(leader))
    state.set_ct(129, ct)
    state.add_context(child, start_ticks(child), 0, 512 * MIB)


def test_an_edited_state_naming_another_session_gets_it_no_signal(made, victim):
    """A node's CT 129 state edited to name another session (whose child holds the node's GPU): `reset 129` sends
    that process neither SIGTERM nor SIGKILL, and `sim remove` leaves it alive too (it is no session the node started)."""
    root = made("idle")
    leader, child, marker = victim(SimState(root).gpus()[0]["stand_in"])
    _name_victim_as_ct_129(root, leader.pid, child)
    r = _pvegpu("--simulate", root, "reset", "129", "--no-restart", "--grace", "0.3", "--timeout", "1")
    assert "Traceback" not in r.stderr, r.stderr
    time.sleep(0.2)
    assert _alive(child) and not marker.exists(), r.stdout + r.stderr
    assert not [line for line in r.stdout.splitlines() if "SIG" in line and f"pid {child} " in line], r.stdout
    assert _pvegpu("sim", "remove", root).returncode == 0
    assert _alive(child) and _alive(leader.pid)


def test_the_boundary_places_only_processes_below_the_nodes_own_init(made, victim):
    """The simulated host puts a CT's own workload in the CT and a process of an edited, unproven session on the host."""
    from pvegpu.core.model import Place

    root = made("leak")
    node = sc.SimNode(root)
    _pve, _nvml, host = node.ports()
    own = host.ct_pids(129)
    assert own and all(host.describe(p).placement.vmid == 129 for p in own)
    leader, child, _marker = victim(SimState(root).gpus()[0]["stand_in"])
    state = SimState(root)
    own_ct = state.ct(129)
    state.set_ct(129, own_ct | {"sid": leader.pid, "init_pid": leader.pid, "init_start": start_ticks(leader.pid)})
    try:
        _pve, _nvml, host = node.ports()
        assert host.describe(child).placement.place is Place.HOST and child not in host.ct_pids(129)
    finally:
        state.set_ct(129, own_ct)  # the node's own init again, so its teardown stops it


@pytest.mark.root
def test_root_refuses_a_node_another_user_owns(made, victim):
    """The issue's attack: a user-owned node whose state names root's process. Root's `--simulate DIR reset 129` and
    `PVEGPU_SIMULATE=DIR check 129` end with exit 2 and an owner error; the process gets no signal."""
    root = made("idle")
    leader, child, marker = victim(SimState(root).gpus()[0]["stand_in"])
    _name_victim_as_ct_129(root, leader.pid, child)
    for d, _dirs, files in os.walk(root):
        for name in [d, *(os.path.join(d, f) for f in files)]:
            os.lchown(name, 65534, 65534)
    try:
        r = _pvegpu("--simulate", root, "reset", "129", "--grace", "0.3", "--timeout", "1")
        assert r.returncode == 2 and "owned by uid 65534" in r.stderr and "Hint:" in r.stderr, r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 2, r.stderr
        r = _pvegpu("check", "129", env={"PVEGPU_SIMULATE": root})
        assert r.returncode == 2 and "owned by uid 65534" in r.stderr, r.stdout + r.stderr
        assert _alive(child) and not marker.exists()
    finally:
        for d, _dirs, files in os.walk(root):
            for name in [d, *(os.path.join(d, f) for f in files)]:
                os.lchown(name, 0, 0)


def test_simulate_refuses_a_group_writable_node_and_a_link_to_one(made, tmp_path):
    """`--simulate DIR` of a node others may write (mode 770), or named through a symlink: exit 2, one error and a hint."""
    root = made("idle")
    link = tmp_path / "link"
    link.symlink_to(root)
    r = _pvegpu("--simulate", str(link), "audit")
    assert r.returncode == 2 and "symbolic link" in r.stderr and f"--simulate {root}" in r.stderr, r.stderr
    os.chmod(root, 0o770)
    try:
        r = _pvegpu("--simulate", root, "audit")
        assert r.returncode == 2 and "writable by group or others (mode 770)" in r.stderr and "chmod 700" in r.stderr, r.stderr
    finally:
        os.chmod(root, 0o700)


def test_sim_create_refuses_any_existing_path_even_an_empty_directory(tmp_path):
    """`sim create DIR` makes DIR itself: an existing empty directory (one another user could have made) is refused,
    exit 2, and left as it was."""
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _pvegpu("sim", "create", str(empty))
    assert r.returncode == 2 and "exists" in r.stderr and "Hint:" in r.stderr and os.listdir(empty) == [], r.stderr


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_sim_create_sets_every_mode_whatever_the_umask(made, umask):
    """Under umask 0002 (a trixie user), 0022 and 0077: the node's directories are 0700, its files 0600, the guard
    0755; `hook install` on it then succeeds (it used to stop at "snippets ... mode 775")."""
    root = made("demo", umask=umask)
    for d, dirs, files in os.walk(root):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
        for f in files:
            want = 0o755 if f == "pvegpu-guard" else 0o700 if f == "nvidia-smi" else 0o600  # the stand-in nvidia-smi: its owner's
            assert stat.S_IMODE(os.lstat(os.path.join(d, f)).st_mode) == want, (d, f)
    assert os.path.isfile(os.path.join(root, "snippets", "pvegpu-guard"))
    r = _pvegpu("--simulate", root, "hook", "install", umask=umask)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_readme_demo_runs_under_umask_0002(tmp_path):
    """`pvegpu demo` as a trixie user types it (umask 0002): exit 0, and its temporary node is gone afterwards."""
    r = _pvegpu("demo", env={"TMPDIR": str(tmp_path)}, umask=0o002, timeout=120)
    assert r.returncode == 0 and "Error" not in r.stderr, r.stdout[-2000:] + r.stderr
    assert not [d for d in os.listdir(tmp_path) if d.startswith("pvegpu-sim-")]


@pytest.mark.parametrize("plant", ["link inside the node", "node renamed, link in its place"])
def test_a_link_planted_while_the_node_is_built_redirects_no_write(tmp_path, monkeypatch, plant):
    """While `sim create` lays the node out, a link is planted (at a directory it is about to fill, or at the node's
    own name after moving it away): nothing is written where the link points; a refused build says so."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    root = tmp_path / "node"
    real = SimState.set_gpus

    def planting(self, gpus):
        if plant == "link inside the node":
            os.symlink(victim, root / "etc-pve")
        else:
            os.rename(root, tmp_path / "moved")
            os.symlink(victim, root)
        real(self, gpus)

    monkeypatch.setattr(SimState, "set_gpus", planting)
    with pytest.raises(UsageError) as exc:
        lifecycle.create(str(root), IDLE)
    assert os.listdir(victim) == ["keep"] and (victim / "keep").read_text() == "precious"
    if plant == "link inside the node":
        assert "removed" in exc.value.message and not os.path.lexists(root), exc.value.message
    else:
        assert "symbolic link" in exc.value.message and (tmp_path / "moved" / "etc-pve" / ".vmlist").is_file()


def _processes_of(root: str) -> list[int]:
    """Live processes whose command line names ``root`` (a simulated node's inits and their jobs)."""
    found = []
    for n in os.listdir("/proc"):
        try:
            with open(f"/proc/{n}/cmdline", "rb") as f:
                if root.encode() in f.read() and _alive(int(n)):
                    found.append(int(n))
        except (OSError, ValueError):
            continue
    return found


def test_a_failed_sim_create_removes_its_directory_and_processes_and_says_so(tmp_path, monkeypatch):
    """CT 129 comes up, CT 130's job hangs (its GPU stand-in is a FIFO) until the start deadline: the error says the
    directory was removed and how many processes were stopped, and neither is left."""
    fifo = tmp_path / "gpu1"
    os.mkfifo(fifo)
    scenario = {"node": "s", "gpus": [{"minor": 0, "index": 0}, {"minor": 1, "index": 1, "stand_in": str(fifo)}],
                "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "fork", "gpu": 0, "mib": 64}]},
                               {"vmid": 130, "gpus": [1], "workloads": [{"kind": "simple", "gpu": 1, "mib": 64}]}]}
    monkeypatch.setattr(sc, "start_init", functools.partial(pve.start_init, deadline=2))
    root = str(tmp_path / "node")
    with pytest.raises(PveApiError) as exc:
        lifecycle.create(root, scenario)
    msg = exc.value.message
    assert msg.startswith(f"sim create {root} failed: simulated CT 130 did not come up"), msg
    assert re.search(rf"removed {re.escape(root)} and stopped the [45] process\(es\) it had started", msg), msg
    assert not os.path.lexists(root) and not _processes_of(root)


def test_the_leak_scenario_concludes_in_seconds(made):
    """`sim create --scenario leak` then `reset 129`, and `demo --scenario leak`: exit 7 within seconds (the scenario's
    own short waits), not after a minute; demo accepts the built-in names as sim create does."""
    root = made("leak")
    t = time.monotonic()
    r = _pvegpu("--simulate", root, "reset", "129")
    assert r.returncode == 7 and time.monotonic() - t < 20, (time.monotonic() - t, r.stdout[-1500:], r.stderr)
    t = time.monotonic()
    r = _pvegpu("demo", "--scenario", "leak", timeout=120)
    assert r.returncode == 7 and "CT 129 exit 7" in r.stdout and time.monotonic() - t < 25, (time.monotonic() - t, r.stdout[-1500:], r.stderr)
    r = _pvegpu("demo", "--scenario", "idle", timeout=120)
    assert r.returncode == 0 and "nothing to reset" in r.stdout, r.stdout[-1500:] + r.stderr


def test_a_scenarios_settings_yield_to_an_option_and_a_variable(sim_node, monkeypatch):
    """A scenario's settings apply on its node; an option on the line and a PVEGPU_* variable still win."""
    for k in [k for k in os.environ if k.startswith("PVEGPU_")]:
        monkeypatch.delenv(k)
    node = sim_node(IDLE | {"settings": {"reset.timeout": 2, "reset.grace": 1}})
    opts = wiring.GlobalOptions(simulate=node.root)
    assert (wiring.settings(opts).reset.timeout, wiring.settings(opts).reset.grace) == (2, 1)
    assert wiring.settings(opts, {"reset.timeout": 7, "reset.grace": None}).reset.timeout == 7
    monkeypatch.setenv("PVEGPU_RESET_GRACE", "3")
    assert wiring.settings(opts).reset.grace == 3


def test_a_stop_and_the_teardown_end_a_job_that_leads_its_own_process_group(tmp_path):
    """A simulated stop, and the node's teardown, end every process of the container, as `lxc-stop --kill` does: also
    the orphan workload's holder, which leads a process group of its own (a shell job) below the container's init."""
    orphan = [{"kind": "orphan", "gpu": 0, "mib": 256}]
    node = sc.build({"node": "s", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": orphan},
        {"vmid": 130, "status": "running", "gpus": [0], "workloads": orphan}]}, str(tmp_path / "node"))
    try:
        end = time.monotonic() + 10  # a container is up once its contexts are; each orphan's holder registers right after
        while len(node.state.holders()) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        sids = {ct["vmid"]: ct["sid"] for ct in node.state.cts()}
        holder = {vmid: next(h["pid"] for h in node.state.holders() if os.getsid(h["pid"]) == sid) for vmid, sid in sids.items()}
        assert all(_alive(p) and os.getpgid(p) not in sids.values() for p in holder.values())
        pve.SimPve(node.state, "s").ct_stop(Guest(129, "s", "lxc"))
        assert not _alive(holder[129]) and _alive(holder[130])
    finally:
        node.teardown()
    assert not _alive(holder[130])
