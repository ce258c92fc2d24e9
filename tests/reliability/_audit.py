"""Record every file the process opens while a block runs (Python audit hooks, PEP 578).

The hook is installed once and stays (audit hooks cannot be removed); it only records while a
`recording_opens()` block is active in the calling thread.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

_local = threading.local()
_installed = False


def _hook(event, args):
    if event != "open":
        return
    sink = getattr(_local, "sink", None)
    if sink is None or not args or args[0] is None or isinstance(args[0], int):
        return
    try:
        sink.append(os.path.realpath(os.fsdecode(args[0])))
    except (TypeError, ValueError):
        sink.append(repr(args[0]))


@contextlib.contextmanager
def recording_opens():
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    opened: list[str] = []
    _local.sink = opened
    try:
        yield opened
    finally:
        _local.sink = None


_CODE = (".py", ".pyc", ".so", ".pth", ".json")  # imports (first use of a module) are not data reads
_LIBS = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)})


def outside(opened, folder) -> list[str]:
    """The opened paths that are not inside `folder` (after resolving links), leaving out the
    Python modules and libraries a first import opens."""
    base = os.path.realpath(folder)
    repo = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..")) + os.sep
    return [p for p in opened if p != base and not p.startswith(base + os.sep)
            and not (p.endswith(_CODE) and (p.startswith(_LIBS) or p.startswith(repo)))]
