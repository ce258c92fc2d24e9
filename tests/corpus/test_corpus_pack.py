"""Every corpus model packs to `.onnxz` and unpacks sha256-identical; lazy tensors match onnx's.

Time-bounded: one pack and one unpack per model (~1 minute for the whole corpus on 2 cores), and
the tensor comparison only on the small models.
"""
from __future__ import annotations

import hashlib

import onnx
import pytest
from onnx import numpy_helper

import passes

NAMES = ["open_nsfw", "minilm_fp32", "minilm_int8", "ddddocr_old", "silero_vad_v6", "rapidocr_cls",
         "piper_joe", "open_nsfw_fp16", "minilm_fp16"]


def _sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@pytest.mark.parametrize("name", NAMES)
def test_corpus_model_round_trip(corpus, tmp_path, name):
    src = corpus.model(name)
    packed = tmp_path / f"{name}.onnxz"
    stats = passes.pack(src, packed, threads=2)
    assert stats.original_bytes == src.stat().st_size
    # weights compress: every corpus model packs below 92% of its size (zip -9 gets 86-93%)
    assert stats.packed_bytes < 0.92 * stats.original_bytes, stats.to_dict()
    out = passes.unpack(packed, tmp_path / f"{name}.onnx", threads=2)
    assert _sha(out) == _sha(src)


@pytest.mark.parametrize("name", ["silero_vad_v6", "rapidocr_cls", "ddddocr_old"])
def test_corpus_tensors_lazily(corpus, tmp_path, name):
    """get_tensor gives exactly what onnx reads, for every tensor (Constant nodes in subgraphs too)."""
    from onnx.external_data_helper import _get_all_tensors

    src = corpus.model(name)
    packed = tmp_path / f"{name}.onnxz"
    passes.pack(src, packed)
    model = onnx.load(src)
    with passes.open_packed(packed) as pm:
        got = {pm.get_tensor(k).tobytes() for k in pm.keys()}
        assert len(pm.keys()) == len(set(pm.keys()))
    want = [numpy_helper.to_array(t) for t in _get_all_tensors(model)]
    missing = [a.shape for a in want if a.dtype != object and a.tobytes() not in got]
    assert not missing
    assert passes.verify(packed, against=src).ok
    assert passes.load(packed).SerializeToString() == src.read_bytes()
