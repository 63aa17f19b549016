"""The settings' field types, ``pvegpu reset``'s options reaching the reset, and the settings snapshot."""

from __future__ import annotations

import dataclasses
import json
import marshal
import os
import subprocess
import sys
import time

import pytest

from pvegpu.cli import app as cli
from pvegpu.cli import run
from pvegpu.core.errors import ConfigError
from pvegpu.core.settings import ResetSettings, Settings
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


def test_settings_keep_their_field_types_for_coercion():
    """The settings loader reads each field's annotation to coerce text (a dataclass keeps them as written)."""
    assert {f.name: f.type for f in dataclasses.fields(ResetSettings)}["rounds"] == "int"
    assert dataclasses.fields(Settings)[3].default_factory is not dataclasses.MISSING
    with pytest.raises(TypeError):
        dataclasses.fields(object())


# -- reset's options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("line,flags,settings", [
    (["129"], {}, {}), (["129", "--json"], {"json_out": True}, {}), (["--json", "129"], {"json_out": True}, {}),
    (["129", "--dry-run", "--no-restart", "-v"], {"dry_run": True, "verbose": True}, {"restart": False}),
    (["129", "--verbose"], {"verbose": True}, {}), (["129", "--timeout", "5"], {}, {"timeout": 5.0}),
    (["129", "--timeout=7.5", "--grace", "1", "--settle=0.1"], {}, {"timeout": 7.5, "grace": 1.0, "settle": 0.1}),
    (["129", "--grace", "2", "--grace", "3"], {}, {"grace": 3.0}), (["--settle", "0", "129", "--json"], {"json_out": True}, {"settle": 0.0}),
])
def test_reset_options_reach_the_reset(monkeypatch, tmp_path, line, flags, settings):
    """Each option of `pvegpu reset` arrives: the flags as the reset's arguments, the seconds and --no-restart as the
    settings they override (the last of a repeated one wins); the rest keep their defaults."""
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    for k in [k for k in os.environ if k.startswith("PVEGPU_")]:
        monkeypatch.delenv(k)
    seen: list[tuple] = []
    monkeypatch.setattr(cli, "do_reset", lambda s, vmid, **kw: seen.append((s, vmid, kw)) or 0)
    assert run(["--config", str(cfg), "reset", *line]) == 0
    (s, vmid, kw), = seen
    assert vmid == 129 and kw == {"dry_run": False, "json_out": False, "verbose": False} | flags
    default = ResetSettings()
    assert {k: getattr(s.reset, k) for k in ("timeout", "grace", "settle", "restart")} == {
        k: getattr(default, k) for k in ("timeout", "grace", "settle", "restart")} | settings


@pytest.mark.parametrize("line", [[], ["129", "130"], ["129", "--bogus"], ["129", "--timeout"], ["129", "--timeout", "x"],
                                  ["129", "--timeout", "-1"], ["129", "--json=1"], ["129", "-vx"]])
def test_a_bad_reset_line_is_a_usage_error(line, capsys):
    """A missing or extra VMID, an unknown option, a missing, bad or out-of-range value: exit 2, Error and Hint lines."""
    assert run(["reset", *line]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "Hint: " in err and "Traceback" not in err, err


def _pvegpu(*args):
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.fixture
def stopped_ct(sim_node):
    return sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})


def test_reset_errors_with_json_are_json(stopped_ct):
    """An unknown guest: exit 3, a JSON error object on stdout and the rendered error on stderr."""
    r = _pvegpu("--simulate", stopped_ct.root, "reset", "555", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3 and r.stderr.startswith("Error:")


# -- the settings snapshot -------------------------------------------------------------------------------


@pytest.fixture
def conf(tmp_path, monkeypatch):
    """A settings file and a root-only snapshot directory, both in a temp dir (never /run/pvegpu); a file just
    written may be snapshot at once (the 2 s "racy" margin is tested on its own)."""
    from pvegpu.adapters import settingsfile

    monkeypatch.setattr(settingsfile, "RACY_NS", 0)
    f = tmp_path / "pvegpu.toml"
    f.write_text("[reset]\ngrace = 4\n[gate]\nexclusive = [129, 130]\n")
    f.chmod(0o644)
    snap = tmp_path / "snap"
    return f, str(snap)


def _load(f, snap):
    from pvegpu.adapters.settingsfile import load

    return load(str(f), env={}, snapshot_dir=snap)



@pytest.mark.root
def test_a_root_run_writes_the_snapshot_and_the_next_reads_it_without_parsing(conf):
    """The first load parses and writes the snapshot; a fresh process then gets the same settings without parsing the TOML."""
    f, snap = conf
    first = _load(f, snap)
    assert os.stat(os.path.join(snap, "settings-other.snapshot")).st_uid == 0
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from pvegpu.adapters import settingsfile as sf; "
            "sf._parse = lambda *a: sys.exit('parsed although a snapshot exists'); "
            f"s = sf.load({str(f)!r}, env={{}}, snapshot_dir={snap!r}); print(s.reset.grace, s.gate.exclusive)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["4.0", "(129,", "130)"], out.stderr
    assert first.reset.grace == 4.0 and first.gate.exclusive == (129, 130)


@pytest.mark.root
def test_a_changed_file_is_parsed_again(conf):
    """A rewrite (same size even), a chmod or a rename over the file makes the snapshot stale: the TOML is read."""
    f, snap = conf
    _load(f, snap)
    time.sleep(0.1)  # past the file system's timestamp tick (a few ms): that case is the racy margin's
    f.write_text("[reset]\ngrace = 5\n[gate]\nexclusive = [129, 130]\n")  # same size, new mtime/ctime
    assert _load(f, snap).reset.grace == 5.0
    new = f.with_name("new.toml")
    new.write_text("[reset]\ngrace = 6\n")
    new.chmod(0o644)
    os.replace(new, f)
    assert _load(f, snap).reset.grace == 6.0
    f.chmod(0o664)  # the ownership checks run on every load, snapshot or not
    with pytest.raises(ConfigError):
        _load(f, snap)


@pytest.mark.root
def test_a_snapshot_a_non_root_user_could_write_is_ignored(conf):
    """A snapshot owned by another uid, writable by others, or in a directory others may write is never used."""
    f, snap = conf
    _load(f, snap)
    path = os.path.join(snap, "settings-other.snapshot")
    doc = marshal.loads(open(path, "rb").read())
    doc["data"]["reset"]["grace"] = 1  # a forged snapshot of the very same file
    for fix in ("chown", "chmod", "dir"):
        with open(path, "wb") as fh:
            fh.write(marshal.dumps(doc))
        os.chmod(path, 0o600)
        os.chmod(snap, 0o700)
        os.chown(path, 0, 0)
        if fix == "chown":
            os.chown(path, 65534, 65534)
        elif fix == "chmod":
            os.chmod(path, 0o666)
        else:
            os.chmod(snap, 0o777)
        assert _load(f, snap).reset.grace == 4.0, fix
    os.chmod(snap, 0o700)
    os.chown(path, 0, 0)
    os.chmod(path, 0o600)
    assert _load(f, snap).reset.grace == 1.0  # the same forged text, root's only: taken (it is a cache of root's)


@pytest.mark.root
@pytest.mark.parametrize("junk", [b"", b"{", marshal.dumps([]), marshal.dumps({"version": 1}), b'{"version": 2}',
                                  marshal.dumps({"version": 2, "path": "x", "file": [], "data": {}}),
                                  marshal.dumps({"version": 2, "path": None, "file": None, "data": {"reset": {"grace": b"1"}}})])
def test_an_unreadable_or_foreign_snapshot_falls_back_to_the_toml(conf, junk):
    """Garbage, another version, another file's snapshot or data TOML cannot hold: the TOML is parsed, and the
    snapshot rewritten."""
    f, snap = conf
    os.makedirs(snap, mode=0o700)
    path = os.path.join(snap, "settings-other.snapshot")
    with open(path, "wb") as fh:
        fh.write(junk)
    assert _load(f, snap).reset.grace == 4.0
    assert marshal.loads(open(path, "rb").read())["data"]["reset"]["grace"] == 4


@pytest.mark.root
def test_a_snapshot_of_this_file_holding_non_toml_data_is_not_used(conf):
    """A snapshot of the very file whose data holds what TOML never gives (bytes, a tuple) is ignored: the TOML is
    parsed instead."""
    from pvegpu.adapters import settingsfile as sf

    f, snap = conf
    _load(f, snap)
    path = os.path.join(snap, "settings-other.snapshot")
    doc = marshal.loads(open(path, "rb").read())
    for bad in (b"1", (1,), {1: 2}):
        doc["data"]["reset"]["grace"] = bad
        with open(path, "wb") as fh:
            fh.write(marshal.dumps(doc))
        assert sf.read_snapshot(snap, str(f), doc["file"]) is None
        assert _load(f, snap).reset.grace == 4.0


def test_a_bad_file_gets_no_snapshot_and_the_same_errors(conf):
    """A file that is not TOML (or holds a TOML date) is reported each time, never cached away."""
    f, snap = conf
    f.write_text("[reset\n")
    for _ in range(2):
        with pytest.raises(ConfigError):
            _load(f, snap)
    f.write_text("when = 1979-05-27\n")
    with pytest.raises(ConfigError):
        _load(f, snap)
    assert not os.path.exists(os.path.join(snap, "settings-other.snapshot"))


@pytest.mark.root
def test_a_config_file_and_the_default_file_keep_separate_snapshots(tmp_path, monkeypatch):
    """``--config FILE`` gets a snapshot of its own slot: it neither evicts the default file's (the hook's) nor is
    taken for it, and each is used only for its own path."""
    from pvegpu.adapters import settingsfile as sf

    monkeypatch.setattr(sf, "RACY_NS", 0)
    default, other = tmp_path / "default.toml", tmp_path / "other.toml"
    default.write_text("[reset]\ngrace = 4\n")
    other.write_text("[reset]\ngrace = 6\n")
    for f in (default, other):
        f.chmod(0o644)
    monkeypatch.setattr(sf, "DEFAULT_PATH", str(default))
    snap = str(tmp_path / "snap")
    assert _load(default, snap).reset.grace == 4.0 and _load(other, snap).reset.grace == 6.0
    assert sorted(os.listdir(snap)) == ["settings-other.snapshot", "settings.snapshot"]
    monkeypatch.setattr(sf, "_parse", lambda raw, path, problems: pytest.fail("parsed although a snapshot exists"))
    assert _load(default, snap).reset.grace == 4.0 and _load(other, snap).reset.grace == 6.0


@pytest.mark.root
def test_a_file_changed_just_now_gets_no_snapshot(tmp_path):
    """Inside the racy margin nothing is written: a second write in the same timestamp tick cannot hide."""
    f = tmp_path / "pvegpu.toml"
    f.write_text("[reset]\ngrace = 4\n")
    f.chmod(0o644)
    assert _load(f, str(tmp_path / "snap")).reset.grace == 4.0
    assert not os.path.exists(tmp_path / "snap" / "settings-other.snapshot")
