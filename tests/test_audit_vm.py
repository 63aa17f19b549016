"""VMs in the audit: hostpciN ids and mapping= (pci.cfg, this node), the driver bound in sysfs, matching to NVML GPUs by bus id."""

from __future__ import annotations

import os

from pvegpu.adapters.nodefiles import LocalNodeFiles
from pvegpu.audit.run import run_audit
from pvegpu.core.model import Guest
from pvegpu.core.qemuconf import normalize_bus_id, parse_hostpci, parse_pci_mapping, same_device
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve
from tests.test_audit import NODES, FakeFiles

PCI_CFG = """rtx4090
\tmap node=pve1,path=0000:41:00.0,id=10de:2684,iommugroup=14
\tmap node=pve2,path=0000:81:00.0;0000:82:00.0,id=10de:2684
\tdescription 4090 pool

nic
\tmap node=pve1,path=0000:05:00.0,id=8086:1572
"""


def test_hostpci_forms():
    """Raw ids (short, with domain, ';' alternatives), host=, mapping=, driver=keep, mdev; pending/snapshot sections ignored."""
    conf = ("name: win\nhostpci0: 02:00,pcie=on,x-vga=on\nhostpci1: host=0000:41:00.0;0000:42:00.0,rombar=0\n"
            "hostpci2: mapping=rtx4090,pcie=1\nhostpci3: 0000:43:00.0,driver=keep,mdev=nvidia-42\n[pve:pending]\nhostpci4: 44:00.0\n")
    e = parse_hostpci(conf)
    assert [x.key for x in e] == ["hostpci0", "hostpci1", "hostpci2", "hostpci3"]
    assert e[0].ids == ("02:00",) and e[1].ids == ("0000:41:00.0", "0000:42:00.0") and e[2].mapping == "rtx4090" and e[2].ids == ()
    assert (e[3].driver, e[3].mdev, e[0].driver) == ("keep", "nvidia-42", "vfio")


def test_bus_ids_normalised_and_function_optional():
    """'41:00' names every function of 0000:41:00; NVML's 8-digit domain matches PVE's 4-digit one; junk is None."""
    assert normalize_bus_id("41:00") == "0000:41:00.*" and normalize_bus_id("00000000:41:00.0") == "0000:41:00.0"
    assert same_device("41:00", "00000000:41:00.0") and same_device("0000:41:00.0", "0000:41:00.0")
    assert not same_device("41:00.1", "0000:41:00.0") and normalize_bus_id("mapping=x") is None


def test_pci_mapping_resolved_for_this_node_only():
    """pci.cfg maps ids to this node's paths; another node's paths are not used here."""
    assert parse_pci_mapping(PCI_CFG, "pve1") == {"rtx4090": ("0000:41:00.0",), "nic": ("0000:05:00.0",)}
    assert parse_pci_mapping(PCI_CFG, "pve2")["rtx4090"] == ("0000:81:00.0", "0000:82:00.0")


def test_sysfs_driver_and_vendor_read_from_a_real_tree(tmp_path):
    """LocalNodeFiles reads the bound driver from the driver symlink: vfio-pci, none bound (''), no device (None)."""
    devs = tmp_path / "bus" / "pci" / "devices"
    drivers = tmp_path / "bus" / "pci" / "drivers"
    for bus, drv in (("0000:41:00.0", "vfio-pci"), ("0000:42:00.0", None)):
        (devs / bus).mkdir(parents=True)
        (devs / bus / "vendor").write_text("0x10de\n")
        if drv:
            (drivers / drv).mkdir(parents=True, exist_ok=True)
            os.symlink(drivers / drv, devs / bus / "driver")
    files = LocalNodeFiles(str(tmp_path / "etc-pve"), sysfs=str(tmp_path))
    assert files.pci_driver("0000:41:00.0") == "vfio-pci" and files.pci_driver("0000:42:00.0") == ""
    assert files.pci_driver("0000:99:00.0") is None and files.pci_vendor("0000:41:00.0") == "0x10de"
    assert files.pci_vendor("0000:99:00.0") is None


def _vm_node(conf: str):
    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host, (0,)), FakePve(host)
    pve.guests_[200] = Guest(200, "pve1", "qemu")
    return host, probe, pve


def test_vfio_bound_gpu_is_shown_as_passed_through_not_missing():
    """A mapping= GPU bound to vfio-pci is a passthrough row naming the VM and saying NVML cannot see it; NICs are left out."""
    conf = "name: win11\nhostpci0: mapping=rtx4090,pcie=1\nhostpci1: mapping=nic\n"
    host, probe, pve = _vm_node(conf)
    files = FakeFiles(NODES, pve={"nodes/pve1/qemu-server/200.conf": conf, "mapping/pci.cfg": PCI_CFG},
                      pci={"0000:41:00.0": ("vfio-pci", "0x10de"), "0000:05:00.0": ("i40e", "0x8086")})
    rep = run_audit(pve=pve, probe=probe, host=host, files=files)
    (p,) = rep.passthrough
    assert (p.vmid, p.bus_id, p.mapping, p.driver) == (200, "0000:41:00.0", "rtx4090", "vfio-pci")
    assert "host NVML cannot see it" in p.note and not rep.attention
    (g,) = rep.guests
    assert (g.id, g.name, g.bus_ids) == ("qemu/200", "win11", ("0000:41:00.0",))  # the NIC is not the audit's business


def test_gpu_still_on_the_host_driver_is_granted_to_the_vm_by_bus_id():
    """A GPU NVML sees whose bus id a VM's hostpci names (function omitted) lists the VM among those configured for it."""
    conf = "hostpci0: 00:00,pcie=1\n"  # FakeProbe's GPU 0 is 0000:00:00.0
    host, probe, pve = _vm_node(conf)
    files = FakeFiles(NODES, pve={"nodes/pve1/qemu-server/200.conf": conf}, pci={"0000:00:00.0": ("nvidia", "0x10de")})
    rep = run_audit(pve=pve, probe=probe, host=host, files=files)
    assert rep.gpus[0].granted_to == ["qemu/200"] and "bound to vfio-pci when VM 200 starts" in rep.passthrough[0].note


def test_mapping_without_a_device_on_this_node_is_noted():
    """A mapping with no path for this node is a note on the VM row, not a crash or a silent gap."""
    conf = "hostpci0: mapping=gone\n"
    host, probe, pve = _vm_node(conf)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES, pve={"nodes/pve1/qemu-server/200.conf": conf}))
    assert rep.guests[0].notes == ("hostpci0: mapping gone has no device on pve1",) and rep.passthrough == []
