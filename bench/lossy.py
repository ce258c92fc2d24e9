#!/usr/bin/env python3
"""Benchmark of the lossy stage (issue 4; not a test). Three parts, in one run:

(a) rate-distortion on the named tensors of ANCHORS.md: bits per weight of passes.encode_array
    (real bytes of the blob, side information included) at the SNR NNCodec reached, beside
    NNCodec's figure and the plain bound (per-tensor uniform, nearest rounding, ideal order-0
    coder, no side information; computed here).
(b) every corpus model with a metric: packed size (.onnxz via passes.pack) against fidelity
    for uniform n-bit per-channel forms, the auto mode and onnxruntime quantize_dynamic; the auto
    mode is calibrated on the first half of the feeds, everything is measured on the second half.
(c) decode throughput of decode_array (float32 output, 1 and 2 threads) in wall time and per
    CPU second of this process (the machine is shared: CPU seconds are the steadier figure).

    python bench/lossy.py [--parts abc] [--only NAME ...] [--rows N] [--bits 3,4,5,6,8] [--run-as fold]

Prints tables, writes bench/out/lossy.json and bench/out/lossy.png (matplotlib, if installed).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
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
from passes import graph  # noqa: E402

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))

# ANCHORS.md, "Lossy: rate-distortion on single tensors" (NNCodec 2.1.3)
ROWS = [
    ("open_nsfw", "onnx::Conv_5831", 38.51, 6.451), ("open_nsfw", "onnx::Conv_5831", 26.63, 4.410),
    ("open_nsfw", "onnx::Conv_5831", 15.23, 2.558), ("open_nsfw", "onnx::Conv_5979", 37.97, 6.293),
    ("open_nsfw", "onnx::Conv_5979", 26.10, 4.233), ("open_nsfw", "onnx::Conv_5979", 14.72, 2.340),
    ("open_nsfw", "onnx::Conv_5720", 40.43, 6.700), ("open_nsfw", "onnx::Conv_5720", 28.53, 4.660),
    ("open_nsfw", "onnx::Conv_5720", 17.05, 2.743),
    ("minilm_fp32", "m.embeddings.word_embeddings.weight", 47.01, 7.965),
    ("minilm_fp32", "m.embeddings.word_embeddings.weight", 35.03, 5.931),
    ("minilm_fp32", "m.embeddings.word_embeddings.weight", 23.24, 3.932),
    ("minilm_fp32", "val_98", 48.28, 8.195), ("minilm_fp32", "val_98", 36.29, 6.173),
    ("minilm_fp32", "val_98", 24.46, 4.155), ("minilm_fp32", "val_119", 50.63, 8.589),
    ("minilm_fp32", "val_119", 38.64, 6.598), ("minilm_fp32", "val_119", 26.75, 4.560),
]


def snr_db(w, w_hat) -> float:
    w = w.astype(np.float64)
    return float(10 * np.log10((w * w).sum() / ((w - w_hat.astype(np.float64)) ** 2).sum()))


def plain_bound(w, target) -> float:
    """Per-tensor uniform step, nearest rounding, at the target SNR; order-0 entropy of levels."""
    w = w.astype(np.float64).ravel()
    lo, hi = np.log(w.std() * 1e-4), np.log(w.std() * 10)
    for _ in range(40):
        mid = (lo + hi) / 2
        d = np.exp(mid)
        if snr_db(w, np.round(w / d) * d) > target:
            lo = mid
        else:
            hi = mid
    q = np.round(w / np.exp(lo)).astype(np.int64)
    _, c = np.unique(q, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def load_tensors(names_by_model):
    out = {}
    for model, names in names_by_model.items():
        m = onnx.load(str(CORPUS / model / f"{model}.onnx"))
        inits = {t.name: t for t in m.graph.initializer}
        for n in names:
            out[(model, n)] = graph.tensor_to_array(inits[n]).astype(np.float32)
    return out


def decode_speed(blob, n, threads, repeat=3):
    out = np.empty(n, np.float32)
    passes.decode_array(blob, out=out, threads=threads)
    res = {}
    for mode in ("reuse", "fresh"):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(repeat):
            passes.decode_array(blob, out=out if mode == "reuse" else None, threads=threads)
        wall = (time.perf_counter() - t0) / repeat
        cpu = (time.process_time() - c0) / repeat
        res[mode] = {"wall_MBps": round(n * 4 / wall / 1e6, 1), "cpu_MBps": round(n * 4 / cpu / 1e6 * threads, 1)}
    return res


def part_a(max_rows):
    print("\n(a) rate-distortion at NNCodec's SNR: bits per weight (real bytes incl. side information)")
    rows = ROWS[:max_rows]
    tensors = load_tensors({m: sorted({t for mm, t, _, _ in rows if mm == m}) for m in {r[0] for r in rows}})
    hdr = f"{'model':12s} {'tensor':36s} {'SNR dB':>7s} {'ours':>7s} {'NNCodec':>8s} {'ratio':>6s} {'plain+o0':>9s} {'got dB':>7s} {'enc s':>6s} {'dec MB/s(2t)':>13s}"
    print(hdr)
    results = []
    for model, name, target, nnc in rows:
        w = tensors[(model, name)]
        t0 = time.perf_counter()
        blob = passes.encode_array(w, snr_db=target)
        enc = time.perf_counter() - t0
        got = snr_db(w, passes.decode_array(blob))
        bpw = len(blob) * 8 / w.size
        plain = plain_bound(w, target)
        sp = decode_speed(blob, w.size, 2, repeat=2)
        r = {"model": model, "tensor": name, "snr_target": target, "snr_got": round(got, 3), "bpw": round(bpw, 4),
             "nncodec_bpw": nnc, "ratio": round(bpw / nnc, 4), "plain_o0_bpw": round(plain, 4),
             "bytes": len(blob), "encode_s": round(enc, 1), "decode_2t": sp}
        results.append(r)
        print(f"{model:12s} {name:36s} {target:7.2f} {bpw:7.3f} {nnc:8.3f} {bpw / nnc:6.3f} {plain:9.3f} {got:7.2f} "
              f"{enc:6.1f} {sp['reuse']['wall_MBps']:6.0f}/{sp['reuse']['cpu_MBps']:.0f}cpu", flush=True)
    worst = max(results, key=lambda r: r["ratio"])
    print(f"worst ratio {worst['ratio']:.3f} ({worst['tensor']} at {worst['snr_target']} dB); target <= 1.03")
    return results


def _decode_rates(blob, n, threads, repeat=5):
    """decode_array of one blob, `repeat` times per output mode (fresh array / reused buffer):
    MB/s of float32 output by wall time (best and median run) and per CPU second of this process."""
    out = np.empty(n, np.float32)
    passes.decode_array(blob, out=out, threads=threads)
    res = {}
    for mode in ("fresh", "reuse"):
        walls, cpus = [], []
        for _ in range(repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            passes.decode_array(blob, out=out if mode == "reuse" else None, threads=threads)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        mb = n * 4 / 1e6
        res[mode] = {"wall_best_MBps": round(mb / min(walls), 1), "wall_median_MBps": round(mb / float(np.median(walls)), 1),
                     "per_cpu_s_MBps": round(mb / float(np.median(cpus)), 1)}
    return res


BLOB_CACHE = OUT / "tcodec_blobs"


def _encoder_key() -> str:
    """The encoder's source (the tensor codec's Python and numba code): a blob cached under another
    key is encoded again."""
    h = hashlib.sha256()
    for f in ("tensorcodec.py", "_tcodec_kernels.py"):
        h.update((REPO / "passes" / f).read_bytes())
    return h.hexdigest()[:16]


def short_name(name: str) -> str:
    return name.split(".")[-2] if "embeddings" in name else name.split("::")[-1]


def cached_blob(name: str, w, snr: float) -> bytes:
    """encode_array(w, snr_db=snr), kept in bench/out/tcodec_blobs/ by the tensor's bytes and the
    encoder's source (encoding part (c)'s six blobs takes ~8 CPU minutes, decoding them milliseconds;
    bench/tcodec_decode.py shares the cache)."""
    BLOB_CACHE.mkdir(parents=True, exist_ok=True)
    wkey = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    path = BLOB_CACHE / f"{short_name(name)}-{snr:g}dB-{wkey}-{_encoder_key()}.sctc"
    if not path.exists():
        t0 = time.process_time()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(passes.encode_array(w, snr_db=snr))
        tmp.replace(path)
        print(f"encoded {short_name(name)} at {snr:g} dB in {time.process_time() - t0:.0f} CPU s", flush=True)
    return path.read_bytes()


def part_c():
    """Decode throughput of the C decoder (passes/_tcodec.c) and of the numba fallback (the
    decoder before it) on the same blobs (cached_blob), in the same run."""
    from passes import tensorcodec

    print("\n(c) decode throughput, float32 output, MB/s: wall (best / median of 5) and per CPU second of this process"
          " (the machine is shared: compare decoders within this run)")
    tensors = load_tensors({"minilm_fp32": ["m.embeddings.word_embeddings.weight"], "open_nsfw": ["onnx::Conv_5831"]})
    fast = tensorcodec._FAST
    decoders = (["C"] if fast is not None else []) + ["numba"]
    if fast is None:
        print("passes._tcodec not built (pip install -e . with a C compiler): numba decoder only")
    lanes = fast.vector_lanes(tensorcodec.SIMD) if fast is not None else None
    if lanes:
        print(f"C decoder lanes: {lanes} (avx512 / avx2 / scalar, as this CPU and build allow)")
    print(f"{'tensor':36s} {'SNR':>5s} {'bpw':>5s} {'decoder':>7s} thr | {'fresh wall best/med':>19s} {'per CPU-s':>9s} | "
          f"{'reuse wall best/med':>19s} {'per CPU-s':>9s} | load avg")
    res = []
    for (model, name), w in tensors.items():
        for target in (23.0, 35.0, 47.0):
            blob = cached_blob(name, w, target)
            for dec in decoders:
                tensorcodec._FAST = fast if dec == "C" else None
                try:
                    for threads in (1, 2):
                        sp = _decode_rates(blob, w.size, threads)
                        load = os.getloadavg()[0]
                        res.append({"tensor": name, "snr": target, "bpw": round(len(blob) * 8 / w.size, 3),
                                    "decoder": dec, "lanes": lanes if dec == "C" else None, "threads": threads, "load_avg_1min": round(load, 2), **sp})
                        f, r = sp["fresh"], sp["reuse"]
                        print(f"{name:36s} {target:5.1f} {len(blob) * 8 / w.size:5.2f} {dec:>7s} {threads:3d} | "
                              f"{f['wall_best_MBps']:9.0f}/{f['wall_median_MBps']:<9.0f} {f['per_cpu_s_MBps']:9.0f} | "
                              f"{r['wall_best_MBps']:9.0f}/{r['wall_median_MBps']:<9.0f} {r['per_cpu_s_MBps']:9.0f} | {load:.2f}",
                              flush=True)
                finally:
                    tensorcodec._FAST = fast
    c2 = [r for r in res if r["decoder"] == "C" and r["threads"] == 2]
    if c2:
        worst = min(c2, key=lambda r: r["fresh"]["wall_best_MBps"])
        print(f"C decoder, 2 threads: slowest best wall {worst['fresh']['wall_best_MBps']:.0f} MB/s fresh output "
              f"({worst['tensor']} at {worst['snr']} dB); target >= 1000 MB/s; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f}")
    return res


TARGETS = {"top1": "top1>=0.99", "cosine": "cosine>=0.999", "ctc": "ctc>=0.99"}


def _packed_size(model, tmp, label):
    path = Path(tmp) / f"{label}.onnxz"
    st = passes.pack(model, path, force=True)
    return st.packed_bytes


def _auto(src, target, calib, margs, run_as):
    """passes.compress on the calibration half; (model, summary, CPU seconds, wall seconds)."""
    c0, t0 = time.process_time(), time.perf_counter()
    model, rep = passes.compress(str(src), target=target, feeds=calib, metric_args=margs, run_as=run_as)
    return model, rep, round(time.process_time() - c0, 1), round(time.perf_counter() - t0, 1)


def _feeds_path(e):
    path = CORPUS / e.get("feeds", f"{e['name']}/feeds.npz")
    return path if path.exists() else CORPUS / e["name"] / "feeds.npz"


def part_b(only, forms_bits, run_as="onnxruntime", at_dynamic=True):
    from passes import cast_levels
    from passes import sensitivity as sens
    from passes.fidelity import evaluate, load_feeds

    manifest = json.loads((CORPUS / "MANIFEST.json").read_text())
    entries = manifest["entries"] if isinstance(manifest, dict) else manifest
    print("\n(b) packed size vs fidelity; auto calibrated on the first half of the feeds, all measured on the second half"
          f" (candidates and held-out runs: run_as={run_as})")
    print(f"{'model':16s} {'form':22s} {'packed %':>9s} {'metric':>8s} {'value':>9s} {'target met':>10s}")
    results, summary = [], []
    for e in entries:
        name, metric = e["name"], e["metric"]
        if metric == "none" or (only and name not in only):
            continue
        src = CORPUS / name / f"{name}.onnx"
        feeds = load_feeds(_feeds_path(e))
        half = len(feeds) // 2
        calib, held = feeds[:half], feeds[half:]
        margs = e.get("metric_args")
        target = TARGETS[metric]
        req = passes.fidelity.parse_requirement(target)
        orig_bytes = src.stat().st_size
        is16 = "float16" in e.get("dtypes", {})
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            def record(form, model, seconds=None, extra=None, requirement=req):
                size = _packed_size(model, tmp, form.replace("/", "_").replace(">=", "_"))
                r = evaluate(str(src), model, feeds=held, metric=metric, metric_args=margs, run_as=run_as)
                val = r.metrics.get(metric)
                row = {"model": name, "form": form, "packed_bytes": size, "packed_pct": round(100 * size / orig_bytes, 2),
                       "metric": metric, "value": val, "metrics": r.metrics, "target": str(requirement),
                       "met": bool(requirement.check(r)), "seconds": seconds, "run_as": run_as, **(extra or {})}
                rows.append(row)
                print(f"{name:16s} {form:22s} {row['packed_pct']:8.2f}% {metric:>8s} {val:9.5f} {str(row['met']):>10s}", flush=True)
                return row

            record("original (packed)", str(src))
            for b in forms_bits:
                try:
                    q = passes.quantize_weights(str(src), bits=b)
                    record(f"int{b}/channel", q)
                    # the same levels, the MatMul weights onnxruntime would run as MatMulNBits with
                    # int8 activations read through Cast+Mul (float MatMuls: the auto mode's form)
                    fused = sens.fused_matmul_blocks([q], [n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"])
                    if fused:
                        record(f"int{b}/channel/cast", cast_levels.as_cast_mul(q, fused))
                except passes.SurgeonError as exc:
                    print(f"{name:16s} int{b}/channel: {exc}")
            try:
                from onnxruntime.quantization import QuantType, quantize_dynamic

                dyn = Path(tmp) / "dyn.onnx"
                quantize_dynamic(str(src), str(dyn), per_channel=True, weight_type=QuantType.QInt8)
                record("quantize_dynamic", str(dyn), extra={"onnx_bytes": dyn.stat().st_size})
            except Exception as exc:  # onnxruntime's quantizer refuses some models
                print(f"{name:16s} quantize_dynamic failed: {str(exc).splitlines()[0][:100]}")
            dyn = next((r for r in rows if r["form"] == "quantize_dynamic"), None)
            auto_targets = [("auto", target)]
            if at_dynamic and dyn and dyn["value"] is not None and not dyn["met"]:
                # our smallest model at quantize_dynamic's own (held-out) fidelity
                auto_targets.append(("auto@dynamic", f"{metric}>={math.floor(dyn['value'] * 1e4) / 1e4:.4f}"))
            for form, tgt in auto_targets:
                try:
                    model, rep, cpu, wall = _auto(src, tgt, calib, margs, run_as)
                except passes.SurgeonError as exc:
                    print(f"{name:16s} {form} failed: {exc}")
                    continue
                forms = {}
                for t in rep["tensors"]:
                    forms[t["form"]] = forms.get(t["form"], 0) + 1
                record(form, model, cpu, {"auto_target": tgt, "auto_forms": forms, "auto_calib_fidelity": rep["fidelity"],
                                          "auto_notes": rep["notes"], "auto_wall_s": wall, "auto_cpu_stages": rep.get("cpu_seconds")},
                       requirement=passes.fidelity.parse_requirement(tgt))
        auto = next((r for r in rows if r["form"] == "auto"), None)
        at_dyn = next((r for r in rows if r["form"] == "auto@dynamic"), None)
        int8 = next((r for r in rows if r["form"] == "int8/channel"), None)
        is_float = any(k.startswith("float") and v > 0.5 * sum(e.get("dtypes", {}).values())
                       for k, v in e.get("dtypes", {}).items())
        goal = 25.0 if is16 else 12.5
        summary.append({"model": name, "metric": metric, "float": is_float, "goal_pct": goal if is_float else None,
                        "auto": auto, "int8": int8, "dynamic": dyn, "auto_at_dynamic": at_dyn})
        if auto and not is_float:
            print(f"{name:16s} weights already integer: size goals apply to float models; "
                  f"target on held-out half: {'met' if auto['met'] else 'MISSED'}")
        elif auto:
            half_dyn = dyn["packed_bytes"] / 2 if dyn else None
            verdict = (f"auto {auto['packed_pct']:.2f}% (goal <= {goal}%: {'ok' if auto['packed_pct'] <= goal else 'MISSED'})"
                       + (f", vs quantize_dynamic packed {dyn['packed_pct']:.2f}%: "
                          f"{'ok' if auto['packed_bytes'] <= half_dyn else 'MISSED'} (goal <= half)" if dyn else "")
                       + f", target on held-out half: {'met' if auto['met'] else 'MISSED'}")
            print(f"{name:16s} {verdict}")
        results.extend(rows)
    print_summary(summary)
    return results, summary


def _fmt(row, with_value=True):
    if not row:
        return "-"
    v = row["value"]
    return f"{row['packed_pct']:.2f}%" + (f" ({row['metric']} {v:.5f})" if with_value and v is not None else "")


def print_summary(summary):
    print("\n| model | auto packed | held-out fidelity | target met | int8/channel packed | quantize_dynamic packed "
          "| ours at quantize_dynamic's fidelity | auto CPU s (wall s) |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summary:
        a, d, ad = s["auto"], s["dynamic"], s["auto_at_dynamic"]
        if not a:
            continue
        at_dyn = (f"{ad['packed_pct']:.2f}% ({ad['metric']} {ad['value']:.5f}, {'met' if ad['met'] else 'MISSED'} "
                  f"{ad['target']}; {'<=' if d and ad['packed_bytes'] <= d['packed_bytes'] / 2 else '>'} half)") if ad else (
            "dynamic meets the target" if d and d["met"] else "-")
        goal = f" (goal <= {s['goal_pct']}%)" if s["goal_pct"] else ""
        print(f"| {s['model']} | {a['packed_pct']:.2f}%{goal} | {a['metric']} {a['value']:.5f} | "
              f"{'yes' if a['met'] else 'NO'} | {_fmt(s['int8'])} | {_fmt(d)} | {at_dyn} | "
              f"{a['seconds']} ({a.get('auto_wall_s')}) |")


def plot(results_b, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    models = sorted({r["model"] for r in results_b})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = [r for r in results_b if r["model"] == m and r["value"] is not None]
        uni = sorted([r for r in rows if r["form"].startswith("int")], key=lambda r: r["packed_pct"])
        ax.plot([r["packed_pct"] for r in uni], [r["value"] for r in uni], "o-", label="uniform n-bit")
        for r in rows:
            if r["form"] in ("auto", "quantize_dynamic", "original (packed)"):
                ax.plot([r["packed_pct"]], [r["value"]], "s" if r["form"] == "auto" else "^", label=r["form"])
        ax.set_title(m)
        ax.set_xlabel("packed size, % of original")
        ax.set_ylabel(rows[0]["metric"] if rows else "")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--only", nargs="*", default=None, help="corpus models for part (b)")
    ap.add_argument("--rows", type=int, default=len(ROWS), help="first N rows of part (a)")
    ap.add_argument("--bits", default="3,4,5,6,8", help="uniform widths of part (b)")
    ap.add_argument("--json", default=None, help="output file name under bench/out (default lossy.json)")
    ap.add_argument("--run-as", default="onnxruntime", choices=("onnxruntime", "fold"),
                    help="part (b): how candidates and held-out runs execute (fold: weights folded to float)")
    ap.add_argument("--no-at-dynamic", action="store_true",
                    help="part (b): skip the auto run at quantize_dynamic's fidelity")
    ap.add_argument("--merge", nargs="*", default=None,
                    help="part (b) results of several runs (bench/out/*.json, e.g. groups run in parallel with "
                         "--json): merged into --json (default lossy.json) and one summary table printed")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merged = {"b_models": [], "b_summary": []}
        for name in args.merge:
            part = json.loads((OUT / name).read_text())
            merged["b_models"] += part.get("b_models", [])
            merged["b_summary"] += part.get("b_summary", [])
        out_json = OUT / (args.json or "lossy.json")
        data = json.loads(out_json.read_text()) if out_json.exists() else {}
        data.update(merged)
        out_json.write_text(json.dumps(data, indent=1, default=str))
        print_summary(merged["b_summary"])
        plot(merged["b_models"], OUT / "lossy.png")
        return
    out_json = OUT / (args.json or "lossy.json")
    data = json.loads(out_json.read_text()) if out_json.exists() else {}
    if "a" in args.parts:
        data["a_rate_distortion"] = part_a(args.rows)
        out_json.write_text(json.dumps(data, indent=1, default=str))
    if "c" in args.parts:
        data["c_decode"] = part_c()
        out_json.write_text(json.dumps(data, indent=1, default=str))
    if "b" in args.parts:
        fresh, summary = part_b(args.only, [int(b) for b in args.bits.split(",") if b], args.run_as,
                                not args.no_at_dynamic)
        done = {r["model"] for r in fresh}
        # runs of other models (--only) are kept: the table grows model by model
        data["b_models"] = [r for r in data.get("b_models", []) if r["model"] not in done] + fresh
        data["b_summary"] = [r for r in data.get("b_summary", []) if r["model"] not in done] + summary
        out_json.write_text(json.dumps(data, indent=1, default=str))
        plot(data["b_models"], OUT / "lossy.png")
    print(f"\nwrote {out_json}")


if __name__ == "__main__":
    main()
