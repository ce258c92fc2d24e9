"""InferenceSession(mode="fold") folds the float16 Cast+Mul level patterns of files written before
1de3b35 (onnxruntime cannot: no float16 Mul CPU kernel), as fold_dequantize folds them."""
import os

import onnx
import onnxruntime as ort

import passes
from modelgen import dense_model, feeds
from test_cast_levels import _float16_mul_form


def _optimized_ops(path, tmp_path, **kw):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = os.path.join(tmp_path, "optimized.onnx")
    session = passes.InferenceSession(str(path), so, mode="fold", **kw)
    return session, [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


def test_old_float16_cast_mul_levels_fold_at_load(tmp_path):
    q = passes.quantize_weights(dense_model(dtype="float16"), bits=8, min_elements=16)
    old = _float16_mul_form(q, {"W2", "W3"})  # Cast(levels -> FLOAT16) * float16 scale
    (tmp_path / "old.onnx").write_bytes(old.SerializeToString())
    passes.pack(str(tmp_path / "old.onnx"), str(tmp_path / "old.onnxz"))
    x = feeds(old, n=1)[0]
    reference = ort.InferenceSession(passes.fold_dequantize(old).SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, x)
    for name in ("old.onnx", "old.onnxz"):
        session, ops = _optimized_ops(tmp_path / name, tmp_path)
        assert "Mul" not in ops, (name, ops)  # (before: two float16 Mul nodes ran at every inference)
        got = session.run(None, x)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, reference)), name
