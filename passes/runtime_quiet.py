"""onnxruntime's intra-op workers kept off a busy CPU while it parses a model we stream to it.

Why: each intra-op worker of a session spins (2**20 pause instructions, then it blocks) as soon as
onnxruntime's session constructor starts the thread pool, before the model is parsed, and again
after each piece of work. Measured on the 2-core host (process CPU to a ready session with
intra_op_num_threads=2): plain open_nsfw float.onnx 124 ms with spinning, 87 ms with
session.intra_op.allow_spinning=0; the worker spins through the parse. For a plain file that
spin has the second core to itself; for a packed file our decode, fold and writer threads need
that core while onnxruntime parses (they feed it), and share it with a worker waiting for work
that cannot come before the parse ends.

onnxruntime's own switches do not fit: allow_spinning=0 holds for the session's life and costs
runs (open_nsfw, 16 corpus feeds x 3, fresh processes: per-feed minimum sum 139 -> 191 ms),
session.force_spinning_stop acts only when a Run() returns, and ep.dynamic.workload_type is read by
execution providers (OpenVINO, Vitis AI), not by the CPU thread pool.

So the threads the session constructor starts are put in SCHED_IDLE (run only on a core nothing
else wants) while the model streams, and put back as they were before onnxruntime initialises
the session (which runs its own work on them). Only where they can be put back: Linux takes a
thread out of SCHED_IDLE only with CAP_SYS_NICE or an RLIMIT_NICE that allows its nice value
(checked first, and tried once on a thread of ours; elsewhere nothing is done). New threads are told apart from ours by being absent
when the stream started and not Python threads; a C thread another library starts during the
parse would wait for an idle core until the parse ends, then be put back too.
Off with SURGEON_IDLE_ORT_WORKERS=0.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("passes.runtime")

CAP_SYS_NICE = 23
_TASKS = "/proc/self/task"
_allowed: list = []  # [bool] once checked


def _can_leave_idle() -> bool:
    """Whether a thread of this process put in SCHED_IDLE can be put back (see the module doc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    if int(line.split()[1], 16) >> CAP_SYS_NICE & 1:
                        return True
                    break
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # (the calling thread's; onnxruntime's inherit it)
        return soft == resource.RLIM_INFINITY or soft >= 20 - nice
    except (OSError, ValueError, AttributeError):
        return False


def idle_workers_enabled() -> bool:
    if os.environ.get("SURGEON_IDLE_ORT_WORKERS", "1") == "0":
        return False
    if not hasattr(os, "SCHED_IDLE") or not os.path.isdir(_TASKS):
        return False
    if not _allowed:
        _allowed.append(_can_leave_idle() and _round_trip())
    return _allowed[0]


def _round_trip() -> bool:
    """Whether a thread of ours goes to SCHED_IDLE and back (once per process, ~0.1 ms): the
    capability read from /proc may be a user namespace's, which the kernel does not honour here."""
    parked = threading.Event()
    probe = threading.Thread(target=parked.wait, name="passes-sched-probe", daemon=True)
    probe.start()
    try:
        os.sched_setscheduler(probe.native_id, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        parked.set()
        return False
    try:
        os.sched_setscheduler(probe.native_id, os.SCHED_OTHER, os.sched_param(0))
        return True
    except OSError:
        return False
    finally:
        parked.set()  # (the probe ends either way; one left idle ends on an idle core)


def _tasks() -> set:
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except (OSError, ValueError):
        return set()


class IdleNewThreads:
    """Threads started after this object was made (and not Python threads) put in SCHED_IDLE by
    `catch`, put back by `restore` (idempotent; called before onnxruntime initialises the session
    and on failure). `catch(settled=True)` is for a point where onnxruntime has read from the
    stream, so its thread pool is complete: nothing is looked for after it. Before that (the
    streaming thread about to wait: the pool may be half made) each call looks again (~20 us)."""

    def __init__(self):
        self._before = _tasks()
        self._idled: list = []  # threads put in SCHED_IDLE
        self._seen: set = set()
        self._lock = threading.Lock()
        self.caught = False

    def catch(self, settled: bool = False) -> None:
        if self.caught:
            return
        new = _tasks() - self._before
        if new:
            new -= {t.native_id for t in threading.enumerate()}
        with self._lock:
            if self.caught:
                return
            self.caught = settled
            for tid in sorted(new - self._seen):
                self._seen.add(tid)
                try:
                    if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                        continue  # (someone chose its policy: left alone)
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                except OSError:  # (ended meanwhile)
                    continue
                self._idled.append(tid)

    def restore(self) -> None:
        with self._lock:
            self.caught = True  # (nothing more is caught after this)
            idled, self._idled = self._idled, []
        for tid in idled:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                pass
            except OSError as exc:  # (checked beforehand; a thread left idle runs only on idle cores)
                log.warning("passes.InferenceSession: could not put onnxruntime's thread %d back from SCHED_IDLE: %s",
                            tid, exc)


def idle_new_threads() -> IdleNewThreads | None:
    """An IdleNewThreads where this is enabled and permitted, else None."""
    return IdleNewThreads() if idle_workers_enabled() else None
