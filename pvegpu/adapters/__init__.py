"""Adapters: the only modules that touch NVML, the Proxmox API, /proc, cgroups and signals."""
