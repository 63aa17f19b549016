"""The start gate: may a guest start now onto its GPUs? The hookscript's decision and ``pvegpu check``'s.

``decide`` judges a container (``evaluate`` gathers the facts through the ports, ``decide`` is pure); ``vm``
judges a VM's passed-through devices (``vm_verdict``). The hookscript's entry is ``pvegpu.cli.hook``.
"""

from pvegpu.gate.decide import CheckResult, GateDecision, GatePolicy, GatePorts, GateState, evaluate, paragraph
from pvegpu.gate.vm import vm_verdict

__all__ = ["CheckResult", "GateDecision", "GatePolicy", "GatePorts", "GateState", "evaluate", "paragraph", "vm_verdict"]
