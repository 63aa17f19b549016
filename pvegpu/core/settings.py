"""Settings: ``/etc/pvegpu/pvegpu.toml``, then ``PVEGPU_<SECTION>_<KEY>`` variables, then CLI flags.

The schema and the rules only (pure): ``build`` turns the file's data, the environment and the overrides into
``Settings``; reading the file and the environment is ``pvegpu/adapters/settingsfile.py``'s. Every problem is
collected and reported in one ConfigError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pvegpu.core.errors import ConfigError
from pvegpu.core.leftover import DEFAULT_PER_CONTEXT_MIB, DEFAULT_THRESHOLD_MIB

DEFAULT_PATH = "/etc/pvegpu/pvegpu.toml"


@dataclass(frozen=True)
class ApiSettings:
    backend: str = "auto"  # auto | local | https
    host: str = ""
    port: int = 8006
    user: str = "root@pam"
    token_name: str = "pvegpu"
    token_file: str = "/etc/pvegpu/token"  # the token secret: a regular file owned by root, mode 0600
    verify: str = "true"  # true | false | path to a CA file
    fingerprint: str = ""  # SHA-256 fingerprint of the node certificate (pinning)
    timeout: float = 30.0


@dataclass(frozen=True)
class ResetSettings:
    grace: float = 10.0
    kill_wait: float = 5.0
    timeout: float = 30.0
    poll: float = 0.02  # seconds between readings while waiting (NVML + the CT's /proc: a few ms each)
    settle: float = 0.25  # clean must hold this long; raise it for services that respawn slowly
    rounds: int = 3
    restart: bool = True
    task_timeout: float = 120.0
    lock_dir: str = "/run/pvegpu/locks"  # one reset per container at a time: <lock_dir>/<vmid>.lock (root-owned, mode 700)
    lock_wait: float = 10.0  # seconds a second reset of the same container waits for the first


@dataclass(frozen=True)
class GateSettings:
    on_unknown: str = "refuse"  # refuse | allow: what the start gate does when a GPU cannot be read
    exclusive: tuple[int, ...] = ()  # vmids that must not share their GPUs at start
    exclusive_tag: str = "gpu-exclusive"  # PVE tag with the same effect
    deadline: float = 5.0  # seconds; on expiry the hook refuses
    host_users: str = "share"  # share | refuse: a host process that owns a context on the GPU
    post_stop_reclaim: bool = False  # post-stop: also stop stray holders of the container
    override_dir: str = "/run/pvegpu/allow-once"  # `pvegpu hook allow-once VMID` drops a one-start token here
    override_ttl: float = 900.0  # seconds a token stays valid
    record_dir: str = "/run/pvegpu/pids"  # where the gate and audit keep what they saw of NVML-listed pids (root-owned, mode 700)
    health: str = "refuse"  # refuse | warn: a GPU that needs a reset or a reboot, or is lost (docs/health.md)


@dataclass(frozen=True)
class GpuResetSettings:
    """``pvegpu gpu-reset N`` (docs/gpu-reset.md)."""

    drain_dir: str = "/run/pvegpu/draining"  # <drain_dir>/gpu<minor>.lock: one gpu-reset per GPU; the gate refuses starts while held
    smi: str = "/usr/bin/nvidia-smi"  # the binary that sets persistence mode and resets the GPU (a simulated node uses its stand-in)
    smi_timeout: float = 60.0  # seconds each nvidia-smi call may take
    client_wait: float = 10.0  # seconds host clients get to let go of the GPU once persistence mode is off
    idle_mib: int = 64  # after the reset, used memory at most this is the idle baseline


@dataclass(frozen=True)
class LeftoverSettings:
    """The one leftover rule (``pvegpu/core/leftover.py``) for reset's verify, the gate, audit and the diagnosis."""

    threshold_mib: int = DEFAULT_THRESHOLD_MIB  # net leftover above this is left over
    per_context_mib: float = DEFAULT_PER_CONTEXT_MIB  # allowance per live CUDA context outside the target


@dataclass(frozen=True)
class Settings:
    node: str = ""  # this node's PVE name; default: from /etc/pve/local or the hostname
    pve_root: str = "/etc/pve"
    simulate: str = ""  # a simulated node's state directory (pvegpu demo / tests)
    api: ApiSettings = field(default_factory=ApiSettings)
    reset: ResetSettings = field(default_factory=ResetSettings)
    gate: GateSettings = field(default_factory=GateSettings)
    leftover: LeftoverSettings = field(default_factory=LeftoverSettings)
    gpureset: GpuResetSettings = field(default_factory=GpuResetSettings)


_TOP = ("node", "pve_root", "simulate")  # the settings outside a [section]
_SECTIONS = {"api": ApiSettings, "reset": ResetSettings, "gate": GateSettings, "leftover": LeftoverSettings,
             "gpureset": GpuResetSettings}
_OLD_THRESHOLDS = ("reset", "gate")  # [reset]/[gate] threshold_mib: the old names of leftover.threshold_mib


_NUMBER_CHARS = frozenset("0123456789+-.eE")
MAX_SECONDS = 86400.0  # no wait of pvegpu is meant to last longer than a day
MAX_GATE_DEADLINE = 600.0  # PVE's start task waits for the hook; beyond this the start looks hung


def _plain_number(value: Any) -> str | None:
    """``value`` as ASCII number text, or None (bools, full-width or other Unicode digits, ``1_0``, ``nan``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).strip()
    return text if text and text.isascii() and set(text) <= _NUMBER_CHARS else None


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if digits.isascii() and digits.isdigit():
            return int(text)
    raise ValueError


def _to_float(value: Any) -> float:
    text = _plain_number(value)
    if text is None:
        raise ValueError
    number = float(value) if isinstance(value, int | float) else float(text)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError  # nan, inf, and 1e400 (which parses as inf)
    return number


def _coerce(name: str, kind: Any, value: Any, problems: list[str]) -> Any:
    try:
        if kind in ("bool", bool):
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in ("int", int):
            return _to_int(value)
        if kind in ("float", float):
            return _to_float(value)
        if kind in ("tuple[int, ...]",):
            items = value if isinstance(value, list) else [v for v in str(value).replace(",", " ").split() if v]
            return tuple(_to_int(v) for v in items)
        if isinstance(value, dict | list):
            raise ValueError
        return str(value)
    except (TypeError, ValueError, OverflowError):
        what = {"int": "whole number", "float": "finite number", "tuple[int, ...]": "list of whole numbers"}.get(
            kind if isinstance(kind, str) else kind.__name__, kind if isinstance(kind, str) else kind.__name__)
        problems.append(f"{name}: {value!r} is not a valid {what}")
        return None


def _apply(obj: Any, values: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    known = {f.name: f for f in fields(obj)}
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known or key in _SECTIONS:
            problems.append(f"{prefix}{key}: unknown setting")
            continue
        v = _coerce(prefix + key, known[key].type, value, problems)
        if v is not None:
            changes[key] = v
    return replace(obj, **changes)


def _validate(s: Settings, problems: list[str]) -> None:
    if s.api.backend not in ("auto", "local", "https"):
        problems.append(f"api.backend: {s.api.backend!r} must be auto, local or https")
    if not 1 <= s.api.port <= 65535:
        problems.append(f"api.port: {s.api.port} must be 1..65535")
    if not 0 < s.api.timeout <= MAX_SECONDS:
        problems.append(f"api.timeout: {s.api.timeout:g} must be > 0 and <= {MAX_SECONDS:g}")
    if s.gate.on_unknown not in ("refuse", "allow"):
        problems.append(f"gate.on_unknown: {s.gate.on_unknown!r} must be refuse or allow")
    if not 0 <= s.reset.settle <= MAX_SECONDS:
        problems.append("reset.settle: must be >= 0")
    for name in ("grace", "kill_wait", "timeout", "poll", "task_timeout"):
        value = getattr(s.reset, name)
        if not 0 < value <= MAX_SECONDS:
            problems.append(f"reset.{name}: {value:g} must be > 0 and <= {MAX_SECONDS:g}")
    if s.gate.health not in ("refuse", "warn"):
        problems.append(f"gate.health: {s.gate.health!r} must be refuse or warn")
    if s.reset.poll > 0.05:
        problems.append("reset.poll: must be <= 0.05 s")
    if s.reset.timeout <= s.reset.settle:
        problems.append(f"reset.timeout ({s.reset.timeout:g}) must be greater than reset.settle ({s.reset.settle:g})")
    if not 1 <= s.reset.rounds <= 100:
        problems.append("reset.rounds: must be 1..100")
    if s.leftover.threshold_mib < 0:
        problems.append("leftover.threshold_mib: must be >= 0")
    if not 0 <= s.leftover.per_context_mib <= 1024:
        problems.append(f"leftover.per_context_mib: {s.leftover.per_context_mib:g} must be >= 0 and <= 1024")
    if s.gate.host_users not in ("share", "refuse"):
        problems.append(f"gate.host_users: {s.gate.host_users!r} must be share or refuse")
    if not 0 < s.gate.deadline <= MAX_GATE_DEADLINE:
        problems.append(f"gate.deadline: {s.gate.deadline:g} must be > 0 and <= {MAX_GATE_DEADLINE:g}")
    if not 0 < s.gate.override_ttl <= MAX_SECONDS:
        problems.append(f"gate.override_ttl: {s.gate.override_ttl:g} must be > 0 and <= {MAX_SECONDS:g}")
    for name in ("smi_timeout", "client_wait"):
        if not 0 < (value := getattr(s.gpureset, name)) <= MAX_SECONDS:
            problems.append(f"gpureset.{name}: {value:g} must be > 0 and <= {MAX_SECONDS:g}")
    if s.gpureset.idle_mib < 0:
        problems.append("gpureset.idle_mib: must be >= 0")
    bad_ids = [v for v in s.gate.exclusive if not 100 <= v <= 999_999_999]
    if bad_ids:
        problems.append(f"gate.exclusive: {bad_ids} are not guest ids (100..999999999)")


def _old_threshold(data: dict[str, Any], problems: list[str]) -> str:
    """``reset.threshold_mib`` and ``gate.threshold_mib`` keep working as names of ``leftover.threshold_mib``;
    given with different values (they used to be two rules), that is an error naming the one key."""
    given: dict[str, Any] = {}
    for sec in _OLD_THRESHOLDS:
        raw = data.get(sec)
        if isinstance(raw, dict) and "threshold_mib" in raw:
            raw = dict(raw)
            given[f"{sec}.threshold_mib"] = raw.pop("threshold_mib")
            data[sec] = raw
    if not given:
        return ""
    new = data.get("leftover")
    if isinstance(new, dict) and "threshold_mib" in new:
        given["leftover.threshold_mib"] = new["threshold_mib"]
    if len({str(v).strip() for v in given.values()}) > 1:
        problems.append(" and ".join(f"{k} = {v!r}" for k, v in given.items())
                        + " differ: one leftover rule serves reset, the gate and audit now: set only leftover.threshold_mib")
        return ""
    if isinstance(new, dict) or new is None:
        data["leftover"] = {**(new or {}), "threshold_mib": next(iter(given.values()))}
    return " and ".join(k for k in given if not k.startswith("leftover."))


def build(data: dict[str, Any], env: Mapping[str, str], overrides: dict[str, Any] | None, path: str,
          problems: list[str]) -> Settings:
    """Settings from the file's ``data`` (already parsed; ``problems`` holds what reading it found), then the
    ``PVEGPU_*`` variables of ``env``, then ``overrides`` ("reset.grace": 3); every problem in one ConfigError."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}  # the caller keeps its own
    for key, value in env.items():
        if not key.startswith("PVEGPU_") or key == "PVEGPU_CONFIG":
            continue
        parts = key[7:].lower().split("_", 1)
        if parts[0] in _SECTIONS and len(parts) == 2:  # PVEGPU_RESET_GRAC: meant for us, so a typo is an error
            data.setdefault(parts[0], {})[parts[1]] = value
        elif key[7:].lower() in _TOP:
            data[key[7:].lower()] = value
        # any other PVEGPU_* (PVEGPU_DEBUG, a script's own variable) is not a setting: left alone
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        sec, _, key = dotted.rpartition(".")
        (data.setdefault(sec, {}) if sec else data)[key] = value
    old = _old_threshold(data, problems)
    s = Settings()
    top = {k: v for k, v in data.items() if k not in _SECTIONS}
    s = _apply(s, top, "", problems)
    for sec, cls in _SECTIONS.items():
        raw = data.get(sec, {})
        if not isinstance(raw, dict):
            problems.append(f"[{sec}] must be a table")
            continue
        s = replace(s, **{sec: _apply(cls(), raw, sec + ".", problems)})
    _validate(s, problems)
    if old:
        problems = [p.replace("leftover.threshold_mib:", f"leftover.threshold_mib (given as {old}):") for p in problems]
    if problems:
        raise ConfigError(f"invalid settings ({len(problems)} problem(s)): " + "; ".join(problems),
                          f"fix the option given on the command line, {path} or the PVEGPU_* variables; see README 'Settings'")
    return s
