"""Helpers shared by the tests of bench/unseen_shapes.py's and bench/unseen_edges.py's models
(test_unseen_decoder, test_unseen_contrib, test_unseen_edges)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnxruntime as ort

import passes


def ort_session(model, optimize=True) -> ort.InferenceSession:
    """A plain CPU onnxruntime session of a model or its path (optimize=False: no graph optimisation)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def run_outputs(model, feeds, optimize=True) -> list[list[np.ndarray]]:
    """The outputs per feed of a model, a path or a passes.InferenceSession."""
    s = model if isinstance(model, passes.InferenceSession) else ort_session(model, optimize)
    return [[np.asarray(o) for o in s.run(None, f)] for f in feeds]


def check_packed_sessions(q8, ref, feeds, work: Path, min_db: float, snr=None) -> None:
    """A quantized model packed into `work`: every InferenceSession mode of the pack within min_db of
    the float outputs `ref` (by `snr`, default worst_output_snr), and mode="fold" running what
    fold_dequantize writes, output for output."""
    snr = snr or worst_output_snr
    qpath, qz = work / "q.onnx", work / "q.onnxz"
    qpath.write_bytes(q8.SerializeToString())
    passes.pack(str(qpath), str(qz))
    for mode in ("fold", "int8", "auto"):
        assert snr(ref, run_outputs(passes.InferenceSession(str(qz), mode=mode), feeds)) >= min_db, mode
    assert same_outputs(run_outputs(passes.InferenceSession(str(qz), mode="fold"), feeds),
                        run_outputs(passes.fold_dequantize(q8), feeds))


def worst_output_snr(ref, out) -> float:
    """Worst output's SNR (dB) over the feeds (runs as lists of outputs per feed); inf when identical."""
    worst = np.inf
    for j in range(len(ref[0])):
        r = np.concatenate([np.asarray(o[j], np.float64).ravel() for o in ref])
        c = np.concatenate([np.asarray(o[j], np.float64).ravel() for o in out])
        assert np.isfinite(c).all()
        noise = float(np.sum((r - c) ** 2))
        if noise:
            worst = min(worst, 10 * np.log10(float(np.sum(r ** 2)) / noise))
    return worst


def same_outputs(a, b) -> bool:
    """Every output of every feed bit-equal."""
    return all(np.array_equal(x, y) for o1, o2 in zip(a, b) for x, y in zip(o1, o2))


def folder_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (a model and its external data)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def restored_digest(src: Path, work: Path) -> dict[str, str]:
    """Pack `src` (with its external data) into `work`, verify the pack against it, unpack it into a
    folder of its own and return that folder's digest (folder_digest), to compare with the source's.
    The pack stays at work / "f.onnxz"."""
    z = work / "f.onnxz"
    passes.pack(str(src), str(z))
    assert passes.verify(str(z), against=str(src))
    back = work / "back" / src.name
    back.parent.mkdir()
    passes.unpack(str(z), str(back))
    return folder_digest(back.parent)
