"""Shared fixtures: the real-model corpus, the sample models in models/.

The corpus (real models + real feeds) lives in ../shared/corpus beside the repository, or in
/work/shared/corpus; $SURGEON_CORPUS overrides both. Tests that need it use the `corpus`
fixture: they skip when it is absent, except under CI (env CI=true), where a missing corpus is a
failure, not a silent pass. A corpus model file that is missing is fetched once with the
corpus's own fetch.py (packages cached in ~/.cache/onnx-corpus).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail(reason: str):
    """Skip locally; fail under CI, where every test is meant to run."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: required)", pytrace=False)
    pytest.skip(reason)


def find_corpus() -> Path | None:
    candidates = []
    if os.environ.get("SURGEON_CORPUS"):
        candidates.append(Path(os.environ["SURGEON_CORPUS"]))
    candidates += [REPO.parent / "shared" / "corpus", Path("/work/shared/corpus")]
    for c in candidates:
        if (c / "MANIFEST.json").is_file():
            return c
    return None


class Corpus:
    """The corpus folder and its MANIFEST.json entries."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = {e["name"]: e for e in json.loads((path / "MANIFEST.json").read_text())}
        self._fetch_tried = False

    def names(self, metric: str | None = None, float_weights: bool | None = None) -> list[str]:
        out = []
        for name, e in self.entries.items():
            if metric is not None and e.get("metric") != metric:
                continue
            if float_weights is not None:
                has_float = any(k.startswith(("float", "bfloat")) and v > 1000 for k, v in e.get("dtypes", {}).items())
                if has_float != float_weights:
                    continue
            out.append(name)
        return out

    def entry(self, name: str) -> dict:
        if name not in self.entries:
            skip_or_fail(f"corpus has no entry {name!r}")
        return self.entries[name]

    def model(self, name: str) -> Path:
        """Path of the entry's .onnx, fetched once with fetch.py when missing."""
        path = self.path / self.entry(name)["file"]
        if not path.exists():
            self._fetch()
        if not path.exists():
            skip_or_fail(f"corpus model {path} is missing (run {self.path / 'fetch.py'})")
        return path

    def feeds(self, name: str) -> Path:
        path = self.path / self.entry(name)["feeds"]
        if not path.exists():
            skip_or_fail(f"corpus feeds {path} are missing")
        return path

    def metric(self, name: str) -> tuple[str, dict]:
        e = self.entry(name)
        return e.get("metric"), dict(e.get("metric_args") or {})

    def _fetch(self) -> None:
        fetch = self.path / "fetch.py"
        if self._fetch_tried or not fetch.exists():
            return
        self._fetch_tried = True
        subprocess.run([sys.executable, str(fetch)], cwd=self.path, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)


_CORPUS: Corpus | None = None


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    """The real-model corpus; skips the test when absent (fails under CI=true)."""
    global _CORPUS
    if _CORPUS is None:
        path = find_corpus()
        if path is None:
            skip_or_fail("real-model corpus not found (../shared/corpus, /work/shared/corpus or $SURGEON_CORPUS)")
        _CORPUS = Corpus(path)
    return _CORPUS


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """models/ of this repository: small real models with feeds, always present."""
    return MODELS


@pytest.fixture(scope="session")
def sample_model() -> Path:
    """A small real float32 model (weights in Constant nodes) with feeds: models/rapidocr_cls.onnx."""
    return MODELS / "rapidocr_cls.onnx"


@pytest.fixture(scope="session")
def sample_model_fp16() -> Path:
    return MODELS / "rapidocr_cls_fp16.onnx"


@pytest.fixture(scope="session")
def sample_feeds() -> Path:
    return MODELS / "rapidocr_cls_feeds.npz"
