"""Hostile and malformed input: settings, VM ids and scenario files give a one-line UsageError, never a traceback or a
hang; a .vmlist nested too deeply is a PVE error."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from pvegpu.adapters.settingsfile import load
from pvegpu.core.errors import ConfigError, UsageError
from pvegpu.core.locate import check_vmid
from pvegpu.core.settings import ApiSettings
from pvegpu.sim import scenario as sc
from tests import pvelike
from tests.pvelike import REPO

BAD_TOML = {
    "reset.grace = nan": "[reset]\ngrace = nan\n",
    "reset.grace = inf": "[reset]\ngrace = inf\n",
    "reset.grace = 1e400": "[reset]\ngrace = 1e400\n",
    "reset.grace = true": "[reset]\ngrace = true\n",
    "reset.rounds = 1.5": "[reset]\nrounds = 1.5\n",
    "reset.threshold_mib = -5": "[reset]\nthreshold_mib = -5\n",
    "reset.settle >= reset.timeout": "[reset]\nsettle = 30\ntimeout = 30\n",
    "api.port = 8006.9": "[api]\nport = 8006.9\n",
    "api.port = 70000": "[api]\nport = 70000\n",
    "gate.deadline = inf": "[gate]\ndeadline = inf\n",
    "gate.deadline = nan": "[gate]\ndeadline = nan\n",
    "gate.deadline = 1e10": "[gate]\ndeadline = 1e10\n",
    "gate.override_ttl = -1": "[gate]\noverride_ttl = -1\n",
    "gate.override_ttl = 0": "[gate]\noverride_ttl = 0\n",
    "gate.threshold_mib = -1": "[gate]\nthreshold_mib = -1\n",
    "gate.exclusive = [1.5]": "[gate]\nexclusive = [1.5]\n",
}


@pytest.mark.parametrize("name", sorted(BAD_TOML))
def test_settings_file_out_of_range_or_wrong_type_refused(name, tmp_path):
    """Each non-finite, out-of-range or wrongly typed setting in the file is a ConfigError (exit 2) naming it."""
    f = tmp_path / "s.toml"
    f.write_text(BAD_TOML[name])
    f.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError) as exc:
        load(str(f), env={})
    assert exc.value.exit_code == 2 and name.split(" ")[0] in exc.value.message


@pytest.mark.parametrize("var,value", [("PVEGPU_RESET_GRACE", "nan"), ("PVEGPU_RESET_GRACE", "inf"), ("PVEGPU_RESET_GRACE", "1e400"),
                                       ("PVEGPU_RESET_GRACE", "1_0"), ("PVEGPU_RESET_GRACE", "\uff11"), ("PVEGPU_RESET_ROUNDS", "1.5"),
                                       ("PVEGPU_API_PORT", "8006.9"), ("PVEGPU_GATE_DEADLINE", "601"), ("PVEGPU_RESET_ROUNDS", "\u0663")])
def test_settings_env_non_finite_or_non_ascii_refused(var, value, tmp_path):
    """Environment values that are not plain finite ASCII numbers of the right kind are refused."""
    with pytest.raises(ConfigError):
        load(None, env={var: value, "PVEGPU_CONFIG": os.devnull})


@pytest.mark.parametrize("key", ["reset.grace", "gate.deadline"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_settings_flag_override_non_finite_refused(key, value):
    """A flag value (--grace nan) goes through the same checks as the file."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(os.devnull, env={}, overrides={key: value})


def test_settings_good_values_and_integral_strings_accepted(tmp_path):
    """Plain values still load: ints for ints, ints or floats for floats, env strings parsed."""
    f = tmp_path / "ok.toml"
    f.write_text("[reset]\ngrace = 3\nsettle = 0.5\nrounds = 2\n[gate]\ndeadline = 600\nexclusive = [129, 130]\n")
    f.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    s = load(str(f), env={"PVEGPU_API_PORT": "8443", "PVEGPU_RESET_KILL_WAIT": "2.5e0"})
    assert (s.reset.grace, s.reset.rounds, s.gate.deadline, s.gate.exclusive, s.api.port, s.reset.kill_wait) == (3.0, 2, 600.0, (129, 130), 8443, 2.5)


def test_settings_file_not_utf8_is_config_error(tmp_path):
    """A settings file that is not UTF-8 is a ConfigError naming the file, not a UnicodeDecodeError."""
    f = tmp_path / "latin1.toml"
    f.write_bytes(b"node = \"caf\xe9\"\n")
    f.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError, match="latin1.toml"):
        load(str(f), env={})


def test_settings_not_utf8_from_command_line_one_line_exit_2(tmp_path):
    """`pvegpu audit` with a non-UTF-8 settings file exits 2 with an error line, no traceback."""
    f = tmp_path / "bad.toml"
    f.write_bytes(b"\xff\xfe[reset]\n")
    f.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    r = subprocess.run([sys.executable, "-m", "pvegpu", "audit"], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env=dict(os.environ, PVEGPU_CONFIG=str(f)))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "bad.toml" in r.stderr


def test_api_defaults_match_the_settings_page():
    """docs/settings.md's documented token defaults are the code's defaults."""
    page = open(os.path.join(REPO, "docs", "settings.md"), encoding="utf-8").read()
    a = ApiSettings()
    assert f'token_name = "{a.token_name}"' in page and f'token_file = "{a.token_file}"' in page
    assert a.token_name and a.token_file


def test_privsep_advice_agrees():
    """README and the connect() hint give the same --privsep advice (a separated token with its own ACLs)."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    pve_src = open(os.path.join(REPO, "pvegpu", "adapters", "pve.py"), encoding="utf-8").read()
    assert "--privsep 1" in readme and "--privsep 0" not in readme and "--privsep 0" not in pve_src
    assert "pveum acl modify" in readme and "--tokens" in readme


@pytest.mark.parametrize("text", ["\uff11\uff12\uff19", "\u0661\u0662\u0669", "+129", "1_29", " 1 29 ", "129\x00", "0x81", "12.9", "", "\u00b2\u00b9\u2079"])
def test_vmid_non_ascii_digits_refused(text):
    """Only ASCII digits make a VM id: full-width, Arabic-Indic, signs, underscores, inner junk are refused."""
    with pytest.raises(UsageError):
        check_vmid(text)


def test_vmid_ascii_with_outer_whitespace_accepted():
    """A plain id, also with leading/trailing whitespace or as an int, is accepted."""
    assert check_vmid("129") == check_vmid(" 129\n") == check_vmid(129) == 129


@pytest.fixture
def made_dirs(monkeypatch):
    """The temporary directories scenario.build creates in this test (and only those: other runs' are not looked at)."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(sc.tempfile, "mkdtemp", mkdtemp)
    return made


GPU = {"minor": 0, "index": 0}


@pytest.mark.parametrize("bad,what", [
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": "abc", "gpus": [0]}]}, "vmid"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [3]}]}, "GPU 3"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 5}]}]}, "GPU 5"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0]}, {"vmid": 129, "gpus": [0]}]}, "duplicate"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0]}], "vms": [{"vmid": 129}]}, "duplicate"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": True, "gpus": [0]}]}, "vmid"),
    ({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": "lots"}]}]}, "mib"),
    ({"node": "s", "gpus": [GPU], "containers": ["x"]}, "container"),
])
def test_bad_scenario_is_usage_error_before_anything_starts(bad, what, made_dirs):
    """A scenario with a non-numeric or duplicate vmid, or an undefined GPU, is a UsageError before anything
    starts (not even its temporary directory is made)."""
    with pytest.raises(UsageError, match=what):
        sc.build(bad)
    assert made_dirs == []


def test_scenario_failure_after_layout_removes_temp_dir(monkeypatch, made_dirs):
    """A failure while the simulated node is being laid out removes its temporary directory."""
    from pvegpu.sim import state as state_mod

    def boom(self, gpus):
        raise OSError("disk full")

    monkeypatch.setattr(state_mod.SimState, "set_gpus", boom)
    with pytest.raises(OSError):
        sc.build({"node": "s", "gpus": [GPU], "containers": []})
    assert len(made_dirs) == 1 and not os.path.exists(made_dirs[0])


def test_settings_file_that_is_a_fifo_or_endless_is_refused_at_once(tmp_path):
    """A FIFO or an endless device as the settings file is a one-line error (exit 2), never a hang."""
    from tests.pvelike import REPO

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        r = subprocess.run([sys.executable, "-m", "pvegpu", "--config", path, "check", "129"], capture_output=True, text=True,
                           cwd=REPO, timeout=20)
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr


def test_sim_create_with_a_fifo_scenario_ends_with_exit_2_not_a_hang(tmp_path):
    """`sim create DIR --scenario FIFO`: exit 2 at once (a scenario must be a bounded regular file), no DIR made."""
    fifo = tmp_path / "scenario.json"
    os.mkfifo(fifo)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    try:
        r = subprocess.run([sys.executable, "-m", "pvegpu", "sim", "create", str(tmp_path / "node"), "--scenario", str(fifo)],
                           capture_output=True, text=True, cwd=REPO, timeout=20, env=clean)
    except subprocess.TimeoutExpired:
        pytest.fail("sim create hung on a FIFO scenario")
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2 and not (tmp_path / "node").exists()


def test_a_vmlist_nested_too_deeply_is_a_pve_error_not_a_traceback(tmp_path):
    """A .vmlist nested past the recursion limit is a PveApiError (one line, a hint), never a RecursionError."""
    from pvegpu.adapters.etcpve import EtcPve
    from pvegpu.core.errors import PveApiError

    (tmp_path / ".vmlist").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PveApiError):
        EtcPve(str(tmp_path)).guests()

def test_unrelated_pvegpu_variables_are_not_settings():
    """PVEGPU_DEBUG or a script's own PVEGPU_* variable is ignored; a typo in a section's key is still an error."""
    from pvegpu.adapters.settingsfile import load

    assert load(None, env={"PVEGPU_RESULTS": "x", "PVEGPU_DEBUG": "1"}).reset.grace > 0
    with pytest.raises(ConfigError, match="reset.grac: unknown setting"):
        load(None, env={"PVEGPU_RESET_GRAC": "3"})


def test_task_exitstatus_and_log_lines_are_escaped_at_the_adapter():
    """A failed task's exitstatus and log lines (remote text a guest can write into) reach no terminal raw: OSC 52,
    screen clears and bidi overrides come out as visible escapes, in the message and the tail."""
    from pvegpu.adapters.clock import SystemClock
    from pvegpu.adapters.tasks import wait_task
    from pvegpu.core.errors import TaskFailed

    evil = "startup failed\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07\u202eKO\n! forged"
    with pytest.raises(TaskFailed) as got:
        wait_task(lambda: {"status": "stopped", "exitstatus": evil}, lambda: [evil, "ok line"], SystemClock(),
                  node="pve1", upid="UPID:pve1:0:0:0:vzstart:129:root@pam:", timeout=1, what="start CT 129")
    exc = got.value
    shown = [exc.message, *exc.log_tail]
    assert all(s.isprintable() for s in shown) and "ok line" in exc.log_tail
    res = wait_task(lambda: {"status": "stopped", "exitstatus": "WARNINGS: 1\x1b[2J"}, lambda: [], SystemClock(),
                    node="pve1", upid="UPID:pve1:0:0:0:vzstart:129:root@pam:", timeout=1, what="start CT 129")
    assert res.exitstatus.isprintable()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a file of another uid)")
def test_settings_file_a_user_can_write_is_refused_and_pre_start_refuses(tmp_path):
    """A local user who owns (or may write) the settings file turns the gate off with it: refused, one line + hint,
    exit 2; the hook's pre-start refuses the start with that reason (exit 10)."""
    home = tmp_path / "u"
    home.mkdir()
    os.chown(home, 65534, 65534)
    cfg = home / "pvegpu.toml"
    dirfd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)

    def write() -> None:
        fd = os.open("pvegpu.toml", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dirfd)
        os.write(fd, b'[gate]\non_unknown = "allow"\n')
        os.close(fd)

    pvelike.as_uid(65534, write)
    os.close(dirfd)
    assert os.stat(cfg).st_uid == 65534
    env = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")} | {"PVEGPU_CONFIG": str(cfg)}

    def run(*args):  # the settings file as the hook gets it (PVE passes no options)
        return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)

    r = run("check", "129")
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "Hint: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 2
    r = run("hook", "129", "pre-start")
    assert r.returncode == 10 and "uid 65534" in r.stderr, r.stderr
    with pytest.raises(ConfigError):
        load(str(cfg), env={})
    os.chown(cfg, 0, 0)
    os.chmod(cfg, 0o664)  # root's, but group-writable
    with pytest.raises(ConfigError):
        load(str(cfg), env={})
    os.chmod(cfg, 0o644)
    assert load(str(cfg), env={}).gate.on_unknown == "allow"


def test_api_error_text_is_escaped_before_it_reaches_a_message():
    """The API's error text (remote: PVE puts it in the HTTP reason, pvesh in its stderr; a task or a proxy can put
    escapes in it) is escaped in the PveApiError's message."""
    from proxmoxer import ResourceException

    from pvegpu.adapters.pve import ProxmoxerPve
    from pvegpu.core.errors import PveApiError

    def fail():
        raise ResourceException(500, "Internal Server Error", "boom\x1b[2J\x1b]52;c;cm0gLXJmIC8=\x07\u202e")

    with pytest.raises(PveApiError) as got:
        ProxmoxerPve(api=None, node="pve1")._call("stop CT 129", fail)
    assert got.value.message.isprintable() and "\\x1b[2J" in got.value.message
