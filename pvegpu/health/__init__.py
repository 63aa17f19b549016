"""GPU health: the Xid catalogue, the kernel log's events per GPU and the verdict gate, audit and reset share.

``judge(health, events, bus_id)`` -> ``Verdict`` (``ok`` / ``needs-gpu-reset`` / ``needs-reboot`` / ``lost`` /
``unknown``); the rule is in ``health.judge``, the catalogue in ``health.catalogue``, the kernel log's formats in
``health.kernlog``. Pure: the reading is ``adapters/kernlog.py``'s (a ``core.ports.KernelLog``).
"""

from pvegpu.health.catalogue import XIDS, Need, classify, describe, recovery_need
from pvegpu.health.judge import REFUSING, State, Verdict, judge, xid_text
from pvegpu.health.kernlog import KernelEvents, Record, ResetEvent, XidEvent, bus_key, events, parse_lines, parse_record, reset_record

__all__ = ["REFUSING", "XIDS", "KernelEvents", "Need", "Record", "ResetEvent", "State", "Verdict", "XidEvent", "bus_key", "classify",
           "describe", "events", "judge", "parse_lines", "parse_record", "recovery_need", "reset_record", "xid_text"]
