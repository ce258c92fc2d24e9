"""onnxz reader: the cyclic GC hold of open/unpack is shared by concurrent callers and never
leaves the collector off."""
import gc
import threading
import types

import pytest

from passes.onnxz import reader


@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_gc_stays_off_until_the_last_holder_leaves(gc_on):
    a, b = reader._gc_held(), reader._gc_held()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert not gc.isenabled()  # b still holds it
    b.__exit__(None, None, None)
    assert gc.isenabled()


def test_gc_back_on_when_another_thread_leaves_between_check_and_disable(gc_on, monkeypatch):
    # thread A holds the GC off; thread B reads isenabled() (False) and, before B disables,
    # A leaves and enables: a per-call was/disable pair then left the collector off for good
    a = reader._gc_held()
    a.__enter__()
    calls = []

    def isenabled():
        state = gc.isenabled()
        calls.append(state)
        leave = threading.Thread(target=a.__exit__, args=(None, None, None))
        leave.start()
        leave.join(timeout=0.5)  # (a lock-holding caller makes it wait: then it leaves later)
        return state

    shim = types.SimpleNamespace(isenabled=isenabled, disable=gc.disable, enable=gc.enable)
    monkeypatch.setattr(reader, "gc", shim)
    b = reader._gc_held()
    b.__enter__()
    b.__exit__(None, None, None)
    monkeypatch.setattr(reader, "gc", gc)
    if not calls:  # B did not read the state (A still held it): A leaves now
        a.__exit__(None, None, None)
    assert gc.isenabled()


def test_gc_left_off_when_the_caller_had_it_off():
    was = gc.isenabled()
    gc.disable()
    try:
        with reader._gc_held():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
