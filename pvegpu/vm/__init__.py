"""VMs with a GPU passed through (``hostpci``, vfio-pci): the reset inside the guest, through its guest agent.

``guest`` reads what the guest says (its ``nvidia-smi`` and process scan, as untrusted text); ``reset`` runs the
procedure (locate, signal, verify from looks begun after the signals, reboot through the API when needed).
"""

from pvegpu.vm.reset import VmOutcome, VmPolicy, VmReport, reset_vm

__all__ = ["VmOutcome", "VmPolicy", "VmReport", "reset_vm"]
