#!/usr/bin/env python3
"""Benchmark of rate-aware rounding in the graph forms (not a test): nearest vs rounding="rdo".

(a) per tensor: the largest float weights of open_nsfw, minilm_fp32 and piper_joe, at 8/6/5/4 bits
    per channel (the axis quantize_weights gives them): bits per weight after the pack's own
    tensor coder (passes.onnxz.codecs.encode_tensor on the stored integer bytes; int4 as the
    two-per-byte payload the model holds) and weight SNR, for
      nearest           round to nearest at the error-minimising scales (today's default),
      rdo               rounding="rdo" with its default bound (SNR within 0.5 dB of nearest):
                        a rate-aware step per row, nearest levels,
      nearest@SNR(rdo)  nearest rounding with every scale enlarged by a common factor (a sweep,
                        interpolated at rdo's SNR): what a larger step alone buys, the fair
                        baseline for the rounding itself.
(b) whole model: passes.quantize_weights + passes.pack (.onnxz size) and passes.evaluate on the
    corpus feeds, for open_nsfw (top1) and minilm_fp32 (cosine): nearest, rdo, rdo+levels
    (rd_levels="rdo": each weight's level by the rate cost too, a dead zone), and as a control
    nearest with every scale 5% larger (a perturbation of about rdo's weight-SNR loss: at 6 bits
    open_nsfw's top1 flips on its borderline crops under any such change); mean per-tensor weight
    SNR; CPU seconds of the quantize call (time.process_time: the machine is shared).

    python bench/rounding.py [--parts ab] [--tensors 4] [--bits 8,6,5,4] [--only NAME ...]

Models are read from $SURGEON_CORPUS (default /work/shared/corpus)/<name>/<name>.onnx, falling
back to --models DIR/<name>/<name>.onnx. Prints tables, writes bench/out/rounding.json.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"

import passes  # noqa: E402
from passes import forms, graph  # noqa: E402
from passes import rounding as rd  # noqa: E402
from passes.onnxz import codecs  # noqa: E402

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
TENSOR_MODELS = ("open_nsfw", "minilm_fp32", "piper_joe")
WHOLE_MODELS = {"open_nsfw": "top1", "minilm_fp32": "cosine"}
SWEEP = (1.0, 1.03, 1.06, 1.1, 1.15, 1.2, 1.3, 1.45)


def model_path(name: str, fallback: Path | None) -> Path:
    p = CORPUS / name / f"{name}.onnx"
    if not p.exists() and fallback is not None:
        p = fallback / name / f"{name}.onnx"
    if not p.exists():
        raise SystemExit(f"{name}: no model at {CORPUS / name} (run the corpus fetch.py, or pass --models)")
    return p


def packed_bits(q: np.ndarray, bits: int) -> float:
    """Bits per weight of the stored integers after the pack's tensor coder."""
    flat = np.ascontiguousarray(q).reshape(-1).astype(np.int8)
    if bits <= 4:  # int4: two per byte, low nibble first (as the model stores them)
        if flat.size % 2:
            flat = np.append(flat, np.int8(0))
        u = flat.view(np.uint8) & 0x0F
        data, dtype = (u[0::2] | (u[1::2] << 4)).astype(np.uint8), onnx.TensorProto.INT4
    else:
        data, dtype = flat.view(np.uint8), onnx.TensorProto.INT8
    return codecs.encode_tensor(data, dtype, "raw_data").stored * 8 / q.size


def weight_axes(model: onnx.ModelProto) -> dict[str, int | None]:
    """Name -> the axis quantize_weights (per channel, 8 bits) gives each weight it quantizes."""
    q = passes.quantize_weights(model, bits=8)
    axes = {}
    for n in q.graph.node:
        if n.op_type == "DequantizeLinear":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            axes[n.output[0]] = a.get("axis", 1)
    return axes


def interp_rate(points: list[tuple[float, float]], snr: float) -> float | None:
    """Bits/weight of the nearest sweep (snr, bits) at `snr`, linear between neighbours."""
    pts = sorted(points)
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if s0 <= snr <= s1:
            return b0 + (b1 - b0) * (snr - s0) / (s1 - s0) if s1 > s0 else b0
    return None


def part_a(names, n_tensors: int, bit_widths, fallback):
    rows = []
    for name in names:
        model = onnx.load(str(model_path(name, fallback)))
        axes = weight_axes(model)
        inits = [t for t in model.graph.initializer if t.name in axes]
        inits.sort(key=lambda t: -int(np.prod(t.dims)))
        for t in inits[:n_tensors]:
            w = graph.tensor_to_array(t)
            axis = axes[t.name]
            for bits in bit_widths:
                lv = forms.Levels(bits, True)
                c0 = time.process_time()
                near = forms.quantize_linear(w, lv, axis)
                c1 = time.process_time()
                rdo = forms.quantize_linear(w, lv, axis, rounding=rd.options("rdo"))
                c2 = time.process_time()
                sweep = []
                for m in SWEEP:
                    qz = near if m == 1.0 else forms.quantize_linear(
                        w, lv, axis, rounding=rd.options("rdo", rd_lambda=0, rd_step_scale=m))
                    sweep.append((qz.snr_db(), packed_bits(qz.q, bits)))
                row = {
                    "model": name, "tensor": t.name, "shape": list(w.shape), "axis": axis, "bits": bits,
                    "nearest_bpw": packed_bits(near.q, bits), "nearest_snr": near.snr_db(),
                    "nearest_order0": near.bits_per_weight,
                    "rdo_bpw": packed_bits(rdo.q, bits), "rdo_snr": rdo.snr_db(), "rdo_order0": rdo.bits_per_weight,
                    "rdo_lambda": rdo.rd_lambda, "rdo_step": rdo.step_scale,
                    "nearest_at_rdo_snr_bpw": interp_rate(sweep, rdo.snr_db()),
                    "cpu_nearest_s": round(c1 - c0, 3), "cpu_rdo_s": round(c2 - c1, 3),
                    "sweep": [{"step": m, "snr": s, "bpw": b} for m, (s, b) in zip(SWEEP, sweep)],
                }
                rows.append(row)
                print_a_row(row)
    return rows


A_HEAD = (f"{'model':<12} {'tensor':<34} {'b':>2} | {'nearest':>15} | {'rdo':>15} | {'d bits':>7} {'d SNR':>6} | "
          f"{'near@SNR':>8} {'vs it':>6} | {'lam':>5} {'step':>5} {'cpu x':>6}")


def print_a_row(r):
    if print_a_row.first:
        print("\n(a) per tensor: packed bits/weight @ weight SNR dB")
        print(A_HEAD)
        print_a_row.first = False
    eq = r["nearest_at_rdo_snr_bpw"]
    vs = f"{100 * (r['rdo_bpw'] / eq - 1):+5.1f}%" if eq else "   n/a"
    cpu = r["cpu_rdo_s"] / max(r["cpu_nearest_s"], 1e-3)
    print(f"{r['model']:<12} {r['tensor'][-34:]:<34} {r['bits']:>2} | {r['nearest_bpw']:6.3f} @ {r['nearest_snr']:6.2f} | "
          f"{r['rdo_bpw']:6.3f} @ {r['rdo_snr']:6.2f} | {100 * (r['rdo_bpw'] / r['nearest_bpw'] - 1):+6.1f}% "
          f"{r['rdo_snr'] - r['nearest_snr']:+6.2f} | {eq if eq else float('nan'):8.3f} {vs} | "
          f"{r['rdo_lambda'] or 0:5.2f} {r['rdo_step'] or 1:5.2f} {cpu:6.1f}", flush=True)


print_a_row.first = True


def summarize_a(rows, bit_widths):
    out = []
    print("\n(a) summary per bit width (all tensors, weighted by elements)")
    print(f"{'bits':>4} {'tensors':>7} | {'nearest bpw':>11} {'rdo bpw':>8} {'change':>7} | {'mean dSNR':>9} | "
          f"{'near@SNR bpw':>12} {'rdo vs it':>9}")
    for bits in bit_widths:
        rs = [r for r in rows if r["bits"] == bits]
        if not rs:
            continue
        n = np.array([np.prod(r["shape"]) for r in rs], dtype=np.float64)
        near = float((n * [r["nearest_bpw"] for r in rs]).sum() / n.sum())
        rdo = float((n * [r["rdo_bpw"] for r in rs]).sum() / n.sum())
        d_snr = float(np.mean([r["rdo_snr"] - r["nearest_snr"] for r in rs]))
        eq_rows = [(k, r) for k, r in zip(n, rs) if r["nearest_at_rdo_snr_bpw"]]
        ne = sum(k for k, _ in eq_rows)
        eq = float(sum(k * r["nearest_at_rdo_snr_bpw"] for k, r in eq_rows) / ne) if ne else float("nan")
        rdo_eq = float(sum(k * r["rdo_bpw"] for k, r in eq_rows) / ne) if ne else float("nan")
        out.append({"bits": bits, "tensors": len(rs), "nearest_bpw": near, "rdo_bpw": rdo, "mean_dsnr_db": d_snr,
                    "nearest_at_rdo_snr_bpw": eq, "rdo_bpw_same_rows": rdo_eq})
        print(f"{bits:>4} {len(rs):>7} | {near:11.3f} {rdo:8.3f} {100 * (rdo / near - 1):+6.1f}% | {d_snr:+9.2f} | "
              f"{eq:12.3f} {100 * (rdo_eq / eq - 1):+8.1f}%")
    return out


def part_b(names, configs, fallback):
    rows = []
    print("\n(b) whole model: quantize_weights + pack, fidelity on the corpus feeds")
    print(f"{'model':<12} {'form':<24} {'rounding':<12} | {'.onnxz bytes':>12} {'% float':>7} {'change':>7} | "
          f"{'w SNR':>6} | {'metric':>26} {'out SNR':>7} | {'cpu s':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = model_path(name, fallback)
            model = passes.load_model(str(path))
            feeds = passes.load_feeds(str(CORPUS / name / "feeds.npz"), model)
            float_bytes = os.path.getsize(path)
            for form in configs:
                base = None
                for rounding, how in (("nearest", dict(rounding="nearest")),
                                      ("nearest×1.05", dict(rounding="rdo", rd_lambda=0, rd_step_scale=1.05)),
                                      ("rdo", dict(rounding="rdo")),
                                      ("rdo+levels", dict(rounding="rdo", rd_levels="rdo"))):
                    report = passes.Report()
                    c0 = time.process_time()
                    q = passes.quantize_weights(model, report=report, **form, **how)
                    cpu = time.process_time() - c0
                    dst = Path(tmp) / f"{name}.onnxz"
                    passes.pack(q, dst, force=True)
                    size = os.path.getsize(dst)
                    res = passes.evaluate(model, q, feeds=feeds, metric=WHOLE_MODELS[name])
                    metric = WHOLE_MODELS[name]
                    changed = [t for t in report.tensors if isinstance(t, rd.QuantizedChange)]
                    row = {"model": name, "form": form, "rounding": rounding, "packed_bytes": size,
                           "float_bytes": float_bytes, "metrics": res.metrics, "cpu_s": round(cpu, 2),
                           "tensors_rdo": sum(t.rounding == "rdo" for t in changed), "tensors": len(changed),
                           "order0_int_bytes": int(sum(t.packed_bits_per_weight * np.prod(t.shape) for t in changed) / 8),
                           "mean_weight_snr_db": float(np.mean([t.snr_db for t in changed]))}
                    rows.append(row)
                    base = base or size
                    label = "/".join(f"{k}={v}" for k, v in form.items())
                    m = res.metrics
                    shown = f"{metric} {m[metric]:.5f}" + (f" min {m['cosine_min']:.5f}" if metric == "cosine" else "")
                    print(f"{name:<12} {label:<24} {rounding:<12} | {size:12d} {100 * size / float_bytes:6.2f}% "
                          f"{100 * (size / base - 1):+6.1f}% | {row['mean_weight_snr_db']:6.2f} | {shown:>26} "
                          f"{m.get('snr', float('nan')):7.2f} | {cpu:6.2f}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ab")
    ap.add_argument("--tensors", type=int, default=4, help="largest float weights per model in part (a)")
    ap.add_argument("--bits", default="8,6,5,4")
    ap.add_argument("--only", nargs="*", help="model names")
    ap.add_argument("--models", type=Path, help="fallback folder holding <name>/<name>.onnx")
    args = ap.parse_args(argv)
    bit_widths = [int(b) for b in args.bits.split(",")]
    keep = (lambda n: not args.only or n in args.only)
    result: dict = {"argv": sys.argv[1:]}
    if "a" in args.parts:
        result["tensors"] = part_a([n for n in TENSOR_MODELS if keep(n)], args.tensors, bit_widths, args.models)
        result["tensors_summary"] = summarize_a(result["tensors"], bit_widths)
    if "b" in args.parts:
        configs = [dict(bits=8), dict(bits=6), dict(bits=4, granularity="block")]
        result["models"] = part_b([n for n in WHOLE_MODELS if keep(n)], configs, args.models)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rounding.json").write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {OUT / 'rounding.json'}")


if __name__ == "__main__":
    main()
