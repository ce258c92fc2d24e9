#!/usr/bin/env python3
"""Whole-model check of the error-feedback options (not a test): packed .onnxz size and held-out
fidelity of uniform per-channel forms built with
  near          quantize_weights(bits) (nearest rounding)
  rdo           quantize_weights(bits, rounding="rdo")
  gptq          + gptq.refine at the old settings (damp 0.01, inputs in order): the auto mode today
  gptq_d0.3     + refine(damp=0.3)
  gptq_ao_d0.3  + refine(damp=0.3, act_order=True)
  rdo_gptq_ao_d0.3  rounding="rdo" scales, then refine(damp=0.3, act_order=True)
  imp_rdo_gptq_ao_d0.3  the same with importance-weighted clip search (gptq.input_importance)
  qwf           gptq.quantize_with_feedback(model, calibration feeds, bits) with its defaults
Hessians come from the first half of the corpus feeds, fidelity is measured on the second half
(as bench/lossy.py part b): the metric, and the SNR of the outputs the auto mode measures
(auto.probe_outputs: the logits behind a Softmax, centred; other outputs as they are). Every weight the quantize pass touches gets the same width.

    python bench/gptq_model.py [--only open_nsfw minilm_fp32] [--bits 4,5] [--methods a,b]

Models from $SURGEON_CORPUS (default /work/shared/corpus). Writes bench/out/gptq_model.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"

import passes  # noqa: E402
from passes import gptq  # noqa: E402
from passes.auto import probe_outputs, proxy_outputs, strip_outputs  # noqa: E402
from passes.fidelity import output_snr_db, run_outputs  # noqa: E402
from passes.fold import fold_dequantize  # noqa: E402

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
MODELS = {"open_nsfw": ("top1", "onnxruntime"), "minilm_fp32": ("cosine", "fold")}
METHODS = ("near", "rdo", "gptq", "gptq_d0.3", "gptq_ao_d0.3", "rdo_gptq_ao_d0.3", "imp_rdo_gptq_ao_d0.3")


def build(model, bits, method, hess, imp, cal=None):
    if method == "qwf":  # the packaged recipe, Hessians computed inside
        return gptq.quantize_with_feedback(model, cal, bits=bits)
    tok = set(method.split("_"))
    kw = dict(bits=bits)
    if "rdo" in tok:
        kw["rounding"] = "rdo"
    if "imp" in tok:
        kw["importance"] = imp
    q = passes.quantize_weights(model, **kw)
    if "gptq" in tok:
        damp = next((float(t[1:]) for t in tok if t.startswith("d") and t[1:].replace(".", "").isdigit()), gptq.DAMP)
        refined = gptq.refine(q, model, hess, bits, damp=damp, act_order="ao" in tok)
        q = gptq.write_levels(q, {n: lv for n, (lv, _) in refined.items()})
    return q


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--bits", default="4,5")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (metric, run_as) in MODELS.items():
            if args.only and name not in args.only:
                continue
            path = CORPUS / name / f"{name}.onnx"
            model = passes.load_model(str(path))
            feeds = passes.load_feeds(str(CORPUS / name / "feeds.npz"), model)
            half = len(feeds) // 2
            cal, held = feeds[:half], feeds[half:]
            names = list(graph_names(model))
            hess = gptq.collect_hessians(model, cal, names)
            imp = gptq.input_importance(model, hess)
            float_bytes = os.path.getsize(path)
            probe, n_out, plan = probe_outputs(model)
            ref = proxy_outputs(run_outputs(probe, held), plan)
            for bits in [int(b) for b in args.bits.split(",")]:
                for method in args.methods.split(","):
                    c0 = time.process_time()
                    qp = build(probe, bits, method, hess, imp, cal)
                    cpu = time.process_time() - c0
                    cand_p = fold_dequantize(qp) if run_as == "fold" else qp
                    psnr = output_snr_db(ref, proxy_outputs(run_outputs(cand_p, held), plan))
                    q = strip_outputs(qp, n_out)
                    dst = Path(tmp) / "m.onnxz"
                    passes.pack(q, dst, force=True)
                    size = os.path.getsize(dst)
                    cand = fold_dequantize(q) if run_as == "fold" else q
                    res = passes.evaluate(model, cand, feeds=held, metric=metric)
                    m = res.metrics
                    row = {"model": name, "bits": bits, "method": method, "packed_bytes": size,
                           "percent": 100 * size / float_bytes, "metrics": m, "proxy_snr": psnr,
                           "cpu_s": round(cpu, 1)}
                    rows.append(row)
                    extra = f" min {m['cosine_min']:.5f}" if metric == "cosine" else ""
                    print(f"| {name} | {bits} | {method:<22} | {100 * size / float_bytes:6.2f}% | {metric} "
                          f"{m[metric]:.5f}{extra} | logit SNR {psnr:6.2f} | {cpu:6.1f} |",
                          flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gptq_model.json").write_text(json.dumps(rows, indent=1, default=float))


def graph_names(model):
    return [t.name for t in model.graph.initializer]


if __name__ == "__main__":
    main()
