"""The command's code is installed as `surgeon_compress_cli`, not as a top-level `tools` package.

The repository keeps the command in tools/ (the design card's layout); pyproject maps that folder
to a project-specific package name, because a wheel shipping `tools` would clash with any other
project's `tools` in the same site-packages. These tests check the mapping and that the module
works under its installed name (relative imports), without building a wheel.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import MODELS, REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

INSTALLED_NAME = "surgeon_compress_cli"


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_the_wheel_installs_the_command_under_a_project_name():
    config = _pyproject()
    setuptools = config["tool"]["setuptools"]
    assert config["project"]["scripts"]["surgeon-compress"] == f"{INSTALLED_NAME}.surgeon_compress:main"
    assert setuptools["package-dir"] == {INSTALLED_NAME: "tools"}
    packages = setuptools["packages"]
    assert INSTALLED_NAME in packages and not any(p == "tools" or p.startswith("tools.") for p in packages)
    # every package of the library is listed (an explicit list does not find new ones by itself)
    found = sorted(str(p.parent.relative_to(REPO)).replace(os.sep, ".") for p in (REPO / "passes").rglob("__init__.py"))
    assert found == sorted(p for p in packages if p.startswith("passes"))


def test_the_command_runs_under_its_installed_name(tmp_path):
    """The installed layout, imitated: tools/ reachable only as surgeon_compress_cli (a link), and
    the measuring path that imports legacy_opset beside the command runs (a `from tools...` import
    failed there)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / INSTALLED_NAME).symlink_to(REPO / "tools", target_is_directory=True)
    (site / "passes").symlink_to(REPO / "passes", target_is_directory=True)
    out = tmp_path / "o.onnx"
    # (an editable install of the old layout may still map `tools`: not asserted absent here)
    code = f"import sys; from {INSTALLED_NAME}.surgeon_compress import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-P", "-c", code, "compress", str(MODELS / "rapidocr_cls.onnx"),
                             "-o", str(out), "--feeds", str(MODELS / "rapidocr_cls_feeds.npz"), "--require", "snr>=10"],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert out.exists() and "fidelity" in result.stdout


def test_the_command_file_runs_as_a_script():
    """python tools/surgeon_compress.py (no package): the folder's own modules import directly."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "surgeon_compress.py"), "--help"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert "compress" in result.stdout
