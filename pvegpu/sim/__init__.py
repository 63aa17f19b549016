"""A simulated Proxmox node: a state directory that looks like ``/etc/pve`` plus simulated NVML,
simulated API power actions, and real child processes standing in for container workloads.

The production code runs against it unchanged: the ``/etc/pve`` reader, the ``/proc`` fd scan (matched by
device number, with a stand-in character device per GPU), pidfd signals and the reset state machine.
Only three things are simulated: NVML (``SimNvml``), the API's stop/start (``SimPve``) and the
container boundary, which is a process session (``SessionHost``) instead of a cgroup.
See ``pvegpu.sim.scenario`` for the scenario format.
"""
