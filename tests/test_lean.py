"""The lean core: ``@record`` classes behave as the dataclasses they replace, the gate's and the reset's start-up
import no dataclasses/typer machinery, and ``pvegpu reset``'s light parser and its typer command read one table."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from pvegpu import record as R
from pvegpu import resetcmd
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


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {REPO!r}); {code}; "
                          "print(' '.join(sys.modules))"], capture_output=True, text=True, cwd=REPO, timeout=60)
    return set(out.stdout.split())


def test_the_gate_path_imports_no_dataclass_machinery():
    """The hook, its settings and its real ports import neither dataclasses, inspect nor typing."""
    mods = _modules_after("import pvegpu.hook, pvegpu.vmgate, pvegpu.adapters.procfs, pvegpu.adapters.etcpve, "
                          "pvegpu.adapters.nvml_lite, pvegpu.adapters.locks, pvegpu.adapters.override, pvegpu.adapters.child")
    assert "pvegpu.hook" in mods and not mods & {"dataclasses", "inspect", "typing", "tomllib"}


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
