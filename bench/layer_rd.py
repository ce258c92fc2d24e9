#!/usr/bin/env python3
"""Layer rate-distortion of the graph forms at 3-6 bits (not a test): packed bits per weight
against the layer's OUTPUT error on calibration activations.

For the largest MatMul / Gemm / Conv weights of open_nsfw, minilm_fp32 and piper_joe, the
activations of the first half of the corpus feeds give H_cal = X^T X (passes.gptq), those of the
second half H_held. Per weight and width, each method gives integer levels and scales; measured:
  bpw      packed bits per weight: the levels through the pack's own tensor coder
           (passes.onnxz.codecs.encode_tensor, int4 stored two per byte) plus the float32 scales
  w SNR    weight SNR (dB)
  out SNR  layer output SNR on the held-out activations: tr(W^T H W) / tr(E^T H E), dB
  d_eq     bits per weight against `near` at EQUAL output SNR, by the 6.02 dB/bit slope:
           (bpw - bpw_near) - (out SNR - out SNR_near) / 6.02   (negative: fewer bits)
Methods (per output channel scales unless said):
  near        nearest rounding at the error-minimising clip (quantize_weights' default)
  rdo         rounding="rdo" (rate-aware step per row, SNR within 0.5 dB of nearest)
  imp         clip search weighted by the inputs' mean squared activation (importance=diag H)
  gptq        error-feedback rounding at near's scales (what the auto mode does today)
  gptq_ao     + act-order (inputs with the largest activations first)
  gptq_ao_imp act-order GPTQ at imp's scales
  gptq_ao_rdo act-order GPTQ at rdo's scales (rdo's levels replaced)
  gptq_ao_lam act-order GPTQ with rate-aware levels inside the loop (lam 0.1)
  gptq_ao_rdo_lam  both
  blk<B> / gptq_blk<B>  blocks of B along the inputs (scales per block: overhead counted)
  _d<x>       GPTQ dampening x (relative to the mean diagonal of H; default 0.01)
(method names are "_"-joined tokens: gptq, ao, imp, rdo, lam, blk32, d<x>, any combination)

    python bench/layer_rd.py [--only open_nsfw ...] [--tensors 4] [--bits 3,4,5,6] [--methods a,b]

Models from $SURGEON_CORPUS (default /work/shared/corpus)/<name>/<name>.onnx. Prints a table per
tensor and a summary per width and method; writes bench/out/layer_rd.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
OUT = REPO / "bench" / "out"

import passes  # noqa: E402
from passes import forms, graph, gptq  # noqa: E402
from passes import rounding as rd  # noqa: E402
from passes.onnxz import codecs  # noqa: E402
import rounding as bench_rounding  # noqa: E402  (bench/rounding.py: packed bits per weight)

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
MODELS = ("open_nsfw", "minilm_fp32", "piper_joe")
METHODS = ("near", "rdo", "imp", "gptq", "gptq_ao", "gptq_ao_imp", "gptq_ao_rdo", "gptq_ao_lam", "gptq_ao_rdo_lam",
           "blk32", "gptq_blk32")
LAM = 0.1


def packed_bits(q: np.ndarray, bits: int) -> float:
    """Bits of the stored integers after the pack's tensor coder (bench/rounding.py's measure, per tensor)."""
    return bench_rounding.packed_bits(q, bits) * q.size


def scale_bits(scale: np.ndarray) -> float:
    s = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
    return codecs.encode_tensor(s.view(np.uint8), onnx.TensorProto.FLOAT, "raw_data").stored * 8


def split(feeds):
    h = max(1, len(feeds) // 2)
    return feeds[:h], feeds[h:] or feeds[:h]


def pick(model, n):
    inits = graph.unique_initializers(model)
    cons = gptq.consumers(model, list(inits))
    names = [k for k, (node, _) in cons.items() if len(inits[k].dims) >= 2
             and inits[k].data_type == onnx.TensorProto.FLOAT and int(np.prod(inits[k].dims)) >= 4096]
    names.sort(key=lambda k: -int(np.prod(inits[k].dims)))
    return names[:n], cons, inits


def out_snr(mat, deq_mat, h):
    e = mat - deq_mat
    sig = float(np.einsum("kn,kn->", mat, h @ mat))
    noi = float(np.einsum("kn,kn->", e, h @ e))
    return 10 * math.log10(sig / noi) if noi > 0 else 200.0


def w_snr(mat, deq_mat):
    noi = float(np.sum((mat - deq_mat) ** 2))
    return 10 * math.log10(float(np.sum(mat ** 2)) / noi) if noi > 0 else 200.0


def run_tensor(name, w, node, h_cal, h_held, bit_widths, methods):
    op = node.op_type
    trans_b = op == "Gemm" and bool(gptq._attr(node, "transB", 0))
    mat, back = gptq.as_matrix(w, op, trans_b)  # (K, N)
    axis = 0 if (op == "Conv" or trans_b) else 1
    k, n = mat.shape
    imp = np.diag(h_cal).astype(np.float32)
    imp_w = imp.reshape((1,) + w.shape[1:]) if op == "Conv" else (imp.reshape(1, -1) if trans_b else imp.reshape(-1, 1))
    order = gptq.activation_order(h_cal)
    f_plain = gptq.inverse_factor(h_cal)  # today's refine: damp 0.01, inputs in order
    mat_blk = np.ascontiguousarray(mat.T)  # (N, K): blocks along the inputs = the last axis here
    rows = []
    factors = {}
    for bits in bit_widths:
        lv = forms.Levels(bits, True)
        qmax = lv.qmax

        cache = {}

        def base(kind):
            if kind not in cache:
                if kind == "near":
                    cache[kind] = forms.quantize_linear(w, lv, axis)
                elif kind == "rdo":
                    cache[kind] = forms.quantize_linear(w, lv, axis, rounding=rd.options("rdo"))
                elif kind == "imp":
                    cache[kind] = forms.quantize_linear(w, lv, axis, importance=imp_w)
                elif kind == "imp_rdo":
                    cache[kind] = forms.quantize_linear(w, lv, axis, importance=imp_w, rounding=rd.options("rdo"))
                elif kind[0] == "blk":
                    cache[kind] = forms.quantize_linear(mat_blk, lv, 1, kind[1])
            return cache[kind]

        for m in methods:
            c0 = time.process_time()
            tok = set(m.split("_"))
            damp = next((float(t[1:]) for t in tok if t.startswith("d") and t[1:].replace(".", "").isdigit()),
                        gptq.DAMP)
            ao = "ao" in tok
            if ao or damp != gptq.DAMP:
                key = (ao, damp)
                if key not in factors:
                    factors[key] = gptq.inverse_factor(h_cal, damp, order=order if ao else None)
                fac = factors[key]
            else:
                fac = f_plain
            lam = LAM if "lam" in tok else None
            blk = next((int(t[3:]) for t in tok if t.startswith("blk") and t[3:].isdigit()), 0)
            if blk:
                qz = base(("blk", blk))
                s_blk = qz.scale.astype(np.float64).T  # (nb, N)
                if "gptq" in tok:
                    lv_mat = gptq.gptq_levels(mat, h_cal, s_blk, -qmax, qmax, factor=fac, order=order if ao else None,
                                              lam=lam, block_size=blk)
                else:
                    lv_mat = qz.q.T.astype(np.int32)
                deq = lv_mat * gptq.row_scales(s_blk, k, blk)
            else:
                kind = "_".join(t for t in ("imp", "rdo") if t in tok) or "near"
                qz = base(kind)
                s = qz.scale.astype(np.float64).reshape(-1)  # per output channel
                if "gptq" in tok:
                    lv_mat = gptq.gptq_levels(mat, h_cal, s, -qmax, qmax, factor=fac,
                                              order=order if ao else None, lam=lam)
                else:
                    lv_mat, _ = gptq.as_matrix(qz.q.astype(np.int32), op, trans_b)
                deq = lv_mat * s[None, :]
            sbits = scale_bits(qz.scale)
            cpu = time.process_time() - c0
            bpw = (packed_bits(back(lv_mat.astype(np.int8)), bits) + sbits) / w.size
            rows.append({"tensor": name, "shape": list(w.shape), "bits": bits, "method": m, "bpw": bpw,
                         "scale_bpw": sbits / w.size, "w_snr": w_snr(mat, deq), "out_snr": out_snr(mat, deq, h_held),
                         "out_snr_cal": out_snr(mat, deq, h_cal), "cpu_s": round(cpu, 2)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--bits", default="3,4,5,6")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    bit_widths = [int(b) for b in args.bits.split(",")]
    methods = args.methods.split(",")
    if "near" not in methods:
        methods = ["near"] + methods
    all_rows = []
    for mname in MODELS:
        if args.only and mname not in args.only:
            continue
        path = CORPUS / mname / f"{mname}.onnx"
        model = passes.load_model(str(path))
        feeds = passes.load_feeds(str(CORPUS / mname / "feeds.npz"), model)
        cal, held = split(feeds)
        names, cons, inits = pick(model, args.tensors)
        c0 = time.process_time()
        h_cal = gptq.collect_hessians(model, cal, names)
        h_held = gptq.collect_hessians(model, held, names)
        print(f"{mname}: hessians for {len(h_cal)} weights, {time.process_time() - c0:.1f} CPU s", flush=True)
        for name in names:
            if name not in h_cal or name not in h_held:
                continue
            w = graph.tensor_to_array(inits[name])
            rows = run_tensor(name, w, cons[name][0], h_cal[name], h_held[name], bit_widths, methods)
            for r in rows:
                r["model"] = mname
            ref = {r["bits"]: r for r in rows if r["method"] == "near"}
            for r in rows:
                b = ref[r["bits"]]
                r["d_eq"] = (r["bpw"] - b["bpw"]) - (r["out_snr"] - b["out_snr"]) / 6.02
                print(f"{mname:<11} {name[-28:]:<28} {r['bits']} {r['method']:<16} bpw {r['bpw']:6.3f} "
                      f"(scales {r['scale_bpw']:.3f}) wSNR {r['w_snr']:6.2f} outSNR {r['out_snr']:6.2f} "
                      f"(cal {r['out_snr_cal']:6.2f}) d_eq {r['d_eq']:+6.3f} cpu {r['cpu_s']:5.1f}", flush=True)
            all_rows += rows
    print("\nsummary (weighted by elements): bits | method | bpw | out SNR held-out | d_eq bits/w at equal out SNR")
    summary = []
    for bits in bit_widths:
        for m in methods:
            rs = [r for r in all_rows if r["bits"] == bits and r["method"] == m]
            if not rs:
                continue
            wts = np.array([np.prod(r["shape"]) for r in rs], dtype=np.float64)
            avg = lambda key: float((wts * [r[key] for r in rs]).sum() / wts.sum())  # noqa: E731
            row = {"bits": bits, "method": m, "tensors": len(rs), "bpw": avg("bpw"), "out_snr": avg("out_snr"),
                   "w_snr": avg("w_snr"), "d_eq": avg("d_eq")}
            summary.append(row)
            print(f"| {bits} | {m:<16} | {row['bpw']:6.3f} | {row['out_snr']:6.2f} | {row['w_snr']:6.2f} | "
                  f"{row['d_eq']:+6.3f} |")
    OUT.mkdir(parents=True, exist_ok=True)
    tag = "_".join(args.only) if args.only else "all"
    (OUT / f"layer_rd_{tag}.json").write_text(json.dumps({"argv": sys.argv[1:], "rows": all_rows,
                                                            "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
