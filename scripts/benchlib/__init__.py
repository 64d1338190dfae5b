"""Helpers for ``scripts/bench.py``: the checkpoint generator (``gen``), process and page-cache utilities
(``sysutil``), the mount wrapper (``mount``), the individual measurements (``measure``, ``probes``) and the
PASS/FAIL report (``report``). Only the project's own dependencies are used."""
