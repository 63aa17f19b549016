"""The one leftover rule and its settings: allowance only for live contexts outside the target, old keys."""

from __future__ import annotations

import pytest

from pvegpu.adapters.settingsfile import load
from pvegpu.core.errors import ConfigError
from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import LeftoverRule, leftover
from pvegpu.core.model import MIB, GpuInfo, GpuSample
from pvegpu.wiring import gate_policy, leftover_rule, reset_policy

GPU = GpuInfo(0, 0, "GPU-0", "0000:41:00.0")


def facts(used_mib: float, foreign_mib: float = 0, outside: int = 0, target_mib: float = 0) -> GpuFacts:
    return GpuFacts(GPU, GpuSample(0, int(used_mib * MIB), ()), foreign_bytes=int(foreign_mib * MIB),
                    ct_listed_bytes=int(target_mib * MIB), contexts_outside=outside)


def test_allowance_covers_outside_contexts_only():
    """32 outside contexts' gap (188 MiB) is allowed; the same gap with no outside context (the target's own, or a
    leak on an idle GPU) is over the threshold: no flat allowance."""
    rule = LeftoverRule()
    assert not leftover(facts(32 * 1024 + 188, 32 * 1024, outside=32), rule).over
    assert leftover(facts(188), rule).over and leftover(facts(4096 + 9, target_mib=4096), rule).over
    lo = leftover(facts(32 * 1024 + 188 + 200, 32 * 1024, outside=32), rule)
    assert lo.over and lo.allowance_bytes == 32 * rule.per_context_bytes


def test_unknown_is_never_zero():
    """A GPU whose other processes' memory is not reported has an unknown leftover, not 0."""
    f = facts(100)
    f.foreign_bytes = None
    lo = leftover(f, LeftoverRule())
    assert not lo.known and lo.net_bytes is None


def test_one_setting_feeds_reset_gate_and_audit(tmp_path):
    """[leftover] threshold_mib and per_context_mib reach reset, the gate and audit alike."""
    cfg = tmp_path / "s.toml"
    cfg.write_text("[leftover]\nthreshold_mib = 100\nper_context_mib = 7.5\n")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    s = load(str(cfg), env={})
    want = LeftoverRule(100 * MIB, int(7.5 * MIB))
    assert leftover_rule(s) == want == reset_policy(s).rule == gate_policy(s).rule


@pytest.mark.parametrize("text", ["[reset]\nthreshold_mib = 80\n", "[gate]\nthreshold_mib = 80\n",
                                  "[reset]\nthreshold_mib = 80\n[gate]\nthreshold_mib = 80\n"])
def test_old_threshold_keys_keep_working(tmp_path, text):
    """reset.threshold_mib / gate.threshold_mib still set the one threshold."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(text)
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    assert load(str(cfg), env={}).leftover.threshold_mib == 80


def test_old_threshold_keys_that_disagree_are_an_error(tmp_path):
    """Two different old thresholds (they used to be two rules) are one clear settings error naming the new key."""
    cfg = tmp_path / "s.toml"
    cfg.write_text("[reset]\nthreshold_mib = 80\n[gate]\nthreshold_mib = 64\n")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError) as exc:
        load(str(cfg), env={})
    assert exc.value.exit_code == 2 and "leftover.threshold_mib" in exc.value.message


def test_host_users_setting_is_checked(tmp_path):
    """gate.host_users is share (default) or refuse; anything else is a settings error."""
    cfg = tmp_path / "s.toml"
    cfg.write_text('[gate]\nhost_users = "maybe"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError):
        load(str(cfg), env={})
    cfg.write_text("")
    assert gate_policy(load(str(cfg), env={})).host_users == "share"
