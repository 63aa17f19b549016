"""The test doubles live in ``pvegpu.testing`` (public, documented); this module re-exports them for the tests."""

from __future__ import annotations

from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakeProc, FakePve, FdBackedProbe

__all__ = ["FakeClock", "FakeHost", "FakeProbe", "FakeProc", "FakePve", "FdBackedProbe"]
