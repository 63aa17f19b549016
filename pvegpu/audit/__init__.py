"""``pvegpu audit``: which guest holds which GPU, now and by configuration, for a person and for monitoring.

``run`` gathers one node's facts into rows (``audit_once``, ``audit_document``); ``model`` holds the rows and
flags; ``guests`` reads the guests' configs and processes; ``render`` writes the 80-column table, ``prom`` the
Prometheus textfile, ``cluster`` merges other nodes' answers (read as untrusted).
"""

from pvegpu.audit.run import audit_document, audit_once, run_audit

__all__ = ["audit_document", "audit_once", "run_audit"]
