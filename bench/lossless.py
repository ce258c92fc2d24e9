"""Lossless-stage benchmark (not a test): sizes and speeds of `.onnxz` against zip, zstd and ZipNN.

    python bench/lossless.py [--only NAME ...] [--no-int8] [--repeat 3]

For every corpus model, and for the int8 output of `passes.quantize_weights` on each float model:
the original size and, as % of it, zip -9 (deflate), zstd -19, ZipNN on the same tensors (each
payload the pack stage cuts out, ZipNN 0.5.4 `input_format="byte"` with the tensor's dtype; 1-byte
and integer types as "float32"; the rest of the file counted at our skeleton size), `.onnxz`, and
order-0 bounds per tensor (floats: sign/exponent o0 + raw rest, top-16-bit o0 + raw rest; other
types: o0 of each byte plane), plus int8 tensors against the o0 bound of their bytes. Then decode
throughput on the same tensors (ZipNN decompress vs our chunk decode into a preallocated buffer,
runs interleaved; "cpu" = process CPU time at 1 thread, robust to other processes' load; t1/t2 =
wall clock at 1/2 threads), and pack / unpack-to-file (sha256 checked, written) wall-clock
throughput, at 1 and 2 threads, in the same run (best of --repeat).

Needs `pip install zipnn` (bench only; not a project dependency). Writes bench/out/lossless.json;
zip/zstd sizes are cached in bench/out/lossless_cache.json by file sha256 (they are slow).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import zstandard as zstd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import passes  # noqa: E402
from passes.onnxz.codecs import BFLOAT16, DOUBLE, FLOAT, FLOAT16, INT8, UINT8  # noqa: E402
from passes.onnxz.reader import PackedFile  # noqa: E402

OUT = REPO / "bench" / "out"
CORPUS = [Path(os.environ["SURGEON_CORPUS"])] if os.environ.get("SURGEON_CORPUS") else []
CORPUS += [REPO.parent / "shared" / "corpus", Path("/work/shared/corpus")]
MB = 1e6


def corpus_dir() -> Path:
    for c in CORPUS:
        if (c / "MANIFEST.json").is_file():
            return c
    sys.exit("corpus not found")


def entropy_bits(sym: np.ndarray, n: int) -> float:
    """Total bits of an ideal order-0 coder over the symbols."""
    c = np.bincount(sym, minlength=n).astype(np.float64)
    c = c[c > 0]
    return float(-(c * np.log2(c / c.sum())).sum())


def tensor_bounds(data: np.ndarray, dtype: int):
    """(sign/exponent bound, top-16 bound, byte-o0 bound) in bytes for one payload."""
    if dtype == FLOAT and data.size % 4 == 0:
        u = data.view(np.uint32)
        se = entropy_bits(((u >> 23) & 0xFF).astype(np.int64), 256) + 24 * u.size
        t16 = entropy_bits((u >> 16).astype(np.int64), 65536) + 16 * u.size
        return se / 8, t16 / 8, None
    if dtype in (FLOAT16, BFLOAT16) and data.size % 2 == 0:
        u = data.view(np.uint16)
        shift, mask, rest = (10, 0x1F, 11) if dtype == FLOAT16 else (7, 0xFF, 8)
        se = entropy_bits(((u >> shift) & mask).astype(np.int64), 256) + rest * u.size
        t16 = entropy_bits(u.astype(np.int64), 65536)
        return se / 8, t16 / 8, None
    if dtype == DOUBLE and data.size % 8 == 0:
        u = data.view(np.uint64)
        se = entropy_bits(((u >> 52) & 0x7FF).astype(np.int64), 2048) + 53 * u.size
        t16 = entropy_bits((u >> 48).astype(np.int64), 65536) + 48 * u.size
        return se / 8, t16 / 8, None
    o0 = entropy_bits(data.astype(np.int64), 256) / 8
    return o0, o0, o0


_ZIPNN_DTYPE = {FLOAT: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}


def zipnn_codec(dtype: int, threads: int):
    from zipnn import ZipNN

    return ZipNN(input_format="byte", bytearray_dtype=_ZIPNN_DTYPE.get(dtype, "float32"), threads=threads)


def best_of(fn, repeat: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def race(fns: dict, repeat: int, clock) -> dict:
    """Best time of each function, the runs interleaved (machine load hits both alike)."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            best[k] = min(best[k], clock() - t0)
    return best


def whole_file_sizes(files, cache: dict) -> dict:
    data = b"".join(Path(f).read_bytes() for f in files)
    key = hashlib.sha256(data).hexdigest()
    if key not in cache:
        cache[key] = {
            "zip -9": len(zlib.compress(data, 9)) + 22 + 2 * (30 + 46),  # deflate + zip headers
            "zstd -19": len(zstd.ZstdCompressor(level=19, threads=2).compress(data)),
        }
    return cache[key]


def bench_model(name: str, path: Path, repeat: int, cache: dict, tmp: Path) -> dict:
    packed = tmp / f"{name}.onnxz"
    stats = passes.pack(path, packed, force=True, threads=2)
    pf = PackedFile(packed, threads=1)
    idx = pf.index
    files = [path] + [path.parent / f.name for f in idx.files[1:]]
    original = sum(f.size for f in idx.files)
    row = {"model": name, "bytes": original, ".onnxz": stats.packed_bytes}
    row.update(whole_file_sizes(files, cache))

    # the same tensors for ZipNN, the bounds and the decode timing
    blobs = [Path(f).read_bytes() for f in files]
    cut = [(t, np.frombuffer(blobs[t.file], np.uint8, count=t.length, offset=t.offset)) for t in idx.tensors if t.stream is not None]
    skeleton = sum(f.skeleton.stored for f in idx.files)
    index_and_header = stats.packed_bytes - skeleton - sum(t.stream.stored for t, _ in cut)
    zipnn_total = skeleton + index_and_header
    zipnn_streams = []
    b_se = b_t16 = float(skeleton + index_and_header)
    i8_raw = i8_bound = i8_ours = 0
    f32_ours = f32_t16 = f32_raw = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t, data in cut:
            dtype = t.dtype if t.field not in ("float_data", "double_data") else (FLOAT if t.field == "float_data" else DOUBLE)
            se, t16, o0 = tensor_bounds(data, dtype)
            b_se += se
            b_t16 += t16
            if dtype in (INT8, UINT8):
                i8_raw += data.size
                i8_bound += o0
                i8_ours += t.stream.stored
            if dtype == FLOAT:
                f32_ours += t.stream.stored
                f32_t16 += t16
                f32_raw += data.size
            z = zipnn_codec(dtype, 1)
            try:
                comp = bytes(z.compress(bytearray(data.tobytes())))  # compress() rewrites its input: a copy
                assert bytes(z.decompress(comp)) == data.tobytes()
            except Exception:
                comp = zstd.ZstdCompressor(level=3).compress(data.tobytes())
                z = None
            zipnn_total += len(comp)
            zipnn_streams.append((dtype, comp, z is not None, data.size))
    row["ZipNN"] = zipnn_total
    row["bound s/e"] = b_se
    row["bound top16"] = b_t16
    if i8_raw:
        row["int8 ours/o0"] = i8_ours / i8_bound
    if f32_raw:
        row["f32 ours/top16"] = f32_ours / f32_t16
    pf.close()

    # speeds on the same tensors
    raw_total = sum(d.size for _, d in cut)
    for threads in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codecs_ = {dt: zipnn_codec(dt, threads) for dt in {s[0] for s in zipnn_streams}}

            def zipnn_decode():
                for dt, comp, ok, _ in zipnn_streams:
                    if ok:
                        codecs_[dt].decompress(comp)
                    else:
                        zstd.ZstdDecompressor().decompress(comp)

            def zipnn_encode():
                for t, data in cut:
                    dtype = t.dtype if t.field not in ("float_data", "double_data") else (FLOAT if t.field == "float_data" else DOUBLE)
                    codecs_.get(dtype, codecs_[next(iter(codecs_))]).compress(bytearray(data.tobytes()))

        pf = PackedFile(packed, threads=threads)
        outs = [np.empty(t.length, np.uint8) for t, _ in cut]
        tensors = [t for t, _ in cut]

        def ours_decode():
            tasks = []
            for t, out in zip(tensors, outs):
                tasks.extend(pf.stream_tasks(t.stream, out))
            pf._run(tasks)

        if cut:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wall = race({"ZipNN": zipnn_decode, ".onnxz": ours_decode}, repeat, time.perf_counter)
                row[f"ZipNN dec MB/s t{threads}"] = raw_total / wall["ZipNN"] / MB
                row[f".onnxz dec MB/s t{threads}"] = raw_total / wall[".onnxz"] / MB
                if threads == 1:  # CPU time: what one core costs, robust to other processes' load
                    cpu = race({"ZipNN": zipnn_decode, ".onnxz": ours_decode}, repeat, time.process_time)
                    row["ZipNN dec MB/s cpu"] = raw_total / cpu["ZipNN"] / MB
                    row[".onnxz dec MB/s cpu"] = raw_total / cpu[".onnxz"] / MB
                row[f"ZipNN enc MB/s t{threads}"] = raw_total / best_of(zipnn_encode, 1) / MB
            for (t, data), out in zip(cut, outs):
                assert np.array_equal(out, data), t.key
        pf.close()
        dst = tmp / f"{name}.t{threads}.onnx"

        def ours_unpack():
            passes.unpack(packed, dst, threads=threads, force=True)

        row[f".onnxz unpack MB/s t{threads}"] = original / best_of(ours_unpack, repeat) / MB
        t0 = time.perf_counter()
        passes.pack(path, tmp / "speed.onnxz", threads=threads, force=True)
        row[f".onnxz pack MB/s t{threads}"] = original / (time.perf_counter() - t0) / MB
    assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(blobs[0]).digest()
    for f in tmp.glob(f"{name}*"):
        f.unlink()
    return row


def int8_models(corpus: Path, names, tmp: Path):
    """(name, path) of quantize_weights(bits=8) outputs of the float models, or a note why not."""
    try:
        from passes import quantize_weights
    except Exception as exc:  # the quantize pass is not there yet
        print(f"int8 rows skipped: passes.quantize_weights unavailable ({exc})")
        return []
    manifest = {e["name"]: e for e in json.loads((corpus / "MANIFEST.json").read_text())}
    out = []
    for name in names:
        dtypes = manifest[name].get("dtypes", {})
        if not any(k.startswith(("float", "bfloat")) and v > 100000 for k, v in dtypes.items()):
            continue
        dst = OUT / "int8" / f"{name}.int8.onnx"
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                q = quantize_weights(corpus / manifest[name]["file"], bits=8)
                passes.save_model(q, dst, force=True)
            except Exception as exc:
                print(f"int8 row for {name} skipped: quantize_weights failed ({type(exc).__name__}: {exc})")
                continue
        out.append((f"{name}.int8", dst))
    return out


COLUMNS = ["zip -9", "zstd -19", "ZipNN", ".onnxz", "bound s/e", "bound top16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--no-int8", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    corpus = corpus_dir()
    manifest = json.loads((corpus / "MANIFEST.json").read_text())
    names = [e["name"] for e in manifest if not args.only or e["name"] in args.only]
    OUT.mkdir(parents=True, exist_ok=True)
    cache_path = OUT / "lossless_cache.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    models = [(n, corpus / next(e for e in manifest if e["name"] == n)["file"]) for n in names]
    rows = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmpd:
        tmp = Path(tmpd)
        if not args.no_int8:
            models += int8_models(corpus, names, tmp)
        for name, path in models:
            rows.append(bench_model(name, path, args.repeat, cache, tmp))
            cache_path.write_text(json.dumps(cache))
            r = rows[-1]
            print(f"  {name}: .onnxz {100 * r['.onnxz'] / r['bytes']:.2f}%", file=sys.stderr)
    head = f"| model | MB | " + " | ".join(COLUMNS) + " | .onnxz ≤ min(ZipNN, zstd) | f32 ours/top16 | int8 ours/o0 |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        pct = [f"{100 * r[c] / r['bytes']:.2f}%" for c in COLUMNS]
        ok = "yes" if r[".onnxz"] <= min(r["ZipNN"], r["zstd -19"]) else "NO"
        f32 = f"{r['f32 ours/top16']:.4f}" if "f32 ours/top16" in r else "–"
        i8 = f"{r['int8 ours/o0']:.4f}" if "int8 ours/o0" in r else "–"
        print(f"| {r['model']} | {r['bytes'] / MB:.1f} | " + " | ".join(pct) + f" | {ok} | {f32} | {i8} |")
    print()
    sp = ["ZipNN dec MB/s cpu", ".onnxz dec MB/s cpu", "ZipNN dec MB/s t1", ".onnxz dec MB/s t1", "ZipNN dec MB/s t2", ".onnxz dec MB/s t2",
          ".onnxz unpack MB/s t1", ".onnxz unpack MB/s t2", "ZipNN enc MB/s t1", ".onnxz pack MB/s t1",
          "ZipNN enc MB/s t2", ".onnxz pack MB/s t2"]
    head = "| model | " + " | ".join(s.replace(" MB/s", "") for s in sp) + " | dec ×ZipNN cpu | t1 | t2 |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        vals = [f"{r[s]:.0f}" if s in r else "–" for s in sp]
        xs = [r[f".onnxz dec MB/s {k}"] / r[f"ZipNN dec MB/s {k}"] if f"ZipNN dec MB/s {k}" in r else 0 for k in ("cpu", "t1", "t2")]
        print(f"| {r['model']} | " + " | ".join(vals) + " | " + " | ".join(f"{x:.2f}" for x in xs) + " |")
    (OUT / "lossless.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {OUT / 'lossless.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
