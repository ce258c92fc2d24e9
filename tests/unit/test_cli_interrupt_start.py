"""Ctrl-C while the command starts: before main() catches it (this module's own definitions loading) and
while it imports its extension modules, the command says one line and exits 130, never a traceback,
a crash or an internal error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tools import surgeon_compress as cli
from tools.surgeon_compress import main

from conftest import REPO


@pytest.mark.parametrize("launcher", ["surgeon-compress", "surgeon-compress-script.py"])
def test_an_interrupt_before_main_runs_exits_130_with_one_line(tmp_path, launcher):
    """The console script imports this module and then calls main(): a KeyboardInterrupt reaching the
    top level in between (as one arriving while the module's definitions load does) printed Python's
    traceback."""
    script = tmp_path / launcher
    script.write_text(textwrap.dedent("""
        import sys
        from tools.surgeon_compress import main
        raise KeyboardInterrupt
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "surgeon-compress: interrupted"


def test_importing_the_module_elsewhere_leaves_the_excepthook_alone(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys, tools.surgeon_compress; "
                           "print(sys.excepthook is sys.__excepthook__)"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "True", done.stderr


@pytest.fixture
def interrupting_module(tmp_path, monkeypatch):
    """A module whose import receives SIGINT half way and then finishes (records that it did)."""
    (tmp_path / "slow_extension_like.py").write_text(textwrap.dedent("""
        import os, signal
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        FINISHED = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "slow_extension_like"
    sys.modules.pop("slow_extension_like", None)


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="SIGINT has another handler in this test process")
def test_an_interrupt_while_importing_is_held_until_the_module_is_in(interrupting_module):
    assert cli._interrupted_while_importing([interrupting_module]) is True
    assert sys.modules[interrupting_module].FINISHED  # not cut in half
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="SIGINT has another handler in this test process")
def test_the_command_stops_quietly_when_interrupted_while_importing(interrupting_module, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_heavy_modules", lambda args: [interrupting_module])
    code = main(["info", str(tmp_path / "absent.onnx")])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip() == "surgeon-compress: interrupted"
