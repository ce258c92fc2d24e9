#!/usr/bin/env python3
"""Rate-distortion of the forms on an embedding table (not a test): minilm_fp32's 30522 x 384
word embeddings (half of MiniLM's weights), read by Gather along rows.

Per form and width: packed bits per weight (levels through the pack's tensor coder, int4 two per
byte, plus the scales / palette table through it), and three quality figures:
  w SNR      the tensor's weight SNR (dB)
  row SNR    data-free: -10 log10(mean over rows of row noise / row signal); a gathered row goes
             through LayerNorm, so each row's relative error is what reaches the model, and rows
             the feeds never gather count as much as the others
  used SNR   the same mean weighted by how often the held-out half of the corpus feeds gathers
             each row (rows never gathered weigh 0)
Forms: row = per-row scales (axis 0, what quantize_weights gives a Gather table), col = per
column (axis 1), blk<B> = blocks of B along each row, palette = one k-means table of 2**bits
values for the tensor (passes/palette.py), each with nearest and rdo rounding where it applies;
onestep = one step for every row at the order-0 rate of the row form (sensitivity.one_step_levels,
the auto mode's table form), seenrows = the same with the rows the calibration half of the feeds
gathers at 1/4 of the step (sensitivity.seen_row_levels; the auto mode with row counts).

    python bench/embed_rd.py [--bits 3,4,5,6]

Writes bench/out/embed_rd.json.
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
OUT = REPO / "bench" / "out"

import passes  # noqa: E402
from passes import forms, graph, palette  # noqa: E402
from passes import sensitivity as sens  # noqa: E402
from passes import rounding as rd  # noqa: E402
from passes.onnxz import codecs  # noqa: E402

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
NAME = "m.embeddings.word_embeddings.weight"


def coded_bits(arr: np.ndarray, dtype: int) -> float:
    a = np.ascontiguousarray(arr)
    if dtype in (onnx.TensorProto.INT4,):
        flat = a.reshape(-1).astype(np.int8)
        if flat.size % 2:
            flat = np.append(flat, np.int8(0))
        u = flat.view(np.uint8) & 0x0F
        a = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    return codecs.encode_tensor(a.reshape(-1).view(np.uint8), dtype, "raw_data").stored * 8


def quality(w, deq, freq):
    e = (w.astype(np.float64) - deq) ** 2
    sig_r = np.sum(w.astype(np.float64) ** 2, axis=1)
    rel = e.sum(axis=1) / np.maximum(sig_r, 1e-30)
    wsnr = 10 * math.log10(sig_r.sum() / e.sum())
    rsnr = -10 * math.log10(rel.mean())
    usnr = -10 * math.log10(float((rel * freq).sum() / freq.sum()))
    return wsnr, rsnr, usnr


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="3,4,5,6")
    ap.add_argument("--forms", default="row,row_rdo,col,col_rdo,blk64,blk64_rdo,palette,onestep,seenrows")
    args = ap.parse_args(argv)
    path = CORPUS / "minilm_fp32" / "minilm_fp32.onnx"
    model = passes.load_model(str(path))
    feeds = passes.load_feeds(str(CORPUS / "minilm_fp32" / "feeds.npz"), model)
    w = graph.tensor_to_array(graph.unique_initializers(model)[NAME]).astype(np.float32)
    held = feeds[len(feeds) // 2:]
    freq = np.bincount(np.concatenate([f["input_ids"].ravel() for f in held]).astype(np.int64), minlength=w.shape[0])
    seen = sens.gathered_row_counts(model, feeds[:len(feeds) // 2], [NAME]).get(NAME, np.zeros(w.shape[0])) > 0
    print(f"{NAME} {w.shape}: held-out feeds gather {np.count_nonzero(freq)} distinct rows", flush=True)
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        lv = forms.Levels(bits, True)
        ltype = onnx.TensorProto.INT4 if bits <= 4 else onnx.TensorProto.INT8
        for form in args.forms.split(","):
            c0 = time.process_time()
            if form in ("onestep", "seenrows"):
                row = forms.quantize_linear(w, lv, 0, 0)
                rate = sens.entropy_bytes(row.q) * 8 / w.size
                step = sens._one_step_for_rate(w, 0, rate, np.random.default_rng(0))
                q, scale = (sens.one_step_levels(w, step, 0) if form == "onestep"
                            else sens.seen_row_levels(w, step, seen))
                deq = q.astype(np.float64) * scale.astype(np.float64)[:, None]
                nbits = coded_bits(q, onnx.TensorProto.INT8) + coded_bits(scale.view(np.uint8), onnx.TensorProto.FLOAT)
            elif form == "palette":
                if bits > 8:
                    continue
                idx, table, _ = palette.palette_array(w.astype(np.float64), bits, None)
                table = table.astype(np.float32)
                deq = table[idx.astype(np.int64)].astype(np.float64)
                nbits = coded_bits(idx, onnx.TensorProto.UINT8) + table.size * 32
            else:
                rounding = rd.options("rdo") if form.endswith("_rdo") else None
                if form.startswith("row"):
                    axis, blk = 0, 0
                elif form.startswith("col"):
                    axis, blk = 1, 0
                else:
                    axis, blk = 1, int(form.split("_")[0][3:])
                qz = forms.quantize_linear(w, lv, axis, blk, rounding=rounding)
                deq = forms.dequantize_linear(qz.q, qz.scale, None, axis, blk).astype(np.float64)
                nbits = coded_bits(qz.q, ltype) + coded_bits(qz.scale.astype(np.float32).view(np.uint8),
                                                             onnx.TensorProto.FLOAT)
            cpu = time.process_time() - c0
            wsnr, rsnr, usnr = quality(w, deq, freq)
            r = {"bits": bits, "form": form, "bpw": nbits / w.size, "w_snr": wsnr, "row_snr": rsnr,
                 "used_snr": usnr, "cpu_s": round(cpu, 1)}
            rows.append(r)
            print(f"| {bits} | {form:<10} | {r['bpw']:6.3f} | {wsnr:6.2f} | {rsnr:6.2f} | {usnr:6.2f} | {cpu:5.1f} |",
                  flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "embed_rd.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
