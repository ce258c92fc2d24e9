"""More shapes users ship that the other tests do not build (bench/unseen_shapes.py, small and with
random weights here): onnxruntime's static QDQ quantizer with 16-bit activations (opset 21) and
with 4-bit weights (com.microsoft QuantizeLinear / DequantizeLinear over int4 initializers); a
decoder on com.microsoft GroupQueryAttention (rotary inside, fewer key/value heads; also through
onnxruntime's float16 converter, which leaves the graph unsorted, and with MatMulNBits) and one on
RotaryEmbedding + MultiHeadAttention, both with SkipSimplifiedLayerNormalization, the second also
over onnx's per-tensor external files; a BERT as onnxruntime's optimizer fuses it
(EmbedLayerNormalization, Attention with packed QKV weights, SkipLayerNormalization, BiasGelu);
opset 23 storage forms (int4 blocks, float8 e4m3fn, bfloat16); weights inside Scan / Loop bodies;
a weight read by two nodes that is also a graph output, at IR 8 and at IR 3.
Every public path runs on each and gives a model that checks and runs, or one clear error.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import passes
from unseen_helpers import check_packed_sessions, folder_digest as _digest, restored_digest, run_outputs as _run
from unseen_helpers import same_outputs as _same, worst_output_snr as _snr
from passes.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import unseen_shapes as shapes  # noqa: E402

SMALL = dict(hidden=64, ffn=128, vocab=256, layers=2)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16




@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (model path, feeds): each model in a folder of its own."""
    root = tmp_path_factory.mktemp("contrib")
    w = shapes.random_weights(seed=0, **SMALL)
    out = {}

    def put(name, model=None, **save):
        folder = root / name
        folder.mkdir()
        path = folder / f"{name}.onnx"
        if model is not None:
            onnx.save_model(model, str(path), **save)
        return path

    rng = np.random.default_rng(0)
    out["dec_gqa"] = (put("dec_gqa", shapes.contrib_decoder(w, heads=HEADS, kv_heads=KV_HEADS, max_pos=160)),
                      shapes.contrib_feeds(rng, "gqa", 2, vocab=256, layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM))
    mha = shapes.contrib_decoder(w, heads=HEADS, kv_heads=HEADS, attention="mha", max_pos=160)
    mha_feeds = shapes.contrib_feeds(rng, "mha", 2, vocab=256, layers=2, kv_heads=HEADS, head_dim=HEAD_DIM)
    gqa, gqa_feeds = out["dec_gqa"]
    gqa = onnx.load(str(gqa))
    out["dec_gqa16"] = (put("dec_gqa16", shapes.float16_keep_io(gqa)), gqa_feeds)
    out["dec_gqa_nbits"] = (put("dec_gqa_nbits", shapes.matmul_nbits(gqa)), gqa_feeds)
    out["dec_mha"] = (put("dec_mha", mha), mha_feeds)
    out["dec_mha_pertensor"] = (put("dec_mha_pertensor", mha, save_as_external_data=True,
                                    all_tensors_to_one_file=False, size_threshold=64), mha_feeds)
    out["bert_fused"] = (put("bert_fused", shapes.bert_fused(w, heads=HEADS, max_pos=128)),
                         shapes.bert_feeds(rng, 2, vocab=256))
    out["opset23"] = (put("opset23", shapes.opset23()), shapes.opset23_feeds(rng, 2))
    out["loops"] = (put("loops", shapes.loops()), shapes.loops_feeds(rng, 2))
    out["shared_output"] = (put("shared_output", shapes.shared_output()), shapes.shared_feeds(rng, 2))
    out["shared_output_ir3"] = (put("shared_output_ir3", shapes.shared_output(ir3=True)), shapes.shared_feeds(rng, 2))
    # onnxruntime's quantizer on the small optimum-style decoder of test_unseen_decoder
    dec = put("dec_fp32", shapes.decoder(onnx.TensorProto.FLOAT, shapes.random_weights(seed=0), heads=2, max_pos=160))
    sizes = dict(vocab=256, layers=1, heads=2, head_dim=32)
    calibration = shapes.decoder_feeds(np.random.default_rng(1), n=4, **sizes)
    dec_feeds = shapes.decoder_feeds(np.random.default_rng(0), n=2, **sizes)
    for name, act, wt in (("dec_qdq16", "QInt16", "QInt8"), ("dec_qdq_w4", "QUInt8", "QInt4")):
        path = put(name)
        shapes.qdq(dec, path, calibration, activations=act, weights=wt)
        out[name] = (path, dec_feeds)
    return out


FLOAT_MODELS = ["dec_gqa", "dec_gqa16", "dec_gqa_nbits", "dec_mha", "dec_mha_pertensor", "bert_fused", "opset23", "loops", "shared_output",
                "shared_output_ir3"]


def test_the_shapes_are_what_they_claim(made):
    def ops(name):
        m = onnx.load(str(made[name][0]), load_external_data=False)
        return {(n.domain, n.op_type) for g in [m.graph] for n in g.node}, m

    got, _ = ops("dec_gqa")
    assert {("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "SkipSimplifiedLayerNormalization")} <= got
    # the converter's input Casts come after their readers: onnx.checker refuses the model, onnxruntime
    # runs it; quantize_weights sorts it (test_every_path checks its output with full_check)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(str(made["dec_gqa16"][0]))
    got, _ = ops("dec_gqa_nbits")
    assert ("com.microsoft", "MatMulNBits") in got and ("com.microsoft", "GroupQueryAttention") in got
    got, _ = ops("dec_mha")
    assert {("com.microsoft", "MultiHeadAttention"), ("com.microsoft", "RotaryEmbedding")} <= got
    _, m = ops("dec_mha_pertensor")
    locations = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert len(locations) >= 10
    got, _ = ops("bert_fused")
    assert {("com.microsoft", op) for op in ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization",
                                             "BiasGelu")} <= got
    _, m = ops("opset23")
    types = {t.data_type for t in m.graph.initializer}
    assert {onnx.TensorProto.INT4, onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.BFLOAT16} <= types
    _, m = ops("dec_qdq16")
    assert m.opset_import[0].version == 21
    assert onnx.TensorProto.INT16 in {t.data_type for t in m.graph.initializer}
    _, m = ops("dec_qdq_w4")
    assert any(n.domain == "com.microsoft" and n.op_type == "DequantizeLinear" for n in m.graph.node)
    assert onnx.TensorProto.INT4 in {t.data_type for t in m.graph.initializer}
    _, m = ops("shared_output_ir3")
    assert m.ir_version == 3 and {"shared_w", "bias"} <= {i.name for i in m.graph.input}


@pytest.mark.parametrize("name", FLOAT_MODELS)
def test_every_path(made, name, tmp_path):
    src, feeds = made[name]
    before = _digest(src.parent)
    ref = _run(src, feeds)
    q8 = passes.quantize_weights(str(src))
    onnx.checker.check_model(q8, full_check=True)
    assert [o.name for o in q8.graph.output] == [o.name for o in onnx.load(str(src), load_external_data=False).graph.output]
    assert _snr(ref, _run(q8, feeds)) >= 28
    q4 = passes.quantize_weights(str(src), bits=4, granularity="block", block_size=32)
    onnx.checker.check_model(q4, full_check=True)
    assert _snr(ref, _run(q4, feeds)) >= 8
    for dtype in (None, "float16", "float32"):
        f = passes.fold_dequantize(q8, dtype=dtype)
        onnx.checker.check_model(f, full_check=True)
        assert _snr(ref, _run(f, feeds)) >= 28
    # lossless: every file back byte for byte (onnx's per-tensor layout too)
    assert restored_digest(src, tmp_path) == before
    # the pack's sessions; fold mode runs what fold_dequantize writes, output for output
    check_packed_sessions(q8, ref, feeds, tmp_path, 28, snr=_snr)
    assert _snr(ref, _run(passes.InferenceSession(str(tmp_path / "f.onnxz"), mode="int8"), feeds)) >= 28
    # evaluate pools every output: no lower than the worst one's SNR
    assert passes.evaluate(str(src), q8, feeds=feeds).metrics["snr"] >= _snr(ref, _run(q8, feeds)) - 0.01
    assert _digest(src.parent) == before  # inputs never modified, nothing left beside them


@pytest.mark.parametrize("name", ["dec_gqa", "bert_fused", "opset23"])
def test_compress_to_a_target(made, name):
    src, feeds = made[name]
    model, _ = passes.compress(str(src), target="snr>=25", feeds=feeds)
    onnx.checker.check_model(model, full_check=True)
    assert passes.evaluate(str(src), model, feeds=feeds).metrics["snr"] >= 25 - 1e-9
    model, rep = passes.compress(str(src), target="snr>=25")  # synthesised feeds
    onnx.checker.check_model(model, full_check=True)
    assert rep["synthesized_feeds"]


@pytest.mark.parametrize("name", ["dec_qdq16", "dec_qdq_w4"])
def test_quantized_models_stay_as_they_are(made, name, tmp_path):
    """16-bit activations / 4-bit weights from onnxruntime's quantizer: nothing is quantized again,
    fold folds the weights' DequantizeLinear only, and the folded model runs exactly as the model does (with onnxruntime's optimizer off: with it
    on, onnxruntime itself computes the int16 model ~40 dB away from its plain reading)."""
    src, feeds = made[name]
    m = onnx.load(str(src))
    rep = passes.Report()
    q = passes.quantize_weights(m, report=rep)
    onnx.checker.check_model(q, full_check=True)
    assert not [t for t in rep.tensors if t.bytes_after != t.bytes_before]
    plain = _run(m, feeds, optimize=False)
    f = passes.fold_dequantize(m)
    onnx.checker.check_model(f, full_check=True)
    assert _same(plain, _run(f, feeds, optimize=False))
    # every weight's DequantizeLinear folded (com.microsoft's too: aa47c3e), the activations' left
    weights = {t.name for t in m.graph.initializer}
    assert not [n for n in f.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights]
    assert sum(n.op_type == "QuantizeLinear" for n in f.graph.node) == sum(n.op_type == "QuantizeLinear" for n in m.graph.node)
    z = tmp_path / "q.onnxz"
    passes.pack(str(src), str(z))
    assert passes.load(str(z)).SerializeToString() == src.read_bytes()
    ref = _run(m, feeds)
    for mode in ("fold", "int8", "auto"):
        assert _snr(ref, _run(passes.InferenceSession(str(z), mode=mode), feeds)) >= 35, mode


def test_bfloat16_inputs_get_one_clear_error(made, tmp_path, capsys):
    """onnxruntime's numpy API can neither feed nor return bfloat16: weights-only paths work, the
    paths that must run the model name the input."""
    from tools.surgeon_compress import main

    src = tmp_path / "bf16io.onnx"
    onnx.save(shapes.opset23(bfloat16_io=True), str(src))
    q = passes.quantize_weights(str(src))
    onnx.checker.check_model(q, full_check=True)
    with pytest.raises(InvalidArgumentError, match="'xb'.*BFLOAT16"):
        passes.compress(str(src), target="snr>=25")
    qpath = tmp_path / "q.onnx"
    assert main(["compress", str(src), "-o", str(qpath)]) == 0
    capsys.readouterr()
    assert main(["eval", str(src), str(qpath)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'xb'" in err[0] and "Traceback" not in err[0]
