"""pvegpu: verified GPU reclaim, start gate and audit for Proxmox VE LXC containers."""

__version__ = "0.4.0"
