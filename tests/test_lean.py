"""The lean core: ``@record`` classes behave as the dataclasses they replace, the gate's and the reset's start-up
import no dataclasses/typer machinery, and ``pvegpu reset``'s light parser and its typer command read one table."""

from __future__ import annotations

import dataclasses
import json
import marshal
import os
import pickle
import subprocess
import sys
import time

import pytest

from pvegpu import record as R
from pvegpu import resetcmd
from pvegpu.errors import ConfigError
from pvegpu.install import fast_path
from pvegpu.model import GpuSample, Holder, NvmlProcess, Place, Placement, ProcIdentity, ProcInfo, Step
from pvegpu.settings import ResetSettings, Settings
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


# -- @record ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DcFrozen:
    pid: int
    used_bytes: int | None
    kind: str = "C"


@dataclasses.dataclass
class _DcMutable:
    name: str
    outcome: str
    detail: dict = dataclasses.field(default_factory=dict)


def test_a_frozen_record_is_a_frozen_dataclass():
    """Same repr, equality, hash, match args, and assignment refused with an AttributeError, as the dataclass."""
    a, d = NvmlProcess(7, 1024), _DcFrozen(7, 1024)
    assert repr(a).replace("NvmlProcess", "X") == repr(d).replace("_DcFrozen", "X")
    assert a == NvmlProcess(7, 1024, "C") and a != NvmlProcess(7, 1024, "G") and a != (7, 1024, "C")
    assert hash(a) == hash(NvmlProcess(7, 1024)) and len({a, NvmlProcess(7, 1024)}) == 1
    assert NvmlProcess.__match_args__ == ("pid", "used_bytes", "kind")
    with pytest.raises(AttributeError):
        a.pid = 8  # type: ignore[misc]
    with pytest.raises(R.FrozenInstanceError):
        del a.pid  # type: ignore[misc]


def test_a_mutable_record_is_a_mutable_dataclass():
    """Fresh default per instance from a factory, assignable, compared by value, unhashable."""
    s, d = Step("stop", "ok"), _DcMutable("stop", "ok")
    assert repr(s).replace("Step", "X") == repr(d).replace("_DcMutable", "X")
    assert Step("a", "b").detail is not Step("a", "b").detail
    s.outcome = "held"
    assert s == Step("stop", "held") and s != Step("stop", "ok")
    with pytest.raises(TypeError):
        hash(s)


def test_record_functions_and_dataclasses_functions_agree():
    """``fields``/``replace``/``asdict`` of records, and the dataclasses functions given a record, give the same."""
    info = ProcInfo(ProcIdentity(5, 99), "python", "S", Placement(Place.CONTAINER, 129), "/lxc/129/ns", 5)
    h = Holder(info, frozenset({0}), frozenset({"fd"}))
    assert [f.name for f in R.fields(ProcInfo)] == [f.name for f in dataclasses.fields(info)]
    assert R.replace(info, comm="x") == dataclasses.replace(info, comm="x") != info
    assert R.asdict(h) == dataclasses.asdict(h)
    assert dataclasses.is_dataclass(info) and R.is_record(info) and not R.is_record(_DcFrozen(1, 2))
    assert pickle.loads(pickle.dumps(h)) == h
    assert GpuSample(0, None, None).known is False


def test_settings_keep_their_field_types_for_coercion():
    """The settings loader reads each field's annotation to coerce text (a record keeps them as written)."""
    assert {f.name: f.type for f in R.fields(ResetSettings)}["rounds"] == "int"
    assert R.fields(Settings)[3].default_factory is not None
    with pytest.raises(TypeError):
        R.fields(object())


def test_record_refuses_a_required_field_after_a_default():
    """As a dataclass: a field without a default after one with a default is a TypeError at class creation."""
    with pytest.raises(TypeError):
        @R.record
        class Bad:
            a: int = 1
            b: int  # type: ignore[misc]


def _build(frozen: bool):
    """A record and the dataclass it stands for: a required field, a default and a factory."""
    @R.record(frozen=frozen)
    class Rec:
        a: int
        b: str = "x"
        c: list = R.field(default_factory=list)

    @dataclasses.dataclass(frozen=frozen)
    class Dc:
        a: int
        b: str = "x"
        c: list = dataclasses.field(default_factory=list)

    return Rec, Dc


_CALLS = [((), {}), ((1,), {}), ((1, "y"), {}), ((1, "y", [2]), {}), ((1, "y", [2], 3), {}), ((), {"a": 1}),
          ((1,), {"a": 2}), ((1,), {"c": [3]}), ((), {"a": 1, "d": 4}), ((), {"b": "y"}), ((1, "y"), {"b": "z"})]


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("hot", [False, True])
def test_record_init_takes_what_the_dataclass_init_takes(frozen, hot):
    """Positional, keyword, missing, extra, unknown and doubled arguments: the record's __init__ (the generic one, and the
    compiled one a hot class gets) gives the dataclass's fields, or raises TypeError where the dataclass does."""
    Rec, Dc = _build(frozen)
    if hot:
        for _ in range(R.HOT_INITS):
            Rec(0)
        assert Rec.__init__.__code__.co_varnames[:4] == ("self", "a", "b", "c")  # the compiled one took its place
    for args, kwargs in _CALLS:
        try:
            want = ("ok", dataclasses.astuple(Dc(*args, **kwargs)))
        except TypeError:
            want = ("TypeError",)
        try:
            got = ("ok", tuple(getattr(Rec(*args, **kwargs), n) for n in "abc"))
        except TypeError:
            got = ("TypeError",)
        assert got == want, (args, kwargs)
    assert Rec(1).c is not Rec(1).c


def test_a_records_methods_are_not_compiled_until_it_is_hot():
    """A class used a few times compiles nothing (no exec at a record's first use); its values still compare and show."""
    Rec, _ = _build(True)
    compiled = []
    real = R._compile
    R._compile = lambda *a: compiled.append(a) or real(*a)
    try:
        objs = [Rec(1, "y") for _ in range(R.HOT_INITS - 1)]
        assert not compiled and objs[0] == objs[-1] and repr(objs[0]).endswith("Rec(a=1, b='y', c=[])")
        Rec(2)
        assert len(compiled) == 1
    finally:
        R._compile = real


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {fast_path()!r}.split(':'); {code}; "
                          "print(' '.join(sys.modules))"], capture_output=True, text=True, cwd=REPO, timeout=60)
    return set(out.stdout.split())


def test_the_reset_path_imports_no_typer():
    """``pvegpu reset`` starts without typer, click, pydantic or rich (the front door parses its line)."""
    mods = _modules_after("import pvegpu.frontdoor, pvegpu.resetcmd")
    assert "pvegpu.resetcmd" in mods and not mods & {"typer", "click", "pydantic", "rich", "pvegpu.cli"}


# -- reset's one option table ----------------------------------------------------------------------------


def _typer_reset():
    import typer.main

    from pvegpu import cli

    return typer.main.get_command(cli.app).commands["reset"]  # type: ignore[attr-defined]


def test_the_typer_command_is_built_from_the_table():
    """Every option of the table is the typer command's, with its flags, help, metavar and kind, and nothing else."""
    cmd = _typer_reset()
    params = {p.name: p for p in cmd.params if p.name != "help"}
    assert set(params) == {o.dest for o in resetcmd.OPTIONS} | {resetcmd.ARGUMENT[0]}
    for o in resetcmd.OPTIONS:
        p = params[o.dest]
        assert tuple(p.opts + p.secondary_opts) == o.decls or set(p.opts) == set(o.decls)
        assert p.help == o.help and p.is_flag == (o.kind == "flag") and (p.metavar or "") == o.metavar
    assert params["vmid"].metavar == resetcmd.ARGUMENT[1] and params["vmid"].required


LINES = [
    ["129"], ["129", "--json"], ["--json", "129"], ["129", "--dry-run", "--no-restart", "-v"], ["129", "--verbose"],
    ["129", "--timeout", "5"], ["129", "--timeout=7.5", "--grace", "1", "--settle=0.1"], ["129", "--timeout", "1_0"],
    ["129", "--timeout", "nan"], ["129", "--grace", "2", "--grace", "3"], ["--settle", "0", "129", "--json"],
]


@pytest.mark.parametrize("line", LINES)
def test_light_parser_and_typer_read_a_line_alike(monkeypatch, line):
    """For every line the light parser takes, typer calls the same entry point with the same values."""
    from pvegpu import cli

    seen: list[dict] = []
    monkeypatch.setattr(resetcmd, "run", lambda values, opts: seen.append(dict(values)) or 0)
    assert cli.run(["reset", *line], cli.wiring.GlobalOptions()) == 0
    light = resetcmd.parse(line)
    assert light is not None and json.dumps(light, sort_keys=True) == json.dumps(seen[0], sort_keys=True)


@pytest.mark.parametrize("line", [
    [], ["--help"], ["129", "-h"], ["129", "130"], ["129", "--bogus"], ["129", "--timeout"], ["129", "--timeout", "x"],
    ["129", "--timeout", "-1"], ["129", "--json=1"], ["--", "129"], ["129", "-vx"],
])
def test_light_parser_leaves_what_it_is_not_sure_of_to_typer(line):
    """Help, unknown options, missing or bad values, ``--`` and a wrong number of VMIDs go to typer."""
    assert resetcmd.parse(line) is None


def _pvegpu(*args):
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.fixture
def stopped_ct(sim_node):
    return sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})


def test_reset_through_the_light_path_is_the_typer_reset(stopped_ct):
    """A dry run through the front door and through typer give the same exit code and the same JSON report."""
    from pvegpu import cli

    light = _pvegpu("--simulate", stopped_ct.root, "reset", "129", "--dry-run", "--json")
    code = subprocess.run([sys.executable, "-c", "import sys; from pvegpu import cli, wiring; "
                           f"sys.exit(cli.run(['reset', '129', '--dry-run', '--json'], wiring.GlobalOptions(None, {stopped_ct.root!r})))"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert cli is not None and light.returncode == code.returncode == 0, light.stderr + code.stderr
    a, b = json.loads(light.stdout), json.loads(code.stdout)
    for doc in (a, b):
        doc.pop("duration_s", None)
        doc.pop("started_at", None)
    assert a.keys() == b.keys() and a["outcome"] == b["outcome"] and a["exit_code"] == b["exit_code"]


def test_reset_errors_with_json_are_json_on_the_light_path(stopped_ct):
    """An unknown guest: exit 3, a JSON error object on stdout and the rendered error on stderr, as through typer."""
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
def test_a_root_run_writes_the_snapshot_and_the_next_reads_it_without_tomllib(conf):
    """The first load parses and writes the snapshot; a fresh process then gets the same settings without tomllib."""
    f, snap = conf
    first = _load(f, snap)
    assert os.stat(os.path.join(snap, "settings-other.snapshot")).st_uid == 0
    code = (f"import sys; sys.path[:0] = {fast_path()!r}.split(':'); from pvegpu.adapters.settingsfile import load; "
            f"s = load({str(f)!r}, env={{}}, snapshot_dir={snap!r}); print(s.reset.grace, s.gate.exclusive, 'tomllib' in sys.modules)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["4.0", "(129,", "130)", "False"], out.stderr
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
