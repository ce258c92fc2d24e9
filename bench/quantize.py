#!/usr/bin/env python3
"""Benchmark of the quantize and fold passes on the real-model corpus (not a test).

For every corpus model with float weights: original size; size after quantize_weights (int8 per
channel, the defaults) as % of the original; size of onnxruntime's quantize_dynamic(per_channel,
QInt8); fidelity of the int8 model and of the folded model against the original on the model's
feeds with its manifest metric; fold throughput (MB/s of float output), end to end
(fold_dequantize on the ModelProto, protobuf copies included) and kernel only
(forms.dequantize_linear into preallocated arrays); both in CPU seconds of this process (one core;
the numbers stay meaningful on a shared machine).

    python bench/quantize.py [--only NAME ...] [--feeds N] [--bits 8] [--granularity channel]

Prints a table and writes bench/out/quantize.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from passes import Report, fold_dequantize, quantize_weights  # noqa: E402
from passes import forms, graph  # noqa: E402
from passes.fidelity import compute_metrics, load_feeds, run_outputs  # noqa: E402

CORPUS_CANDIDATES = [os.environ.get("SURGEON_CORPUS", ""), str(REPO.parent / "shared" / "corpus"), "/work/shared/corpus"]


def find_corpus() -> Path:
    for c in CORPUS_CANDIDATES:
        if c and (Path(c) / "MANIFEST.json").is_file():
            return Path(c)
    sys.exit("corpus not found (set SURGEON_CORPUS)")


def has_float_weights(entry) -> bool:
    return any(k.startswith(("float", "bfloat")) and v > 100_000 for k, v in entry.get("dtypes", {}).items())


def dynamic_size(path: Path, tmp: Path) -> int | None:
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        out = tmp / "dyn.onnx"
        quantize_dynamic(str(path), str(out), per_channel=True, weight_type=QuantType.QInt8)
        size = out.stat().st_size
        data = tmp / "dyn.onnx.data"
        if data.exists():
            size += data.stat().st_size
        return size
    except Exception as exc:  # report, do not stop the table
        print(f"  quantize_dynamic failed on {path.name}: {str(exc).splitlines()[0][:100]}", file=sys.stderr)
        return None


def kernel_throughput(q: onnx.ModelProto) -> float:
    """MB/s of float output of forms.dequantize_linear over every DQ of `q`, outputs preallocated."""
    weights, graphs = graph.find_weights(q)
    by_name = {w.name: w for w in weights}
    jobs = []
    for info in graphs:
        for node in info.graph.node:
            if node.op_type != "DequantizeLinear" or not all(n in by_name for n in node.input):
                continue
            arrays = [graph.tensor_to_array(by_name[n].tensor) for n in node.input]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            out = np.empty(arrays[0].shape, dtype=arrays[1].dtype)
            jobs.append((arrays, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)), out))
    total = sum(j[3].nbytes for j in jobs)
    if not total:
        return float("nan")
    best = float("inf")
    for _ in range(3):
        # CPU time of this process: numpy runs these on one core, and the machine may be shared
        t = time.process_time()
        for arrays, axis, block, out in jobs:
            forms.dequantize_linear(arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None, axis, block, out=out)
        best = min(best, time.process_time() - t)
    return total / best / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--feeds", type=int, default=0, help="feeds per model (0: all)")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--granularity", default="channel")
    ap.add_argument("--asymmetric", action="store_true")
    args = ap.parse_args(argv)
    corpus = find_corpus()
    manifest = json.loads((corpus / "MANIFEST.json").read_text())
    rows = []
    for entry in manifest:
        name = entry["name"]
        if args.only and name not in args.only:
            continue
        if not has_float_weights(entry):
            continue
        path = corpus / entry["file"]
        if not path.exists():
            print(f"{name}: missing model file, skipped", file=sys.stderr)
            continue
        model = onnx.load(str(path))
        feeds = load_feeds(corpus / entry["feeds"], model)
        if args.feeds:
            feeds = feeds[: args.feeds]
        metric, margs = entry.get("metric"), entry.get("metric_args") or {}
        row = {"model": name, "metric": metric, "original_bytes": path.stat().st_size, "n_feeds": len(feeds)}
        rep = Report()
        t = time.perf_counter()
        q = quantize_weights(model, bits=args.bits, granularity=args.granularity, symmetric=not args.asymmetric, report=rep)
        row["quantize_s"] = round(time.perf_counter() - t, 2)
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            qpath = tmp / "q.onnx"
            qpath.write_bytes(q.SerializeToString())
            row["compressed_bytes"] = qpath.stat().st_size
            row["dynamic_bytes"] = dynamic_size(path, tmp)
        row["compressed_pct"] = round(100 * row["compressed_bytes"] / row["original_bytes"], 2)
        row["dynamic_pct"] = None if row["dynamic_bytes"] is None else round(100 * row["dynamic_bytes"] / row["original_bytes"], 2)
        row["weights_quantized"] = sum(not c.scheme.startswith("kept") for c in rep.tensors)
        row["weights_kept"] = sum(c.scheme.startswith("kept") for c in rep.tensors)
        row["notes"] = rep.notes

        frep = Report()
        t = time.process_time()
        folded = fold_dequantize(q, report=frep)
        fold_s = time.process_time() - t
        float_bytes = sum(c.bytes_after for c in frep.tensors)
        row["fold_MBps"] = round(float_bytes / fold_s / 1e6, 1) if float_bytes else 0.0
        row["float_out"] = sorted({c.dtype for c in rep.tensors if not c.scheme.startswith("kept")})[0] \
            if row["weights_quantized"] else "-"
        row["fold_kernel_MBps"] = round(kernel_throughput(q), 1)

        ref = run_outputs(model, feeds)
        # onnxruntime fuses DequantizeLinear+MatMul into MatMulNBits; its default accuracy level 4
        # also quantizes activations to int8. "int8_acc0" runs the same file with float32 compute.
        import onnxruntime as ort

        acc0 = ort.SessionOptions()
        acc0.log_severity_level = 3
        acc0.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        for label, cand, so in (("int8", q, None), ("int8_acc0", q, acc0), ("folded", folded, None)):
            out = run_outputs(cand, feeds, sess_options=so)
            m = compute_metrics(ref, out, metric=metric, metric_args=margs)
            row[f"{label}_metrics"] = {k: (round(v, 6) if isinstance(v, float) and np.isfinite(v) else str(v)) for k, v in m.items()}
        rows.append(row)
        print(f"done {name}", file=sys.stderr)

    def key_metric(r, label):
        m = r[f"{label}_metrics"]
        metric = r["metric"]
        if metric in ("top1", "ctc") and metric in m:
            return f"{metric} {m[metric]:.4f}"
        if metric == "none":
            return "runs (stochastic)"
        return f"cos {m['cosine']:.5f}"

    header = f"{'model':16} {'orig MB':>8} {'ours %':>7} {'ort dyn %':>9} {'int8 (ort default)':>18} {'int8 (acc level 0)':>18} {'folded':>16} {'fold MB/s':>9} {'kernel MB/s':>11} {'out':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        dyn = "fail" if r["dynamic_pct"] is None else f"{r['dynamic_pct']:.1f}"
        print(f"{r['model']:16} {r['original_bytes'] / 1e6:8.1f} {r['compressed_pct']:7.2f} {dyn:>9} "
              f"{key_metric(r, 'int8'):>18} {key_metric(r, 'int8_acc0'):>18} {key_metric(r, 'folded'):>16} {r['fold_MBps']:9.0f} {r['fold_kernel_MBps']:11.0f} {r['float_out']:>7}")
    out_dir = REPO / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quantize.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out_dir / 'quantize.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
