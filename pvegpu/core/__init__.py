"""The pure core: facts and decisions, no I/O (``tests/test_structure.py`` keeps it so).

``model`` (the vocabulary: GPUs, processes, holders), ``errors`` (every error with its exit code and hint),
``ports`` (the narrow interfaces the adapters implement), ``settings`` (every setting and its default),
``holders`` (who holds which GPU, dead listed pids and their heirs), ``leftover`` (the one rule for what is
left), ``locate`` (a guest and its GPUs), ``lxcconf`` and ``qemuconf`` (PVE's config grammars), ``cgroup``
(placement from ``/proc/<pid>/cgroup`` text), ``deadline``, ``units``, ``contract`` (the JSON documents and
their one writer), ``safetext`` and ``textfit`` (escaping and fitting tenant and remote text).
"""
