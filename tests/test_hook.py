"""The guard hookscript run exactly as PVE runs it (argv, PATH, LC_ALL=C, stdin closed) on the simulated node."""

from __future__ import annotations

import os

import pytest

from pvegpu.core.model import Guest
from pvegpu.sim.pve import SimPve
from tests import pvelike

GPU = {"minor": 0, "index": 0}


def scenario(**ct):
    base = {"vmid": 129, "status": "stopped", "gpus": [0]}
    return {"node": "pve-sim", "gpus": [dict(GPU, **ct.pop("gpu", {}))],
            "containers": [base | ct, {"vmid": 131, "status": "running", "gpus": [0], "workloads": ct.pop("other", [])}]}


@pytest.fixture
def guard(tmp_path):
    return pvelike.guard(str(tmp_path), pvelike.launcher(str(tmp_path)))


def hook(node, guard, phase="pre-start", vmid=129, **env):
    return pvelike.run_as_pve(guard, vmid, phase, {"PVEGPU_SIMULATE": node.root} | env)


def test_clean_start_allowed(sim_node, guard):
    """A clean GPU: pre-start exits 0 and says so."""
    node = sim_node(scenario())
    r = hook(node, guard)
    assert r.returncode == 0 and "may start" in r.stdout


@pytest.mark.parametrize("phase", ["post-start", "pre-stop"])
def test_other_phases_exit_zero_at_once(sim_node, guard, phase):
    """Phases other than pre-start/post-stop do nothing and exit 0."""
    node = sim_node(scenario(gpu={"fail": "GPU is lost"}))
    assert hook(node, guard, phase).returncode == 0


def test_leftover_refused_with_reason(sim_node, guard):
    """Memory no running container accounts for: refusal text on stderr, exit 10."""
    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    r = hook(node, guard)
    assert r.returncode == 10
    assert "refusing to start CT 129" in r.stderr and "2048 MiB" in r.stderr and "pvegpu reset 129" in r.stderr


def test_shared_with_running_container_allowed(sim_node, guard):
    """Memory of another running CT on the same GPU is legitimate sharing: allowed."""
    node = sim_node(scenario(other=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    r = hook(node, guard)
    assert r.returncode == 0 and "shared with CT 131" in r.stdout


def test_exclusive_policy_refuses_sharing(sim_node, guard, tmp_path):
    """Under the exclusive policy (setting or PVE tag) the same sharing is refused."""
    node = sim_node(scenario(other=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    cfg = tmp_path / "x.toml"
    cfg.write_text("[gate]\nexclusive = [129]\n")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    r = hook(node, guard, PVEGPU_CONFIG=str(cfg))
    assert r.returncode == 10 and "exclusive" in r.stderr


def test_nvml_failure_fails_closed_and_open_when_configured(sim_node, guard):
    """An unreadable GPU refuses the start; gate.on_unknown=allow lets it through, saying so."""
    node = sim_node(scenario(gpu={"fail": "GPU is lost"}))
    r = hook(node, guard)
    assert r.returncode == 10 and "cannot be read" in r.stderr
    r = hook(node, guard, PVEGPU_GATE_ON_UNKNOWN="allow")
    assert r.returncode == 0 and "allowed" in r.stdout


def test_deadline_exceeded_refuses(sim_node, guard):
    """A GPU read that hangs past the deadline refuses the start with a message, in bounded time."""
    import time

    node = sim_node(scenario(gpu={"hang": 20}))
    t = time.monotonic()
    r = hook(node, guard, PVEGPU_GATE_DEADLINE="0.5")
    assert r.returncode == 10 and "did not finish within 0.5 s" in r.stderr
    assert time.monotonic() - t < 5  # PVE gets its answer (and EOF) long before the hung read ends


def test_bad_phase_and_vmid_are_clear_errors(sim_node, guard):
    """An unknown phase or a bad vmid is a one-line error with a hint (exit 2), never a traceback."""
    node = sim_node(scenario())
    r = hook(node, guard, phase="pre-migrate")
    assert r.returncode == 2 and "unknown hook phase" in r.stderr and "Traceback" not in r.stderr
    r = pvelike.run_as_pve(guard, "12x", "pre-start", {"PVEGPU_SIMULATE": node.root})  # type: ignore[arg-type]
    assert r.returncode == 2 and "not a container id" in r.stderr


def test_fork_leftover_refused_then_allowed_after_reset_via_sim_start(sim_node, tmp_path):
    """A start through the (simulated) API runs the guard: refused while an orphaned child holds memory
    in a stopped-looking CT, and the start task fails with PVE's hookscript wording."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "hookscript": "local:snippets/pvegpu-guard",
         "workloads": [{"kind": "orphan", "gpu": 0, "mib": 1024}]}]})
    guard_path = pvelike.guard(node.state.snippets, pvelike.launcher(str(tmp_path)))
    assert os.path.basename(guard_path) == "pvegpu-guard"
    pve = SimPve(node.state, node.node)
    g = Guest(129, "pve-sim", "lxc")
    # the container "stopped" without its orphan: mark it stopped but leave the holder alive
    ct = node.state.ct(129)
    node.state.set_ct(129, ct | {"status": "stopped"})
    upid = pve.ct_start(g)
    st = pve.task_status("pve-sim", upid)
    assert st["exitstatus"].startswith("hookscript error for 129 on pre-start") and "exit code 10" in st["exitstatus"]
    assert any("refusing to start CT 129" in line for line in pve.task_log("pve-sim", upid))


def test_internal_crash_fails_closed(sim_node, guard):
    """An unexpected error inside the check refuses the start (fail closed) with a one-line reason."""
    import json as _json

    node = sim_node(scenario())
    gpus = _json.load(open(os.path.join(node.root, "gpus.json")))
    gpus[0]["stand_in"] = "/nonexistent/device"  # the host adapter cannot stat its device any more
    _json.dump(gpus, open(os.path.join(node.root, "gpus.json"), "w"))
    r = hook(node, guard)
    assert r.returncode == 10 and "internal error" in r.stderr and "Traceback" not in r.stderr


def test_allow_once_overrides_one_start_only(sim_node, guard, tmp_path):
    """`pvegpu hook allow-once` lets exactly the next pre-start through, logging what it overrode."""
    import subprocess
    import sys

    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    env = {"PVEGPU_GATE_OVERRIDE_DIR": str(tmp_path / "once")}
    r = subprocess.run([sys.executable, "-m", "pvegpu", "hook", "allow-once", "129"], capture_output=True, text=True,
                       env=dict(os.environ, PVEGPU_SIMULATE=node.root, **env), cwd=pvelike.REPO)
    assert r.returncode == 0, r.stderr
    first = hook(node, guard, **env)
    assert first.returncode == 0 and "allowed to start ONCE" in first.stdout and "2048 MiB" in first.stdout
    assert hook(node, guard, **env).returncode == 10


def test_exclusive_by_pve_tag(sim_node, guard):
    """The PVE tag gpu-exclusive on the container has the same effect as the exclusive setting."""
    node = sim_node(scenario(config="arch: amd64\ndev0: /dev/nvidia0,gid=44\ntags: ml;gpu-exclusive\n",
                             other=[{"kind": "simple", "gpu": 0, "mib": 512}]))
    r = hook(node, guard)
    assert r.returncode == 10 and "exclusive" in r.stderr


def test_post_stop_logs_and_optionally_reclaims(sim_node, guard):
    """post-stop never fails the stop: it reports leftovers, and with gate.post_stop_reclaim it stops the
    container's stray holders (here an orphaned child left in the container's session)."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "orphan", "gpu": 0, "mib": 1024}]}]})
    r = hook(node, guard, phase="post-stop")
    assert r.returncode == 0 and "NOT clean" in r.stdout
    r = hook(node, guard, phase="post-stop", PVEGPU_GATE_POST_STOP_RECLAIM="true")
    assert r.returncode == 0 and "post-stop reclaim: clean" in r.stdout
    from pvegpu.sim.nvml import SimNvml

    assert SimNvml(node.state).sample([0])[0].used_bytes == 0  # the orphan's 1 GiB is back


def test_only_granted_gpus_count(sim_node, guard):
    """A lost GPU the container is not granted does not refuse its start; a lost granted one does (fail
    closed), and gate.on_unknown = allow lets that through too."""
    gpus = [GPU, {"minor": 1, "index": 1, "lost": True}]
    node = sim_node({"node": "pve-sim", "gpus": gpus, "containers": [
        {"vmid": 129, "status": "stopped", "gpus": [0]}, {"vmid": 130, "status": "stopped", "gpus": [1]}]})
    r = hook(node, guard)
    assert r.returncode == 0 and "may start" in r.stdout, r.stderr
    r = hook(node, guard, vmid=130)
    assert r.returncode == 10 and "GPU is lost" in r.stderr
    r = hook(node, guard, vmid=130, PVEGPU_GATE_ON_UNKNOWN="allow")
    assert r.returncode == 0 and "allowed" in r.stdout


def test_exclusive_neighbour_refuses_a_sharer(sim_node, guard):
    """Exclusivity holds both ways: a running exclusive container on the GPU refuses another's start."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "stopped", "gpus": [0]},
        {"vmid": 131, "status": "running", "gpus": [0], "config": "arch: amd64\ndev0: /dev/nvidia0,gid=44\ntags: gpu-exclusive\n",
         "workloads": [{"kind": "simple", "gpu": 0, "mib": 512}]}]})
    r = hook(node, guard)
    assert r.returncode == 10 and "CT 131, which is exclusive" in r.stderr, r.stdout + r.stderr


def test_gate_says_reset_in_progress(sim_node, guard, tmp_path):
    """While a pvegpu reset holds the container's lock, the gate refuses with that reason instead of judging."""
    from pvegpu.adapters.locks import ct_lock

    node = sim_node(scenario())
    with ct_lock(str(tmp_path / "lock"), 129, wait=0):
        r = hook(node, guard, PVEGPU_RESET_LOCK_DIR=str(tmp_path / "lock"))
    assert r.returncode == 10 and "reset of CT 129 is in progress" in r.stderr
    assert hook(node, guard, PVEGPU_RESET_LOCK_DIR=str(tmp_path / "lock")).returncode == 0


def test_allow_once_refuses_an_unknown_container(sim_node, tmp_path):
    """allow-once for a guest that does not exist (or is a VM) writes nothing and exits 3."""
    import subprocess
    import sys

    node = sim_node(scenario())
    env = dict(os.environ, PVEGPU_SIMULATE=node.root, PVEGPU_GATE_OVERRIDE_DIR=str(tmp_path / "once"))
    r = subprocess.run([sys.executable, "-m", "pvegpu", "hook", "allow-once", "555"], capture_output=True, text=True, env=env, cwd=pvelike.REPO)
    assert r.returncode == 3 and "no guest 555" in r.stderr
    assert not (tmp_path / "once" / "555").exists()


def test_incomplete_override_token_is_not_honoured(sim_node, guard, tmp_path):
    """An empty token (a failed write) does not let a start through."""
    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    (tmp_path / "once").mkdir()
    (tmp_path / "once" / "129").write_text("")
    assert hook(node, guard, PVEGPU_GATE_OVERRIDE_DIR=str(tmp_path / "once")).returncode == 10


def test_neighbours_fork_child_is_sharing_not_leftover(sim_node, guard):
    """A neighbour's fork-after-init child (NVML lists only its dead parent) holds memory on the shared GPU:
    the gate allows a shared start and names the neighbour; a reset of the target is clean at once."""
    import subprocess
    import sys

    zero = dict(GPU, mappable=True)  # a stand-in that can be mapped, as CUDA maps /dev/nvidiaN
    node = sim_node({"node": "pve-sim", "gpus": [zero], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 512}]},
        {"vmid": 131, "status": "running", "gpus": [0], "workloads": [{"kind": "orphan", "gpu": 0, "mib": 1024}]}]})
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "129", "--json", "--timeout", "5"],
                       capture_output=True, text=True, cwd=pvelike.REPO, timeout=60)
    import json as _json

    rep = _json.loads(r.stdout)
    assert r.returncode == 0 and rep["outcome"] == "clean", r.stdout[-2000:]
    assert rep["elapsed_s"] < 5
    ct = node.state.ct(129)
    node.state.set_ct(129, ct | {"status": "stopped"})
    r = hook(node, guard)
    assert r.returncode == 0 and "shared with CT 131" in r.stdout, r.stdout + r.stderr


def test_check_of_a_running_container_says_it_is_running(sim_node):
    """`pvegpu check` on a running CT is no refusal: exit 0, it says the CT runs (naming its init), not a reset loop."""
    import subprocess
    import sys

    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [{"vmid": 129, "status": "running", "gpus": [0], "workloads": []}]})
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", "129"], capture_output=True, text=True,
                       cwd=pvelike.REPO, timeout=60)
    assert r.returncode == 0 and "CT 129 is running (its init is pid" in r.stdout, r.stdout + r.stderr
    assert "still sit in" not in r.stdout + r.stderr
    wide = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", "129", "-v"], capture_output=True,
                          text=True, cwd=pvelike.REPO, timeout=60)
    assert wide.returncode == 0 and wide.stdout.startswith("pvegpu: CT 129 is running") and len(wide.stdout.splitlines()) == 1


def test_running_containers_own_memory_is_never_leftover(sim_node, guard):
    """A running CT holding memory on a GPU it shares: check says it runs and what it holds (exit 0, state running),
    never leftover, never a GPU reset (`pvegpu gpu-reset`) that would end the neighbour's work; a pre-start called for it
    anyway refuses (exit 10) with that same account, no fix."""
    import json
    import subprocess
    import sys

    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 3686}]},
        {"vmid": 131, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024}]}]})
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", "129", "--json"], capture_output=True,
                       text=True, cwd=pvelike.REPO, timeout=60)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["running"] is True and [g["state"] for g in doc["gpus"]] == ["running"], r.stdout + r.stderr
    assert doc["fix"] == [] and not any("gpu-reset" in t for t in doc["reasons"])
    pre = hook(node, guard)
    assert pre.returncode == 10 and "gpu-reset" not in pre.stdout + pre.stderr and "fix:" not in pre.stderr


def test_check_says_an_allow_once_token_is_waiting(sim_node, tmp_path):
    """check refuses as the hook would, and says that a pending allow-once token will let the next start through."""
    import subprocess
    import sys

    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    env = dict(os.environ, PVEGPU_SIMULATE=node.root, PVEGPU_GATE_OVERRIDE_DIR=str(tmp_path / "once"))
    base = [sys.executable, "-m", "pvegpu"]
    assert subprocess.run(base + ["hook", "allow-once", "129"], env=env, cwd=pvelike.REPO, capture_output=True).returncode == 0
    r = subprocess.run(base + ["check", "129"], env=env, cwd=pvelike.REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 10 and "allow-once token is waiting" in r.stdout + r.stderr
    assert (tmp_path / "once" / "129").exists()  # check did not consume it


# -- the reset lock: pvegpu's own restart passes it; another reset's lock, or one a user planted, does not decide ---

def _lock_dir(node) -> str:
    return os.path.join(node.root, "lock")  # a simulated node keeps its reset locks in its own directory


def test_own_restart_marker_passes_lock_only_while_fresh(sim_node, guard):
    """A reset's lock refuses the start; the same lock marked 'starting' by its holder lets it through (saying so);
    cleared or expired, it refuses again."""
    import time

    from pvegpu.adapters.locks import ct_lock

    node = sim_node(scenario())
    with ct_lock(_lock_dir(node), 129, 0) as lock:
        r = hook(node, guard)
        assert r.returncode == 10 and "reset of CT 129 is in progress" in r.stderr
        lock.starting(30)
        r = hook(node, guard)
        assert r.returncode == 0 and f"restart of pvegpu reset (pid {os.getpid()})" in r.stdout, r.stdout + r.stderr
        lock.started()
        assert hook(node, guard).returncode == 10
        lock.starting(0)
        time.sleep(0.05)
        assert hook(node, guard).returncode == 10
    assert hook(node, guard).returncode == 0


def test_own_restart_marker_still_judges_gpu(sim_node, guard):
    """The reset's own start passes the lock, not the GPU check: leftover memory still refuses it."""
    from pvegpu.adapters.locks import ct_lock

    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    with ct_lock(_lock_dir(node), 129, 0) as lock:
        lock.starting(30)
        r = hook(node, guard)
    assert r.returncode == 10 and "no running container accounts for" in r.stderr and "in progress" not in r.stderr, r.stderr


def test_marker_naming_another_process_refused(sim_node, guard):
    """A 'starting' marker whose holder is not the live process that holds the lock (pid 1's identity forged) refuses."""
    from pvegpu.adapters.locks import ct_lock

    node = sim_node(scenario())
    with ct_lock(_lock_dir(node), 129, 0) as lock:
        lock.starting(30)
        os.pwrite(lock.fd, b"holder=1:1\nstart-until=" + lock.fields["start-until"].encode() + b"\n", 0)
        r = hook(node, guard)
    assert r.returncode == 10 and "in progress" in r.stderr


NOBODY = 65534
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another uid)")


@pytest.fixture
def shared_tmp():
    """A directory every user may traverse (pytest's own tmp is root-only), removed afterwards."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="pvegpu-lockattack-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(code: str):
    """Run ``code`` as uid/gid 65534 (an unprivileged local user); it prints 'ready' once set up."""
    import shutil
    import subprocess
    import sys

    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # pvegpu's venv may be root-only; stdlib is enough
    p = subprocess.Popen([python, "-I", "-c", code], user=NOBODY, group=NOBODY, extra_groups=[], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd="/")
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.stderr else "")
    return p


PLANT = """
import fcntl, os, sys, time
d = sys.argv[1] if len(sys.argv) > 1 else {d!r}
os.makedirs(d, mode=0o700, exist_ok=True)
fd = os.open(os.path.join(d, '129.lock'), os.O_RDWR | os.O_CREAT, 0o666)
os.write(fd, b'holder=1:1\\nstart-until=99999999\\n')
fcntl.flock(fd, fcntl.LOCK_EX)
print('ready', flush=True)
time.sleep(60)
"""


def _reset(node, lock_dir: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "reset", "129", "--json", "--no-restart",
                           "--timeout", "0.5", "--settle", "0.1"], cwd=pvelike.REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ) | {"PVEGPU_RESET_LOCK_DIR": lock_dir})


@pytest.mark.root
@root
def test_user_planted_lock_dir_in_world_writable_place(sim_node, guard, shared_tmp):
    """A local user pre-creates the lock directory in a sticky world-writable directory (/run/lock's case) and holds
    CT 129's lock: reset refuses that directory with the fix (exit 2, not 9), and the gate is not blocked."""
    sticky = os.path.join(shared_tmp, "lock")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    planted = os.path.join(sticky, "pvegpu")
    attacker = _as_nobody(PLANT.format(d=planted))
    try:
        node = sim_node(scenario())
        r = _reset(node, planted)
        assert r.returncode == 2 and "owned by uid 65534" in r.stderr and "chmod 700" in r.stderr, r.stdout + r.stderr
        g = hook(node, guard, PVEGPU_RESET_LOCK_DIR=planted)
        assert g.returncode == 0, g.stdout + g.stderr
        mine = os.path.join(sticky, "mine")  # root's own directory there: the parent is still writable by others
        r = _reset(node, mine)
        assert r.returncode == 2 and "writable by group or others" in r.stderr, r.stderr
    finally:
        attacker.kill()
        attacker.wait()


@pytest.mark.root
@root
def test_user_cannot_touch_locks_in_pvegpu_dir(sim_node, shared_tmp):
    """The default layout (a root-only directory pvegpu creates with mode 700): an unprivileged user can neither
    open, hold, list nor delete a running reset's lock."""
    from pvegpu.adapters.locks import ct_lock

    run = os.path.join(shared_tmp, "run")
    os.mkdir(run, 0o755)
    lock_dir = os.path.join(run, "pvegpu", "locks")
    with ct_lock(lock_dir, 129, 0):
        assert os.stat(lock_dir).st_mode & 0o777 == 0o700 and os.stat(os.path.dirname(lock_dir)).st_mode & 0o777 == 0o700
        code = f"""
import os
path = {os.path.join(lock_dir, '129.lock')!r}
out = []
for what, fn in (('open', lambda: os.open(path, os.O_RDONLY)), ('unlink', lambda: os.unlink(path)),
                 ('list', lambda: os.listdir({lock_dir!r})), ('mkdir', lambda: os.mkdir({os.path.join(run, 'pvegpu', 'x')!r}))):
    try:
        fn()
        out.append(what + ':done')
    except PermissionError:
        out.append(what + ':denied')
print('ready', flush=True)
print(' '.join(out), flush=True)
"""
        p = _as_nobody(code)
        assert p.stdout is not None
        assert p.stdout.readline().split() == ["open:denied", "unlink:denied", "list:denied", "mkdir:denied"]
        p.wait()
        assert os.path.exists(os.path.join(lock_dir, "129.lock"))


@pytest.mark.root
@root
def test_lock_dir_of_another_user_refused(sim_node, guard, shared_tmp):
    """A lock directory owned by another uid (or open to others) is refused with the fix; its lock never blocks the gate."""
    d = os.path.join(shared_tmp, "locks")
    os.mkdir(d, 0o700)
    os.chown(d, NOBODY, NOBODY)
    attacker = _as_nobody(PLANT.format(d=d))
    try:
        node = sim_node(scenario())
        r = _reset(node, d)
        assert r.returncode == 2 and "owned by uid 65534" in r.stderr, r.stderr
        assert hook(node, guard, PVEGPU_RESET_LOCK_DIR=d).returncode == 0
    finally:
        attacker.kill()
        attacker.wait()
    os.chown(d, 0, 0)
    os.chmod(d, 0o755)
    r = _reset(node, d)
    assert r.returncode == 2 and "has mode 755, not 700" in r.stderr, r.stderr


def _allow_once(node, env):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pvegpu", "hook", "allow-once", "129"], capture_output=True, text=True,
                       env=dict(os.environ, PVEGPU_SIMULATE=node.root, **env), cwd=pvelike.REPO)
    assert r.returncode == 0, r.stderr


def test_allow_once_survives_clock_stepped_back(sim_node, guard, tmp_path):
    """The wall clock stepped back an hour after `allow-once` (the token looks written in the future): the token is
    still honoured (its age is on the boot clock), not dropped without a word."""
    import time

    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    env = {"PVEGPU_GATE_OVERRIDE_DIR": str(tmp_path / "once")}
    _allow_once(node, env)
    path = tmp_path / "once" / "129"
    words = path.read_text().split()
    words[1] = str(int(time.time()) + 3600)
    path.write_text(" ".join(words) + "\n")
    os.utime(path, (time.time() + 3600, time.time() + 3600))
    r = hook(node, guard, **env)
    assert r.returncode == 0 and "allowed to start ONCE" in r.stdout, r.stdout + r.stderr


def test_stale_allow_once_token_is_said(sim_node, guard, tmp_path):
    """A token older than gate.override_ttl is removed and the task log says so (the start is judged as usual)."""
    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    env = {"PVEGPU_GATE_OVERRIDE_DIR": str(tmp_path / "once"), "PVEGPU_GATE_OVERRIDE_TTL": "60"}
    _allow_once(node, env)
    path = tmp_path / "once" / "129"
    text = path.read_text()
    up = float(text.split("up=")[1].split()[0])
    path.write_text(text.replace(f"up={text.split('up=')[1].split()[0]}", f"up={up - 600:.3f}"))
    r = hook(node, guard, **env)
    assert r.returncode == 10 and "allow-once token for CT 129 was not used" in r.stdout and "old" in r.stdout, r.stdout
    assert not path.exists()


@pytest.mark.root
@root
def test_allow_once_dir_of_another_user_not_trusted(sim_node, guard, shared_tmp):
    """A token directory owned by another uid: `allow-once` refuses it (exit 2, the fix), and a token planted there
    is not honoured, and said."""
    d = os.path.join(shared_tmp, "once")
    os.mkdir(d, 0o700)
    with open(os.path.join(d, "129"), "w") as f:
        f.write("pvegpu-allow-once 0 uid=0\n")
    os.chown(d, NOBODY, NOBODY)
    node = sim_node(scenario(gpu={"leak_mib": 2048}))
    r = hook(node, guard, PVEGPU_GATE_OVERRIDE_DIR=d)
    assert r.returncode == 10 and "not trusted" in r.stdout and "owned by uid 65534" in r.stdout, r.stdout + r.stderr
    import subprocess
    import sys

    r2 = subprocess.run([sys.executable, "-m", "pvegpu", "hook", "allow-once", "129"], capture_output=True, text=True,
                        env=dict(os.environ, PVEGPU_SIMULATE=node.root, PVEGPU_GATE_OVERRIDE_DIR=d), cwd=pvelike.REPO)
    assert r2.returncode == 2 and "allow-once token directory" in r2.stderr and "owned by uid 65534" in r2.stderr, r2.stderr


@pytest.mark.parametrize("phase,code", [("pre-start", 10), ("post-start", 0), ("pre-stop", 0), ("post-stop", 0)])
def test_a_gate_that_cannot_import_nvidia_ml_py_fails_closed_with_the_gates_code(tmp_path, phase, code):
    """The guard's fast path with nvidia-ml-py's directory gone from its import path (the venv rebuilt elsewhere, the
    package removed, while pvegpu's checkout stays): pre-start refuses with the gate's code and says why, every other
    phase exits 0; never a traceback and exit 1 for every phase."""
    import re

    from pvegpu.cli.install import guard_text, template

    root = pvelike.etc_pve(str(tmp_path / "pve"), "n1", {129: "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"})
    text = guard_text(template(), str(tmp_path / "no-such-pvegpu"))  # only the fast path can answer
    text = re.sub(r"(?m)^PVEGPU_PYTHONPATH=.*$", f"PVEGPU_PYTHONPATH={pvelike.REPO}", text)  # pvegpu's directory alone
    g = tmp_path / "guard"
    g.write_text(text)
    g.chmod(0o755)
    lock = tmp_path / "lock"
    lock.mkdir(mode=0o700)
    r = pvelike.run_as_pve(str(g), 129, phase, {"PVEGPU_PVE_ROOT": root, "PVEGPU_RESET_LOCK_DIR": str(lock)})
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
    if code:
        assert "refusing to start CT 129" in r.stderr and "nvidia-ml-py" in r.stderr, r.stderr


def test_check_of_a_running_container_whose_gpu_cannot_be_read_is_unknown_not_clean(sim_node):
    """`pvegpu check` of a running CT whose GPU NVML cannot read: it says the CT runs and that the GPU cannot be read,
    and exits 5 (unknown), never 0: a script's `check 129 && ...` must not read an unreadable GPU as fine."""
    import json
    import subprocess
    import sys

    node = sim_node({"node": "pve-sim", "gpus": [dict(GPU, fail="GPU is lost")], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024}]}]})
    line = [sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", "129"]
    r = subprocess.run(line, capture_output=True, text=True, cwd=pvelike.REPO, timeout=60)
    assert r.returncode == 5 and "is running" in r.stdout and "cannot be read" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*line, "--json"], capture_output=True, text=True, cwd=pvelike.REPO, timeout=60)
    doc = json.loads(r.stdout)
    assert r.returncode == 5 and doc["running"] is True and [g["state"] for g in doc["gpus"]] == ["unknown"]
