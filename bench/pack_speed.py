"""Pack speed of `.onnxz` (not a test): ours against ZipNN's encoder, and A/B against a baseline tree.

For every corpus model (and the int8 outputs of `compress` that bench/lossless.py left in
bench/out/int8/):
- ZipNN enc: ZipNN 0.5.x `compress` of every payload our pack cuts out (the same tensors, its dtype,
  1 thread), from memory: MB/s of those raw bytes, CPU (best of --rounds).
- ours enc: `codecs.encode_tensor` of the same payloads with the file's shared tables, from memory,
  CPU: the like-for-like figure against ZipNN enc.
- ours pack: `passes.pack` of the whole file (read, parse, sha256 + XXH3-128, encode, index, fsync),
  MB/s of the original file(s), CPU at 1 thread and wall at 2 threads, each in a fresh process,
  median of --rounds; with --baseline DIR (a checkout of an older tree, its extensions built) the
  baseline packs in the same rounds, order alternating, and the table shows both, the packed sizes
  and whether the bytes are identical.

  OPENBLAS_NUM_THREADS=1 nice -n 5 python bench/pack_speed.py [--baseline DIR] [--extra BIG.onnx]

Writes bench/out/pack_speed.json. Needs `pip install zipnn` for the ZipNN column (else blank).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "bench" / "out"
CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
FLOAT_MODELS = ["open_nsfw", "minilm_fp32", "minilm_int8", "ddddocr_old", "silero_vad_v6", "rapidocr_cls",
                "piper_joe", "open_nsfw_fp16", "minilm_fp16"]
MB = 1 << 20

# one timed pack in a fresh process (after a warm-up pack of the same file): {"cpu", "wall", "size", "sha"}
_CHILD = r"""
import hashlib, json, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import passes
src, dst, threads = sys.argv[2], sys.argv[3], int(sys.argv[4])
passes.pack(src, dst, threads=threads, force=True)
w0, c0 = time.perf_counter(), time.process_time()
passes.pack(src, dst, threads=threads, force=True)
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
data = open(dst, "rb").read()
print(json.dumps({"cpu": cpu, "wall": wall, "size": len(data), "sha": hashlib.sha256(data).hexdigest()}))
"""


def models():
    out = [(n, CORPUS / n / f"{n}.onnx") for n in FLOAT_MODELS if (CORPUS / n / f"{n}.onnx").exists()]
    out += [(p.stem, p) for p in sorted((OUT / "int8").glob("*.onnx"))]
    return out


def child_pack(tree: Path, src: Path, dst: Path, threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(src), str(dst), str(threads)],
                       capture_output=True, text=True, env=env, cwd=str(tree))
    if r.returncode:
        raise RuntimeError(f"pack of {src} in {tree} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cut_payloads(path: Path, packed: Path):
    """(dtype, field, bytes) of every payload the pack cut out, and the shared tables it used."""
    from passes.onnxz import codecs
    from passes.onnxz.reader import PackedFile

    pf = PackedFile(packed, threads=1)
    files = [path] + [path.parent / f.name for f in pf.index.files[1:]]
    blobs = [f.read_bytes() for f in files]
    out = [(t.dtype, t.field, np.frombuffer(blobs[t.file], np.uint8, count=t.length, offset=t.offset))
           for t in pf.index.tensors if t.stream is not None]
    pf.close()
    shared = codecs.SharedTables.build((d, t, f) for t, f, d in out if d.size <= codecs.SHARED_MAX_BYTES)
    return out, shared


def best_cpu(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best


def zipnn_encoder():
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    from passes.onnxz.codecs import BFLOAT16, FLOAT, FLOAT16
    names = {FLOAT: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}
    cache = {}

    def encode(payloads):
        for dtype, field, data in payloads:
            dt = FLOAT if field == "float_data" else dtype
            z = cache.get(dt)
            if z is None:
                z = cache[dt] = ZipNN(input_format="byte", bytearray_dtype=names.get(dt, "float32"), threads=1)
            z.compress(bytearray(data.tobytes()))  # compress() rewrites its input: a copy (as bench/lossless.py)

    return encode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="tree of the baseline (its passes/ and built extensions)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--extra", nargs="*", type=Path, default=[], help="more .onnx files to measure (e.g. a large generated model)")
    ap.add_argument("--json", default="pack_speed.json")
    args = ap.parse_args(argv)
    from passes.onnxz import codecs

    zipnn = zipnn_encoder()
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="pack_speed_"))
    trees = {"new": REPO}
    if args.baseline:
        trees["base"] = args.baseline.resolve()
    for name, path in models() + [(p.stem, p) for p in args.extra]:
        if args.only and name not in args.only:
            continue
        original = path.stat().st_size  # external data files: none in this corpus
        row = {"model": name, "bytes": original}
        samples = {(k, t): [] for k in trees for t in (1, 2)}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for k in order:
                for t in (1, 2):
                    got = child_pack(trees[k], path, tmp / f"{name}.{k}.onnxz", t)
                    samples[(k, t)].append(got)
        for k in trees:
            row[f"{k} pack cpu t1"] = original / np.median([s["cpu"] for s in samples[(k, 1)]]) / MB
            row[f"{k} pack wall t2"] = original / np.median([s["wall"] for s in samples[(k, 2)]]) / MB
            row[f"{k} size"] = samples[(k, 1)][0]["size"]
            shas = {s["sha"] for t in (1, 2) for s in samples[(k, t)]}
            row[f"{k} deterministic"] = len(shas) == 1
            row[f"{k} sha"] = samples[(k, 1)][0]["sha"]
        if "base" in trees:
            row["same bytes"] = row["new sha"] == row["base sha"]
        payloads, shared = cut_payloads(path, tmp / f"{name}.new.onnxz")
        raw = sum(d.size for _, _, d in payloads)
        row["cut bytes"] = raw
        extra = {"shared": shared} if shared else {}
        row["ours enc cpu t1"] = raw / best_cpu(lambda: [codecs.encode_tensor(d, t, f, **extra) for t, f, d in payloads],
                                                args.rounds) / MB
        if zipnn is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row["ZipNN enc cpu t1"] = raw / best_cpu(lambda: zipnn(payloads), args.rounds) / MB
        rows.append(row)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if "sha" not in k}), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.json).write_text(json.dumps(rows, indent=1))
    print()
    base = "base" in trees
    head = "| model | ZipNN enc cpu t1 | ours enc cpu t1 | ours pack cpu t1 | ours pack wall t2 | size | same bytes |"
    if base:
        head = "| model | ZipNN enc cpu t1 | ours enc cpu t1 | ours pack cpu t1 (base → new) | pack wall t2 (base → new) | size (base → new) | same bytes |"
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    for r in rows:
        z = f"{r['ZipNN enc cpu t1']:.0f}" if "ZipNN enc cpu t1" in r else "–"
        if base:
            print(f"| {r['model']} | {z} | {r['ours enc cpu t1']:.0f} | {r['base pack cpu t1']:.0f} → {r['new pack cpu t1']:.0f} "
                  f"| {r['base pack wall t2']:.0f} → {r['new pack wall t2']:.0f} | {r['base size']:,} → {r['new size']:,} "
                  f"| {'yes' if r['same bytes'] else 'no'} |")
        else:
            print(f"| {r['model']} | {z} | {r['ours enc cpu t1']:.0f} | {r['new pack cpu t1']:.0f} | {r['new pack wall t2']:.0f} "
                  f"| {r['new size']:,} | – |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
