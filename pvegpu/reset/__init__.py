"""``pvegpu reset`` for a container: stop its GPU holders, verify the memory is back, restart it if not.

The face of the package (structlog's style): import from here. The modules, one decision each:
``targets`` (who is signalled with what, who is spared: the one rule, pure), ``find`` (locate the CT, first
reading, the dry-run plan), ``stop`` (signal rounds), ``verify`` (clean held for the settle window, by
``leftover.leftover``), ``restart`` (the API fallback), ``follow`` (the one loop following the CT's state; ``poll.until`` its shape, shared with VM resets),
``interruption`` (how a signalled reset ended), ``diagnosis`` (why not clean, what to do), ``conclude`` (the only
exit-code table), ``machine`` (the state machine that runs the phases), ``results`` (what the phases return),
``vocab`` (the closed vocabularies), ``run`` (what one run shares), ``report`` (policy, outcome, report, ports).
"""

from __future__ import annotations

from pvegpu.core.model import ProcIdentity
from pvegpu.reset.diagnosis import diagnose
from pvegpu.reset.machine import reset
from pvegpu.reset.report import Ports, ResetOutcome, ResetPolicy, ResetReport
from pvegpu.reset.targets import KillNow, Spared, Targets, targets
from pvegpu.reset.verify import is_clean
from pvegpu.reset.vocab import Diagnosis, Kind

__all__ = ["Diagnosis", "Kind", "KillNow", "Ports", "ProcIdentity", "ResetOutcome", "ResetPolicy", "ResetReport", "Spared", "Targets", "diagnose",
           "is_clean", "reset", "targets"]
