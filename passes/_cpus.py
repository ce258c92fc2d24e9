"""How many CPUs this process may run on: the default worker count of every thread pool."""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs of this process's affinity mask (taskset, a cpuset container), not the host's:
    os.cpu_count() counts every CPU of the machine, and pools that size oversubscribe a process
    held to fewer."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def worker_count(threads) -> int:
    """A `threads=` argument checked (a positive integer), or for None the usable CPUs."""
    if threads is None:
        return usable_cpus()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"threads must be a positive integer, got {threads!r}")
    return threads
