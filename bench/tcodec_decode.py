#!/usr/bin/env python3
"""Decode speed of the tensor codec (issue 4 goal: >= 1 GB/s of float32 output on 2 threads), on
the six blobs of `bench/lossy.py --parts c` (word_embeddings of minilm_fp32 and Conv_5831 of
open_nsfw at 23 / 35 / 47 dB), measured by part (c)'s own helper (`lossy._decode_rates`).

What this adds to part (c), for work on the decoder: the blobs are cached (bench/out/tcodec_blobs/,
keyed by the tensor and the encoder's source: encoding them takes ~8 CPU minutes, decoding
milliseconds), the C decoder runs with its vector lanes (AVX-512, else AVX2: the row says which) and
with its scalar lanes only, and each row says how many CPU seconds one decode costs, so that a
loaded machine (the wall figures) can be told from a slow decoder (the CPU figures).

    python bench/tcodec_decode.py [--repeat 9] [--only word_embeddings|Conv_5831] [--no-scalar]
    python bench/tcodec_decode.py --ab OLD.so [--rounds 150] [--only ...]

--ab compares the built decoder with another build of passes/_tcodec.c (e.g. the .so before a
change, compiled out of tree): both loaded in this process, the C decode call alone (1 thread,
reused output) alternating between them call by call in a shuffled order, so that both see the
same machine load; prints CPU ms min / median and the median of the per-round ratios new/old,
and checks that both decode every blob to the same bits. Both builds get the call this
decode_array makes: OLD.so must take the same arguments (builds before 2026-12-02's records
argument, n_ctx, do not).

Prints a table, writes bench/out/tcodec_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import lossy  # noqa: E402  (part (c)'s tensors and its decode-rate helper)

import passes  # noqa: E402
from passes import tensorcodec  # noqa: E402

OUT = REPO / "bench" / "out"
TENSORS = {"minilm_fp32": ["m.embeddings.word_embeddings.weight"], "open_nsfw": ["onnx::Conv_5831"]}
SNRS = (23.0, 35.0, 47.0)


def blobs(only=None):
    """{(tensor name, snr): (blob, n)}, encoded once per tensor and encoder version (lossy.cached_blob)."""
    tensors = lossy.load_tensors(TENSORS)
    res = {}
    for (_, name), w in tensors.items():
        short = lossy.short_name(name)
        if only and short not in only:
            continue
        for snr in SNRS:
            res[(short, snr)] = (lossy.cached_blob(name, w, snr), w.size)
    return res


def _cpu_per_decode(blob, n, threads, repeat):
    """Median CPU seconds per decode into a fresh array: (all threads, the calling thread). The
    calling thread runs the serial part (CRC, parsing) and its share of the chunks; on a machine
    with `threads` idle cores the wall time is about max(calling, all - calling): the estimate
    this script prints beside the wall figures, which a loaded machine cannot show."""
    cpus, mains = [], []
    for _ in range(repeat):
        c0, m0 = time.process_time(), time.thread_time()
        passes.decode_array(blob, threads=threads)
        mains.append(time.thread_time() - m0)
        cpus.append(time.process_time() - c0)
    return float(np.median(cpus)), float(np.median(mains))


def _load_decoder(path):
    """Another build of passes/_tcodec.c, as a module (its init function is PyInit__tcodec)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tcodec", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _decode_call(blob):
    """The arguments decode_array passes to the C decoder for this blob (captured from one call)."""
    fast, seen = tensorcodec._FAST, {}

    class Spy:
        def __getattr__(self, name):
            return getattr(fast, name)

        def decode(self, *args):
            seen["args"] = list(args)
            return fast.decode(*args)

    tensorcodec._FAST = Spy()
    try:
        passes.decode_array(blob)
    finally:
        tensorcodec._FAST = fast
    return seen["args"]


def ab_rows(old_path, rounds, only=None):
    """The built decoder against OLD_PATH, interleaved call by call (see --ab)."""
    import random

    decoders = {"old": _load_decoder(old_path), "new": tensorcodec._FAST}
    print(f"C decode call alone, 1 thread, reused output, CPU ms; {rounds} rounds, old = {old_path}")
    rows = []
    for (name, snr), (blob, n) in blobs(only).items():
        args = _decode_call(blob)
        args[17] = 1  # threads (the 18th argument of _tcodec.decode)
        outs = {k: np.empty(n, np.float32) for k in decoders}
        cpu = {k: [] for k in decoders}
        for _ in range(rounds):
            for k in random.sample(list(decoders), len(decoders)):
                call = list(args)
                call[5] = outs[k]
                c0 = time.thread_time()
                decoders[k].decode(*call)
                cpu[k].append(time.thread_time() - c0)
        same = np.array_equal(outs["old"].view(np.uint32), outs["new"].view(np.uint32))
        ratio = float(np.median(np.array(cpu["new"]) / np.array(cpu["old"])))
        row = {"tensor": name, "snr": snr, "same_output": same, "ratio_new_old_median": round(ratio, 4),
               **{f"{k}_cpu_ms_min": round(min(v) * 1e3, 3) for k, v in cpu.items()},
               **{f"{k}_cpu_ms_median": round(float(np.median(v)) * 1e3, 3) for k, v in cpu.items()},
               "load_avg_1min": round(os.getloadavg()[0], 2)}
        rows.append(row)
        print(f"{name + f' {snr:g} dB':22s} old {row['old_cpu_ms_min']:8.3f} / {row['old_cpu_ms_median']:8.3f}  "
              f"new {row['new_cpu_ms_min']:8.3f} / {row['new_cpu_ms_median']:8.3f}  new/old {ratio:.3f}  "
              f"{'same output' if same else 'OUTPUTS DIFFER'}  load {row['load_avg_1min']:.1f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9, help="decodes per figure (best and median reported)")
    ap.add_argument("--only", nargs="*", default=None, help="word_embeddings and/or Conv_5831")
    ap.add_argument("--no-scalar", action="store_true", help="skip the scalar-lanes rows")
    ap.add_argument("--ab", metavar="OLD.so", default=None,
                    help="compare the built decoder with this build, interleaved call by call")
    ap.add_argument("--rounds", type=int, default=150, help="calls per decoder and blob with --ab")
    args = ap.parse_args(argv)
    if tensorcodec._FAST is None:
        print("passes._tcodec is not built: nothing to measure here (see bench/lossy.py --parts c for numba)")
        return 1
    if args.ab:
        rows = ab_rows(args.ab, args.rounds, args.only)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "tcodec_decode_ab.json").write_text(json.dumps({"old": args.ab, "rows": rows}, indent=1))
        return 0 if all(r["same_output"] for r in rows) else 1
    # the vector lanes this CPU runs (AVX-512, else AVX2), by the decoder's own dispatch
    kind = getattr(tensorcodec._FAST, "vector_lanes", lambda simd: "vector")(tensorcodec.SIMD)
    # (where the CPU has no vector lanes the SIMD setting runs the scalar lanes: one set of rows)
    modes = [(kind, tensorcodec.SIMD)] + ([] if args.no_scalar or kind == "scalar" else [("scalar", 0)])
    print(f"decode_array, MB/s of float32 output: wall best / median of {args.repeat}; CPU ms per decode "
          f"(fresh output, all threads); {os.cpu_count()} CPUs")
    print("2 threads, CPU ms of the calling thread / the other, and the MB/s they allow on 2 idle cores "
          "(fresh output): n*4 / max(calling, other)")
    print(f"{'blob':22s} {'bpw':>5s} {'lanes':>6s} | {'1 thread':>11s} | {'2 thr fresh':>11s} | "
          f"{'2 thr reused':>12s} | {'CPU ms 1t/2t':>12s} | {'2t: calling/other, MB/s':>23s} | load")
    rows = []
    saved = tensorcodec.SIMD
    try:
        for (name, snr), (blob, n) in blobs(args.only).items():
            for label, simd in modes:
                tensorcodec.SIMD = simd
                r1 = lossy._decode_rates(blob, n, 1, args.repeat)
                r2 = lossy._decode_rates(blob, n, 2, args.repeat)
                cpu1, _ = _cpu_per_decode(blob, n, 1, args.repeat)
                cpu2, main2 = _cpu_per_decode(blob, n, 2, args.repeat)
                est2 = n * 4 / 1e6 / max(main2, cpu2 - main2)
                load = os.getloadavg()[0]
                row = {"tensor": name, "snr": snr, "bpw": round(len(blob) * 8 / n, 3), "lanes": label,
                       "threads1": r1, "threads2": r2, "cpu_ms_1t": round(cpu1 * 1e3, 2),
                       "cpu_ms_2t": round(cpu2 * 1e3, 2), "cpu_ms_2t_calling_thread": round(main2 * 1e3, 2),
                       "est_2_idle_cores_MBps": round(est2, 1), "load_avg_1min": round(load, 2)}
                rows.append(row)

                def bm(r):
                    return f"{r['wall_best_MBps']:5.0f}/{r['wall_median_MBps']:<5.0f}"
                print(f"{name + f' {snr:g} dB':22s} {row['bpw']:5.2f} {label:>6s} | {bm(r1['fresh'])} | "
                      f"{bm(r2['fresh'])} | {bm(r2['reuse']):>12s} | {cpu1 * 1e3:5.1f}/{cpu2 * 1e3:<6.1f} | "
                      f"{main2 * 1e3:5.1f}/{(cpu2 - main2) * 1e3:<5.1f} {est2:5.0f} | {load:.1f}", flush=True)
    finally:
        tensorcodec.SIMD = saved
    vec = [r for r in rows if r["lanes"] == kind]
    if vec:
        worst = min(vec, key=lambda r: r["threads2"]["fresh"]["wall_best_MBps"])
        print(f"slowest, 2 threads, fresh output (best wall): {worst['threads2']['fresh']['wall_best_MBps']:.0f} MB/s "
              f"({worst['tensor']} {worst['snr']:g} dB); goal >= 1000")
        low = min(vec, key=lambda r: r["est_2_idle_cores_MBps"])
        print(f"slowest on 2 idle cores by CPU time: {low['est_2_idle_cores_MBps']:.0f} MB/s ({low['tensor']} "
              f"{low['snr']:g} dB); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tcodec_decode.json").write_text(json.dumps({"command": " ".join(["python bench/tcodec_decode.py"] + (argv or sys.argv[1:])),
                                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
