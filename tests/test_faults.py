"""Fault matrix (issue 8): the real pvegpu command line against a misbehaving Proxmox.

Three sources of faults: fakepve over HTTPS with a token (its failure knobs), a stand-in ``pvesh`` on PATH
for the local backend, and the simulated node. The GPUs and processes are always the simulated node's
(tests/fault_cli.py swaps in only those two ports when the API is real). Every case asserts the exit code,
the message, that no traceback escaped, that the command ended (a generous subprocess bound: a hang guard,
not a benchmark) and, where a container is involved, its final state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from pvegpu.sim.state import SimState
from tests import pvelike, schemas, stub_pvesh
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}
UPID = "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:{}:129:root@pam:"
RESET = ["reset", "129", "--json"]


@dataclass
class Run:
    rc: int | None  # None: still running at the bound (killed)
    out: str
    err: str
    wall: float

    @property
    def report(self) -> dict:
        """The JSON document on stdout, validated against its shipped schema."""
        return schemas.validate(json.loads(self.out))


def cli(args, *, config=None, sim=None, env=None, bound=30.0, module="tests.fault_cli") -> Run:
    """Run the command line; a run past ``bound`` seconds is killed (with its group) and comes back with rc None."""
    pre = (["--config", config] if config else [])
    e = dict(os.environ) | (env or {}) | ({"FAULTCLI_SIM_ROOT": sim.root} if sim and module == "tests.fault_cli" else {})
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", module, *pre, *args], cwd=REPO, env=e, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=bound)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    wall = time.monotonic() - t0
    if os.environ.get("FAULT_MATRIX_OUT"):  # the matrix for a report: one JSON line per command run
        with open(os.environ["FAULT_MATRIX_OUT"], "a") as f:
            f.write(json.dumps({"case": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "rc": rc, "wall": round(wall, 2)}) + "\n")
    assert "Traceback" not in err + out, err
    return Run(rc, out, err, wall)


def write_config(path, **sections) -> str:
    """Settings for one test; its reset locks in its own directory (never the node's shared one)."""
    sections["reset"] = {"lock_dir": str(path.parent / "locks")} | sections.get("reset", {})
    lines = []
    for key, value in sections.pop("top", {}).items():
        lines.append(f"{key} = {json.dumps(value)}")
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    return str(path)


RESET_FAST = {"grace": 0.2, "kill_wait": 0.5, "timeout": 0.5, "settle": 0.1, "task_timeout": 3}


@pytest.fixture
def leaky(sim_node, tmp_path):
    """A simulated node where CT 129's job leaves 1 GiB behind when it dies (the driver keeps the memory of
    the target's context, no pid listed): only a restart of CT 129 can be tried.

    Its stand-in is a private pseudo-terminal (a device number no other process holds), so a concurrent test
    holding /dev/full cannot look like a holder of this GPU."""
    master, slave = pvelike.high_pty()
    path = os.ttyname(slave)
    os.close(slave)
    try:
        yield sim_node({"node": "pve1", "gpus": [GPU | {"stand_in": path}],
                        "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024, "leak": True}]}]})
    finally:
        os.close(master)


def clear_leak(sim) -> None:
    st = SimState(sim.root)
    st.set_gpus([g | {"leak_mib": 0} for g in st.gpus()])


# -- HTTPS: fakepve with an API token ---------------------------------------------------------------------------

@pytest.fixture
def https(fakepve, fakepve_cafile, leaky, tmp_path):
    """fakepve with CT 129 on pve1 and a token; config(**api) writes settings for it; the leak clears once 129 stops."""
    fakepve.apitokens["root@pam!pvegpu"] = "a1b2"
    ct = fakepve.add_ct(129, "llm129", node="pve1", status="running", config={"dev0": "/dev/nvidia0,gid=44"})
    host, port = fakepve.url.split("//")[1].split(":")
    tok = tmp_path / "token"
    tok.write_text("a1b2\n")
    tok.chmod(0o600)
    done = threading.Event()

    def watch():  # a real stop frees the GPU: the simulated leak goes when fakepve's CT stops
        while not done.wait(0.01):
            if ct.status == "stopped":
                clear_leak(leaky)
                return

    w = threading.Thread(target=watch, daemon=True)
    w.start()

    def config(reset=None, **api):
        a = dict(backend="https", host=host, port=int(port), token_name="pvegpu", token_file=str(tok), verify=fakepve_cafile, timeout=2) | api
        return write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "no-etc-pve")},
                            api=a, reset=RESET_FAST | (reset or {}))

    yield fakepve, ct, config, leaky
    done.set()
    w.join(5)


def test_https_restart_baseline(https):
    """Baseline: the leak forces a restart through fakepve; stop, verified clean, start: exit 0, CT running."""
    fake, ct, config, sim = https
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 0 and r.report["restarted"] and not r.report["left_stopped"], r.err + r.out
    assert ct.status == "running"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("api,code,text,not_hint", [
    ({"port": "FREE"}, 4, "connection to 127.0.0.1:{port} refused", "certificate"),
    ({"host": "pve.invalid"}, 4, "cannot resolve the host name of pve.invalid", "certificate"),
    ({"verify": "true"}, 4, "TLS verification of 127.0.0.1:{port} failed", "api.timeout"),
    ({"verify": "false", "fingerprint": "00" * 32}, 4, "does not match api.fingerprint", "api.timeout"),
    ({"verify": "/nonexistent/pve-root-ca.pem"}, 2, "CA file /nonexistent/pve-root-ca.pem not found", "api.timeout"),
])
def test_https_transport_faults(https, api, code, text, not_hint):
    """Refused, DNS, TLS, fingerprint, missing CA file: the cause and host:port, the matching hint only; CT untouched."""
    fake, ct, config, sim = https
    if api.get("port") == "FREE":
        api = api | {"port": _free_port()}
    r = cli(RESET, config=config(**api), sim=sim)
    port = api.get("port") or fake.port
    assert r.rc == code and text.format(port=port) in r.err and "Hint:" in r.err, r.err
    assert not_hint not in r.err.split("Hint:", 1)[1]
    assert ct.status == "running"


@pytest.mark.fakepve(time_scale=1)
def test_https_read_timeout(https):
    """The node accepts but never answers: exit 4 at api.timeout with host:port and the api.timeout hint (no TLS hint)."""
    fake, ct, config, sim = https
    fake.flaky_network(hang_rate=1.0, hang_secs=2)
    r = cli(RESET, config=config(timeout=1), sim=sim, bound=20)
    fake.flaky_network()
    assert r.rc == 4 and "did not answer within 1 s" in r.err and "api.timeout" in r.err and "certificate" not in r.err, r.err


def test_https_bad_token(https):
    """A wrong token secret: exit 4, 401 and the token hint."""
    fake, ct, config, sim = https
    fake.apitokens["root@pam!pvegpu"] = "other"
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and "401" in r.err and "api.token" in r.err


def _token(https):
    fake, ct, config, sim = https
    fake.apitokens["pvegpu@pve!t"] = "a1b2"
    return config(user="pvegpu@pve", token_name="t")


def test_https_403_names_privilege(https):
    """A token with VM.Audit only: the stop's 403 names VM.PowerMgmt on /vms/129; exit 4; the CT keeps running."""
    fake, ct, config, sim = https
    fake.grant("pvegpu@pve!t", "/vms/129", "VM.Audit")
    r = cli(RESET, config=_token(https), sim=sim)
    assert r.rc == 4 and "lacks VM.PowerMgmt on /vms/129" in r.out + r.err, r.out + r.err
    assert ct.status == "running" and not r.report["left_stopped"]


def test_https_token_without_vm_audit(https):
    """A token that cannot see CT 129: exit 4 naming VM.Audit, not "no guest 129 in this cluster" (exit 3)."""
    fake, ct, config, sim = https
    fake.grant("pvegpu@pve!t", "/nodes", "Sys.Audit")
    r = cli(RESET, config=_token(https), sim=sim)
    assert r.rc == 4 and "lacks VM.Audit on /vms/129" in r.err and "no guest 129 in this cluster" not in r.err, r.err


@pytest.mark.parametrize("method,suffix,call", [
    ("GET", "/cluster/resources", "list guests"),
    ("GET", "/nodes/pve1/lxc/129/config", "read CT 129 config"),
    ("GET", "/nodes/pve1/lxc/129/status/current", "read CT 129 status"),
    ("POST", "/nodes/pve1/lxc/129/status/stop", "stop CT 129"),
])
def test_https_data_null(https, method, suffix, call):
    """A 200 answer with data: null: exit 4 naming the call, no traceback; the CT keeps running."""
    fake, ct, config, sim = https
    fake.fail(method, suffix, status=200, message="null data")
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and f"{call}: unexpected answer" in r.out + r.err, r.out + r.err
    assert ct.status == "running"


def test_https_node_offline(https):
    """The node is offline (595): exit 4 with the node hint; nothing stopped."""
    fake, ct, config, sim = https
    fake.fail("POST", "/nodes/pve1/lxc/129/status/stop", status=595, message="No route to host")
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and "595" in r.out and "pvecm status" in r.out
    assert ct.status == "running" and not r.report["left_stopped"]


def test_https_locked(https):
    """A locked CT (backup): restart refused, exit 4, the lock named; the CT keeps running."""
    fake, ct, config, sim = https
    ct.lock = "backup"
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and "locked (backup)" in r.out and ct.status == "running"


def test_https_stop_task_fails(https):
    """The stop task ends with an error inside PVE: exit 4, the task's failure named; the CT keeps running."""
    fake, ct, config, sim = https
    fake.fail("POST", "/nodes/pve1/lxc/129/status/stop", error="did_not_stop")
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and "stop task of CT 129 failed" in r.out and ct.status == "running"
    assert not r.report["left_stopped"]


@pytest.mark.parametrize("json_out", [True, False])
def test_https_start_fails_after_stop(https, json_out):
    """Stop OK and GPU clean, then the start fails: exit 4 and the CT left stopped, said in the JSON and the human output."""
    fake, ct, config, sim = https
    ct.start_error = "startup for container '129' failed"
    r = cli(RESET if json_out else ["reset", "129"], config=config(), sim=sim)
    assert r.rc == 4 and ct.status == "stopped", r.out + r.err
    assert r.report["left_stopped"] if json_out else "CT 129 was left STOPPED" in r.out


def test_https_dry_run_off_the_node(https):
    """reset --dry-run with api.host and a token but no /etc/pve: the API is used (exit 0), not "no API configured"."""
    fake, ct, config, sim = https
    r = cli(["reset", "129", "--dry-run", "--json"], config=config(), sim=sim)
    assert r.rc == 0 and r.report["outcome"] == "dry-run", r.err


def test_https_task_status_fails_after_stop(https):
    """The stop went through but reading its task status fails: exit 4 and left_stopped (the CT is stopped)."""
    fake, ct, config, sim = https
    fake.fail("GET", "/nodes/{node}/tasks/{upid}/status", status=500, message="pvedaemon busy")
    r = cli(RESET, config=config(), sim=sim)
    assert r.rc == 4 and ct.status == "stopped" and r.report["left_stopped"], r.out


@pytest.mark.fakepve(time_scale=1)
def test_https_stop_slower_than_task_timeout(https):
    """A stop task slower than task_timeout completes after pvegpu gave up: the report says the CT is left stopped."""
    fake, ct, config, sim = https
    ct.stop_secs = 2
    r = cli(RESET, config=config(reset={"task_timeout": 1}), sim=sim, bound=30)
    assert r.rc == 4
    time.sleep(2)
    assert ct.status == "stopped" and r.report["left_stopped"], r.out


# -- the local backend: a stand-in pvesh on PATH ----------------------------------------------------------------

@pytest.fixture
def local(leaky, tmp_path):
    """config(rules, **api) installs a stand-in pvesh with rules and writes settings for the local backend."""
    bindir = tmp_path / "bin"

    def config(rules=None, reset=None, **api):
        gpus = os.path.join(leaky.root, "gpus.json")
        cleared = json.dumps([g | {"leak_mib": 0} for g in SimState(leaky.root).gpus()])
        base = {"create /nodes/pve1/lxc/129/status/stop": {"json": UPID.format("vzstop"), "write": [gpus, cleared]}}
        rules = rules or {}
        stub_pvesh.install(str(bindir), base | {k: base.get(k, {}) | v for k, v in rules.items()})
        return write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "no-etc-pve")},
                            api={"backend": "local", "timeout": 2} | api, reset=RESET_FAST | (reset or {}))

    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    return config, env, leaky, bindir


LOCALE = "perl: warning: Setting locale failed.\nperl: warning: Falling back to the standard locale (\"C\")."


def test_local_restart_baseline(local):
    """Baseline through pvesh: stop, verified clean, start: exit 0."""
    config, env, sim, _ = local
    r = cli(RESET, config=config(), sim=sim, env=env)
    assert r.rc == 0 and r.report["restarted"], r.err + r.out


def test_local_locale_warning_is_not_a_failure(local):
    """Perl's locale warning on stderr of every pvesh call (exit 0, valid JSON): the restart still succeeds."""
    config, env, sim, d = local
    rules = {k: v | {"stderr": LOCALE} for k, v in stub_pvesh.DEFAULTS.items()}
    r = cli(RESET, config=config(rules), sim=sim, env=env)
    assert r.rc == 0 and r.report["restarted"], r.err + r.out


@pytest.mark.parametrize("key,rule,text", [
    ("create /nodes/pve1/lxc/129/status/stop", {"exit": 1, "raw": ""}, "stop CT 129: 500 pvesh exited with status 1"),
    ("create /nodes/pve1/lxc/129/status/stop", {"raw": "not json"}, "stop CT 129: `pvesh create /nodes/pve1/lxc/129/status/stop` did not answer JSON"),
    ("create /nodes/pve1/lxc/129/status/stop", {"json": {"errors": ""}}, "stop CT 129: unexpected answer"),
    ("get /cluster/resources", {"raw_hex": "5b22ff225d"}, "list guests: `pvesh get /cluster/resources` wrote output that is not UTF-8"),
    ("get /nodes/pve1/lxc/129/status/current", {"raw": "null"}, "read CT 129 status: unexpected answer from pvesh"),
    ("get /nodes/pve1/lxc/129/config", {"exit": 2, "stderr": "403 Permission check failed (/vms/129, VM.Audit)"},
     "lacks VM.Audit on /vms/129"),
])
def test_local_pvesh_faults(local, key, rule, text):
    """pvesh failing silently, invalid JSON, a non-UPID task id, non-UTF-8 output, null, a 403: exit 4 naming the call."""
    config, env, sim, _ = local
    r = cli(RESET, config=config({key: rule}), sim=sim, env=env)
    assert r.rc == 4 and text in r.out + r.err, r.out + r.err


def test_local_pvesh_missing(local, tmp_path):
    """No pvesh on the PATH: exit 4 saying the local backend runs on a PVE node, not the HTTPS certificate hint."""
    config, env, sim, _ = local
    r = cli(RESET, config=config(), sim=sim, env={"PATH": str(tmp_path / "empty")})
    assert r.rc == 4 and "`pvesh` not found" in r.err and "PVE node" in r.err and "certificate" not in r.err, r.err


def test_local_hung_read_with_child_on_the_pipe(local):
    """A status read hangs and pvesh's child holds the pipe: the group is killed at the deadline, exit 4, said so."""
    config, env, sim, d = local
    rules = {"get /nodes/pve1/lxc/129/status/current": {"sleep": 300, "child": 300, "pidfile": "child.pid"}}
    r = cli(RESET, config=config(rules, timeout=0.5, reset={"task_timeout": 0.5}), sim=sim, env=env, bound=40)
    assert r.rc == 4 and "(killed with its process group)" in r.out + r.err, r.out + r.err
    pid = int((d / "child.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_local_reads_use_api_timeout(local):
    """A hung status read ends at api.timeout (1 s), not task_timeout + 10 s."""
    config, env, sim, d = local
    rules = {"get /nodes/pve1/lxc/129/status/current": {"sleep": 300}}
    r = cli(RESET, config=config(rules, timeout=1, reset={"task_timeout": 20}), sim=sim, env=env, bound=6)
    assert r.rc == 4 and "within 1 s" in r.out + r.err


# -- the simulated node -----------------------------------------------------------------------------------------

def test_sim_gpu_reads_hang(sim_node):
    """GPU reads that take 2 s each with --timeout 1: reset returns within its deadline (plus start-up), exit not 0."""
    node = sim_node({"node": "s", "gpus": [GPU | {"hang": 2}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    r = cli(["--simulate", node.root, "reset", "129", "--timeout", "1", "--grace", "0.2"], module="pvegpu", bound=5)
    assert r.rc not in (None, 0)


def test_sim_timeout_not_above_settle(sim_node, tmp_path):
    """--timeout shorter than settle is a usage error (exit 2), not a "clean" exit 0."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": []}]})
    cfg = write_config(tmp_path / "c.toml", reset={"settle": 1.0})
    r = cli(["--simulate", node.root, "reset", "129", "--timeout", "0.5"], config=cfg, module="pvegpu")
    assert r.rc == 2 and "reset.timeout" in r.err


# -- the guard installed as the container's hookscript (issue 15) -------------------------------------------------

def _guarded(sim_node, tmp_path, gpu=None, **ct):
    """A simulated node whose CT 129 runs a respawning holder (only a restart helps) with pvegpu's guard installed."""
    from tests import pvelike

    node = sim_node({"node": "pve1", "gpus": [GPU | (gpu or {})], "containers": [
        {"vmid": 129, "gpus": [0], "hookscript": "local:snippets/pvegpu-guard",
         "workloads": [{"kind": "respawn", "gpu": 0, "mib": 512}]} | ct]})
    pvelike.guard(node.state.snippets, pvelike.launcher(str(tmp_path)))
    return node


SIM_FAST = ["--grace", "0.2", "--timeout", "1", "--settle", "0.1"]


@pytest.mark.parametrize("task_timeout", [None, 86400])
def test_sim_guarded_restart_passes_own_lock(sim_node, tmp_path, task_timeout):
    """With the guard installed, the reset's own start passes its own lock (also with the longest reset.task_timeout
    the settings allow): restarted, exit 0, the CT running."""
    node = _guarded(sim_node, tmp_path)
    env = {} if task_timeout is None else {"PVEGPU_RESET_TASK_TIMEOUT": str(task_timeout)}
    r = cli(["--simulate", node.root, "reset", "129", "--json", *SIM_FAST], module="pvegpu", bound=60, env=env)
    assert r.rc == 0 and r.report["restarted"] and not r.report["left_stopped"], r.out + r.err
    assert SimState(node.root).ct(129)["status"] == "running"
    from pvegpu.sim.state import read_dir

    starts = [t for t in read_dir(os.path.join(node.root, "tasks")) if ":vzstart:" in t["upid"]]
    assert any("restart of pvegpu reset" in line for t in starts for line in t["log"]), starts  # the guard ran and said why


def test_sim_guarded_ct_not_stopped_onto_a_gpu_holding_others_leftover(sim_node, tmp_path):
    """Guarded CT 129 needs a restart, but its GPU already holds 2 GiB that were never its own: its guard would refuse
    the start, so the CT is not stopped (it stays running, no stop task), and the reset says why (not exit 0)."""
    node = _guarded(sim_node, tmp_path, gpu={"leak_mib": 2048})
    r = cli(["--simulate", node.root, "reset", "129", "--json", *SIM_FAST], module="pvegpu", bound=60)
    assert r.rc not in (0, None) and not r.report["left_stopped"] and not r.report["restarted"], r.out + r.err
    assert any(s["name"] == "restart" and s["outcome"] == "skipped" for s in r.report["steps"])
    assert SimState(node.root).ct(129)["status"] == "running"


def test_sim_start_ok_but_init_exits(sim_node, tmp_path):
    """A start task that ends OK for a CT whose init exits at once is not "restarted": exit 4, left stopped, said."""
    node = _guarded(sim_node, tmp_path, init_dies=True)
    r = cli(["--simulate", node.root, "reset", "129", "--json", *SIM_FAST], module="pvegpu", bound=60)
    assert r.rc == 4 and not r.report["restarted"] and r.report["left_stopped"] and r.report["ct_state"] == "stopped", r.out
    assert any("ended OK, but CT 129 is stopped" in d["problem"] for d in r.report["diagnosis"])
    assert SimState(node.root).ct(129)["status"] == "stopped"


# -- signals from the stop request on (local backend: the stop's pvesh call is slow) ------------------------------

def _devlog(tmp_path):
    import socket

    path = str(tmp_path / "devlog")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    return s, path


def _signalled(args, *, config, sim, env, signals, after="[restart] stopping", delay=0.3, bound=40.0) -> Run:
    """Run the command line (human output), send ``signals`` (one every ``delay`` s) once ``after`` was printed."""
    e = dict(os.environ) | env | {"FAULTCLI_SIM_ROOT": sim.root}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "tests.fault_cli", "--config", config, *args], cwd=REPO, env=e, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[str] = []

    def read():
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    def seen() -> bool:
        if after.startswith("file:"):  # a call in the stand-in pvesh's log
            path, _, text = after[5:].partition("#")
            return os.path.exists(path) and text in open(path).read()
        return any(after in ln for ln in lines)

    while not seen() and p.poll() is None and time.monotonic() - t0 < bound:
        time.sleep(0.02)
    for sig in signals:
        time.sleep(delay)
        p.send_signal(sig)
    try:
        p.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    t.join(5)
    err = p.stderr.read() if p.stderr else ""
    out = "".join(lines)
    assert "Traceback" not in out + err, err
    return Run(p.returncode, out, err, time.monotonic() - t0)


SLOW_STOP = {"create /nodes/pve1/lxc/129/status/stop": {"sleep": 1.5}}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_local_signal_after_stop_finishes_restart(local, tmp_path, sig):
    """One SIGTERM/SIGINT/SIGHUP while `pvesh create .../status/stop` runs: the restart is finished, the CT runs,
    the exit is 128+n, the output and the system log (ident pvegpu) say what happened."""
    config, env, sim, d = local
    log, path = _devlog(tmp_path)
    r = _signalled(["reset", "129"], config=config(SLOW_STOP, reset={"task_timeout": 5}), sim=sim,
                   env=env | {"FAULTCLI_DEVLOG": path}, signals=[sig])
    assert r.rc == 128 + sig, r.out + r.err
    assert f"interrupted by {sig.name}" in r.out and "finished the restart" in r.out and "finishes the restart first" in " ".join(r.err.split())
    assert (d / "state").read_text().strip() == "running"
    line = log.recv(4096).decode()
    assert "pvegpu[" in line and f"interrupted by {sig.name}" in line and "CT 129 is running" in line


def test_local_signal_after_stop_json(local, tmp_path):
    """--json: a SIGTERM during the stop gives the usual report with `interrupted` (signal, what was done, the CT's
    state) and exit 143; stdout stays one JSON document."""
    config, env, sim, d = local
    r = _signalled(RESET, config=config(SLOW_STOP, reset={"task_timeout": 5}), sim=sim, env=env, signals=[signal.SIGTERM],
                   after=f"file:{d / 'calls.log'}#status/stop")
    assert r.rc == 143, r.out + r.err
    rep = r.report
    assert rep["exit_code"] == 143 and rep["restarted"] and rep["ct_state"] == rep["guest_state"] == "running"
    assert rep["interrupted"] == {"signal": "SIGTERM", "action": "finished the restart before exiting", "ct_state": "running",
                                  "guest_state": "running", "left_stopped": False}


def test_local_repeated_sighup_of_a_dropped_session_still_finishes_the_restart(local, tmp_path):
    """Two SIGHUPs during the stop (a dropped SSH session: the shell's and the kernel's): the restart is still
    finished, exit 129, CT 129 running; only a second SIGINT or SIGTERM abandons."""
    config, env, sim, d = local
    r = _signalled(["reset", "129"], config=config(SLOW_STOP, reset={"task_timeout": 5}), sim=sim, env=env,
                   signals=[signal.SIGHUP, signal.SIGHUP])
    assert r.rc == 129 and "abandoned" not in r.out, r.out + r.err
    assert (d / "state").read_text().strip() == "running"


def test_local_second_signal_abandons_and_rerun_says_so(local, tmp_path):
    """Two SIGTERMs during the stop: abandoned, exit 143, "may be STOPPED" in the output and the log; the next
    reset says an earlier reset left CT 129 stopped (and that it is stopped now)."""
    config, env, sim, d = local
    log, path = _devlog(tmp_path)
    cfg = config(SLOW_STOP | {"create /nodes/pve1/lxc/129/status/start": {"keeps_state": True}}, reset={"task_timeout": 5})
    r = _signalled(["reset", "129"], config=cfg, sim=sim, env=env | {"FAULTCLI_DEVLOG": path},
                   signals=[signal.SIGTERM, signal.SIGTERM])
    assert r.rc == 143 and "abandoned" in r.out and "may be STOPPED" in " ".join(r.out.split()), r.out + r.err
    assert "may be STOPPED" in log.recv(4096).decode()
    r = cli(RESET, config=cfg, sim=sim, env=env)
    assert any("an earlier pvegpu reset of CT 129" in x["problem"] and "STOPPED" in x["problem"] for x in r.report["diagnosis"]), r.out


def test_signal_before_stop_says_nothing_was_stopped(local, tmp_path):
    """SIGINT while waiting for another reset's lock (before any stop): exit 130 with one line saying CT 129 was
    not stopped, the wait's progress shown; --json gets the error object."""
    from pvegpu.adapters.locks import ct_lock

    config, env, sim, d = local
    cfg = config(reset={"lock_wait": 20, "lock_dir": str(tmp_path / "locks")})
    with ct_lock(str(tmp_path / "locks"), 129, 0):
        r = _signalled(["reset", "129"], config=cfg, sim=sim, env=env, signals=[signal.SIGINT], after="[wait]", delay=0.1)
    assert r.rc == 130 and "before any stop was requested" in r.err and "waiting for the reset lock of CT 129" in r.out, r.out + r.err
    assert (d / "calls.log").exists() is False or "status/stop" not in (d / "calls.log").read_text()


# -- HA and answers about another guest (local backend) ------------------------------------------------------------

STATUS = "get /nodes/pve1/lxc/129/status/current"


def test_local_ha_error_state_said_at_once(local):
    """HA in state 'error' will not stop the CT: said at once (not after task_timeout), exit 4, the CT runs."""
    config, env, sim, d = local
    rules = {STATUS: {"ha": "error"}, "create /nodes/pve1/lxc/129/status/stop": {"keeps_state": True}}
    r = cli(RESET, config=config(rules, reset={"task_timeout": 20}), sim=sim, env=env, bound=30)
    assert r.rc == 4 and r.wall < 15 and "in state 'error'" in r.out, r.out + r.err
    assert r.report["ct_state"] == "running" and not (d / "state").exists()


def test_local_ha_transient_status_failure_retried(local):
    """One failed status read while waiting for HA: retried within the deadline; the restart completes, exit 0."""
    config, env, sim, d = local
    r = cli(RESET, config=config({STATUS: {"ha": "started", "fail_calls": [2]}}), sim=sim, env=env)
    assert r.rc == 0 and r.report["restarted"], r.out + r.err


def test_local_status_about_another_guest_refused(local):
    """status/current of CT 129 answered with vmid 130's data: exit 4 naming it, never "stopped"; the CT untouched."""
    config, env, sim, d = local
    r = cli(RESET, config=config({STATUS: {"json": {"status": "stopped", "vmid": 130}}}), sim=sim, env=env)
    assert r.rc == 4 and "about guest 130, not 129" in r.out + r.err, r.out + r.err
    assert "status/stop" not in (d / "calls.log").read_text()


def test_local_deeply_nested_answer(local):
    """pvesh answering 100,000 nested lists: exit 4 naming the call, no RecursionError."""
    config, env, sim, _ = local
    r = cli(RESET, config=config({"get /cluster/resources": {"raw": "[" * 100000 + "]" * 100000}}), sim=sim, env=env)
    assert r.rc == 4 and "nested deeper than" in r.err and "list guests" in r.err, r.err


# -- a scripted PVE API over HTTPS: answers that break mid-body, lack `data`, nest without end ---------------------

class _ScriptedPve:
    """A real local HTTPS server answering like PVE for CT 129 on pve1; ``faults[path suffix]`` replaces one answer:
    ``("body", bytes)`` a 200 with that body, ``("cut", bytes)`` a Content-Length larger than the bytes sent, then
    the connection closed, ``("stall", bytes)`` the same bytes, then silence."""

    def __init__(self, tmp) -> None:
        import http.server
        import socket
        import ssl

        from fakepve.certs import make_cert

        cert, key, self.der = make_cert(str(tmp), name="scripted", hosts=("127.0.0.1",))
        faults: dict[str, tuple[str, bytes]] = {}
        self.faults = faults
        answers = {
            "/cluster/resources": [{"id": "lxc/129", "type": "lxc", "vmid": 129, "node": "pve1", "name": "llm129", "status": "running"}],
            "/lxc/129/config": {"hostname": "llm129", "dev0": "/dev/nvidia0,gid=44"},
            "/lxc/129/status/current": {"status": "running", "vmid": 129},
        }

        class H(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                path = self.path.split("?")[0]
                kind, body = next(((k, b) for suffix, (k, b) in faults.items() if path.endswith(suffix)), ("", b""))
                if not kind:
                    data = next((v for suffix, v in answers.items() if path.endswith(suffix)), None)
                    body = json.dumps({"data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) + (1000 if kind in ("cut", "stall") else 0)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if kind == "stall":
                    time.sleep(5)
                if kind in ("cut", "stall"):
                    self.close_connection = True

            do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        del socket

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.der).hexdigest()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted(leaky, tmp_path, monkeypatch):
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    srv = _ScriptedPve(tmp_path)
    tok = tmp_path / "token"
    tok.write_text("a1b2\n")
    tok.chmod(0o600)
    cfg = write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "no-etc-pve")},
                       api={"backend": "https", "host": "127.0.0.1", "port": srv.port, "token_name": "pvegpu", "token_file": str(tok),
                            "verify": "false", "fingerprint": srv.fingerprint(), "timeout": 1}, reset=RESET_FAST)
    yield srv, cfg, leaky
    srv.close()


@pytest.mark.parametrize("suffix,fault,text", [
    ("/cluster/resources", ("body", b'{"errors": null}'), "list guests: unexpected answer from 127.0.0.1:{port}: the answer has no 'data' member"),
    ("/lxc/129/status/current", ("body", b'{"success": 1}'), "read CT 129 status: unexpected answer from 127.0.0.1:{port}"),
    ("/cluster/resources", ("body", b'{"data": ' + b"[" * 100000 + b"]" * 100000 + b"}"), "127.0.0.1:{port} sent an answer nested deeper than"),
    ("/lxc/129/config", ("cut", b'{"data": {"hostn'), "127.0.0.1:{port} closed the connection in the middle of its answer"),
    ("/lxc/129/status/current", ("stall", b'{"data": {"sta'), "127.0.0.1:{port} did not answer within 1 s"),
])
def test_https_broken_answers(scripted, suffix, fault, text):
    """A 200 without `data`, 100,000 nested lists, a body cut off or stalled mid-answer: exit 4 naming the call and
    host:port, never "internal error"; nothing is stopped."""
    srv, cfg, sim = scripted
    srv.faults[suffix] = fault
    r = cli(RESET, config=cfg, sim=sim, bound=20)
    assert r.rc == 4 and text.format(port=srv.port) in r.out + r.err and "internal error" not in r.out + r.err, r.out + r.err
    assert r.wall < 15


def test_https_stop_answer_cut_off_reports_state(scripted):
    """The stop request's answer is cut off mid-body (the stop may have happened): exit 4 and the CT's state read and said."""
    srv, cfg, sim = scripted
    srv.faults["/status/stop"] = ("cut", b'{"data": "UPID:pve1')
    r = cli(RESET, config=cfg, sim=sim, bound=40)
    assert r.rc == 4 and "closed the connection in the middle of its answer" in r.out, r.out + r.err
    assert r.report["ct_state"] == "running" and r.report["left_stopped"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_hook_install_onto_read_only_storage(tmp_path):
    """`hook install` onto a read-only snippets storage: one refusal line, exit 8 (README), no container changed."""
    from tests.pvelike import etc_pve

    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"})
    vz = tmp_path / "vz"
    (vz / "snippets").mkdir(parents=True)
    for d in (vz, vz / "snippets"):
        d.chmod(0o755)  # a snippets directory others may write is refused: never the umask's choice
    (tmp_path / "pve" / "storage.cfg").write_text(f"dir: local\n\tpath {vz}\n\tcontent snippets\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "pct").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/pct.log\n")
    (bindir / "pct").chmod(0o755)
    cfg = write_config(tmp_path / "c.toml", top={"pve_root": pve, "node": "pve1"})
    subprocess.run(["mount", "--bind", str(vz), str(vz)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(vz)], check=True)
        r = cli(["hook", "install"], config=cfg, module="pvegpu", env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    finally:
        subprocess.run(["umount", str(vz)], check=True)
    assert r.rc == 8 and "cannot write the guard" in r.err and "Read-only file system" in r.err, r.out + r.err
    assert not (tmp_path / "pct.log").exists()


@pytest.mark.fakepve(time_scale=1)
@pytest.mark.parametrize("json_out", [False, True])
def test_https_slow_stop_task_progress(https, json_out):
    """A stop task taking 2 s: human output says what is awaited and how long of the deadline; --json stays one
    JSON document (no progress lines)."""
    fake, ct, config, sim = https
    ct.stop_secs = 2
    r = cli(RESET if json_out else ["reset", "129"], config=config(reset={"task_timeout": 10}), sim=sim)
    assert r.rc == 0, r.out + r.err
    if json_out:
        assert r.report["restarted"] and "[wait]" not in r.out
    else:
        assert "[wait] waiting for the stop task of CT 129: 1 s of 10" in r.out, r.out


def test_pmxcfs_down_is_said(tmp_path):
    """/etc/pve present but empty (pmxcfs not mounted): exit 4 saying so, not "not a Proxmox VE node"."""
    (tmp_path / "pve").mkdir()
    cfg = write_config(tmp_path / "c.toml", top={"pve_root": str(tmp_path / "pve")}, api={"backend": "auto"})
    r = cli(RESET, config=cfg, module="pvegpu")
    assert r.rc == 4 and "pmxcfs" in r.err and "not a Proxmox VE node" not in r.err, r.err
    r = cli(["check", "129"], config=cfg, module="pvegpu")
    assert r.rc == 4 and "pmxcfs" in r.err, r.err


def test_local_migrated_while_stopped(local):
    """The CT is relocated to pve2 while stopped (its status on pve1 is gone): said at once, naming pve2, not
    "unknown" after the state wait; exit 4."""
    config, env, sim, _ = local
    there = [{"id": "lxc/129", "type": "lxc", "vmid": 129, "node": "pve2", "name": "llm129", "status": "stopped"}]
    rules = {STATUS: {"fail_calls": [], "when_stopped": {"exit": 2, "stderr": "500 Configuration file 'nodes/pve1/lxc/129.conf' does not exist"}},
             "get /cluster/resources": stub_pvesh.DEFAULTS["get /cluster/resources"] | {"when_stopped": {"json": there}}}
    r = cli(RESET, config=config(rules, reset={"task_timeout": 5}), sim=sim, env=env, bound=40)
    assert r.rc == 4 and "is now on node pve2" in r.out and r.wall < 12, r.out + r.err


@pytest.mark.parametrize("json_out", [False, True])
def test_sim_memory_wait_progress(leaky, json_out):
    """A verify window of 2 s on memory that never comes back: human output says what is left and how long of the
    deadline; --json output is the report alone."""
    args = ["--simulate", leaky.root, "reset", "129", "--no-restart", "--timeout", "2", "--settle", "0.1"]
    r = cli(args + (["--json"] if json_out else []), module="pvegpu", bound=30)
    assert r.rc == 7, r.out + r.err
    if json_out:
        assert r.report["exit_code"] == 7 and "[wait]" not in r.out
    else:
        assert re.search(r"\[wait\] waiting for CT 129's GPU memory \(1,0\d\d MiB left on GPU 0\): 1 s of 2", r.out), r.out


def test_sim_lost_gpu_ends_wait_at_once(sim_node):
    """A GPU the first reading already shows lost: the memory wait ends at once (not after --timeout), exit 5
    (unknown, never clean), said."""
    node = sim_node({"node": "s", "gpus": [GPU | {"fail": "GPU is lost"}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    r = cli(["--simulate", node.root, "reset", "129", "--json", "--timeout", "20", "--grace", "0.2"], module="pvegpu", bound=40)
    assert r.rc == 5 and r.wall < 12, (r.wall, r.out + r.err)
    assert any(s["name"] == "verify" and s["outcome"] == "unreadable" for s in r.report["steps"])
