"""Lossless-stage benchmark (not a test): sizes and speeds of `.onnxz` against zip, zstd and ZipNN.

    python bench/lossless.py [--models open_nsfw,minilm_int8] [--no-int8] [--repeat 3]

For every corpus model, and for the int8 output of `passes.quantize_weights` on each float model:
the original size and, as % of it, zip -9 (deflate), zstd -19, ZipNN on the same tensors (each
payload the pack stage cuts out, ZipNN 0.5.4 `input_format="byte"` with the tensor's dtype; 1-byte
and integer types as "float32"; the rest of the file counted at our skeleton size), `.onnxz`, and
order-0 bounds per tensor (floats: sign/exponent o0 + raw rest, top-16-bit o0 + raw rest; other
types: o0 of each byte plane), plus int8 tensors against the o0 bound of their bytes.

Speeds, at 1 and 2 threads, runs of ours and ZipNN interleaved, best of --repeat, each as wall
clock and as CPU time of the process (all threads; robust to other processes' load):
- decode of the cut tensors into preallocated buffers, both from bytes in memory (ZipNN
  decompress of its streams; ours `PackedFile(bytes).tensors_bytes`), and ours from the .onnxz
  file (one pread per chunk) as a second figure;
- unpack file -> file: ours `passes.unpack` (sha256 checked) against ZipNN decompressing every
  cut tensor and writing the model file with them spliced in (skeleton bytes free for ZipNN);
  both written through the same atomic temp-file + fsync + rename;
- pack: ours `passes.pack` (the whole file: sha256, index, fsync) against ZipNN compress of the
  cut tensors only.
The int8 rows need passes.quantize_weights (outputs cached in bench/out/int8/).

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
    speeds(row, name, path, packed, blobs, cut, zipnn_streams, original, repeat, tmp)
    for f in tmp.glob(f"{name}*"):
        f.unlink()
    return row


def zipnn_restore(blobs, files_index, zipnn_streams, cut, codecs_, out_path):
    """ZipNN's side of unpack: decompress every cut payload and write the model file with the
    payloads spliced back (the skeleton bytes taken as they are, free for ZipNN), written the way
    ours is (temporary file, fsync, rename)."""
    from passes._fileio import atomic_output

    decoded = {}
    for (t, _), (dt, comp, ok, _n) in zip(cut, zipnn_streams):
        decoded[(t.file, t.offset)] = codecs_[dt].decompress(comp) if ok else zstd.ZstdDecompressor().decompress(comp)
    fe = files_index[0]
    src = memoryview(blobs[0])
    with atomic_output(out_path, True) as f:
        pos = 0
        for off, ln, _ti in fe.cuts:
            f.write(src[pos:off])
            f.write(decoded[(0, off)])
            pos = off + ln
        f.write(src[pos:])


def speeds(row, name, path, packed, blobs, cut, zipnn_streams, original, repeat, tmp):
    """Decode from memory (both), ours from the file, unpack file -> file, pack: CPU and wall at
    1 and 2 threads, runs of ours and ZipNN interleaved (load on the machine hits both alike)."""
    raw_total = sum(d.size for _, d in cut)
    packed_bytes = packed.read_bytes()
    tensors = [t for t, _ in cut]
    outs = [np.empty(t.length, np.uint8) for t in tensors]
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

        mem = PackedFile(packed_bytes, threads=threads)
        disk = PackedFile(packed, threads=threads)
        mem_tensors = [mem.tensor(t.key) for t in tensors]

        def ours_mem():
            mem.tensors_bytes(mem_tensors, outs)

        def ours_file():
            disk.tensors_bytes(tensors, outs)

        if cut:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fns = {"ZipNN": zipnn_decode, "mem": ours_mem, "file": ours_file}
                for clock, tag in ((time.perf_counter, "wall"), (time.process_time, "cpu")):
                    best = race(fns, 4 * repeat, clock)  # milliseconds each: more runs, less noise
                    row[f"ZipNN dec {tag} t{threads}"] = raw_total / best["ZipNN"] / MB
                    row[f".onnxz dec mem {tag} t{threads}"] = raw_total / best["mem"] / MB
                    row[f".onnxz dec file {tag} t{threads}"] = raw_total / best["file"] / MB
                row[f"ZipNN enc wall t{threads}"] = raw_total / best_of(zipnn_encode, 1) / MB
            for (t, data), out in zip(cut, outs):
                assert np.array_equal(out, data), t.key
        files_index = mem.index.files
        mem.close()
        disk.close()
        dst = tmp / f"{name}.t{threads}.onnx"
        zdst = tmp / f"{name}.zipnn.t{threads}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fns = {"ours": lambda: passes.unpack(packed, dst, threads=threads, force=True),
                   "ZipNN": lambda: zipnn_restore(blobs, files_index, zipnn_streams, cut, codecs_, zdst)}
            for clock, tag in ((time.perf_counter, "wall"), (time.process_time, "cpu")):
                best = race(fns, repeat, clock)
                row[f".onnxz unpack {tag} t{threads}"] = original / best["ours"] / MB
                row[f"ZipNN unpack {tag} t{threads}"] = original / best["ZipNN"] / MB
        assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(blobs[0]).digest()
        if len(files_index) == 1:
            assert zdst.read_bytes() == blobs[0]
        t0, c0 = time.perf_counter(), time.process_time()
        passes.pack(path, tmp / f"{name}.speed.onnxz", threads=threads, force=True)
        row[f".onnxz pack wall t{threads}"] = original / (time.perf_counter() - t0) / MB
        row[f".onnxz pack cpu t{threads}"] = original / (time.process_time() - c0) / MB


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


def table(title, rows, cols):
    """Print one markdown table; cols: (header, fn(row) -> str)."""
    print(f"\n{title}\n")
    print("| model | " + " | ".join(h for h, _ in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for _, fn in cols:
            try:
                cells.append(fn(r))
            except KeyError:
                cells.append("–")
        print(f"| {r['model']} | " + " | ".join(cells) + " |")


def mbs(key):
    return lambda r: f"{r[key]:.0f}"


def ratio(ours, theirs):
    return lambda r: f"{r[ours] / r[theirs]:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="corpus model names (space-separated)")
    ap.add_argument("--models", help="corpus model names, comma-separated (e.g. open_nsfw,minilm_int8)")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 outputs of quantize_weights")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    corpus = corpus_dir()
    manifest = json.loads((corpus / "MANIFEST.json").read_text())
    wanted = set(args.only or []) | set(filter(None, (args.models or "").split(",")))
    unknown = wanted - {e["name"] for e in manifest}
    if unknown:
        sys.exit(f"unknown model(s): {', '.join(sorted(unknown))}")
    names = [e["name"] for e in manifest if not wanted or e["name"] in wanted]
    names = [n for n in names if (corpus / next(e for e in manifest if e["name"] == n)["file"]).is_file()]
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
    pct = lambda c: (lambda r: f"{100 * r[c] / r['bytes']:.2f}%")
    table("Sizes (% of the original file)", rows,
          [("MB", lambda r: f"{r['bytes'] / MB:.1f}")] + [(c, pct(c)) for c in COLUMNS] + [
              (".onnxz ≤ min(ZipNN, zstd)", lambda r: "yes" if r[".onnxz"] <= min(r["ZipNN"], r["zstd -19"]) else "NO"),
              ("f32 ours/top16", lambda r: f"{r['f32 ours/top16']:.4f}"),
              ("int8 ours/o0", lambda r: f"{r['int8 ours/o0']:.4f}")])
    table("Decode of the cut tensors, MB/s (raw bytes per second; cpu = per CPU-second of the process, "
          "all threads; ×: ours / ZipNN, same run; both from bytes in memory unless 'file')", rows, [
        ("ZipNN cpu t1", mbs("ZipNN dec cpu t1")), ("ours cpu t1", mbs(".onnxz dec mem cpu t1")),
        ("× cpu t1", ratio(".onnxz dec mem cpu t1", "ZipNN dec cpu t1")),
        ("ZipNN wall t1", mbs("ZipNN dec wall t1")), ("ours wall t1", mbs(".onnxz dec mem wall t1")),
        ("× wall t1", ratio(".onnxz dec mem wall t1", "ZipNN dec wall t1")),
        ("ZipNN wall t2", mbs("ZipNN dec wall t2")), ("ours wall t2", mbs(".onnxz dec mem wall t2")),
        ("× wall t2", ratio(".onnxz dec mem wall t2", "ZipNN dec wall t2")),
        ("× cpu t2", ratio(".onnxz dec mem cpu t2", "ZipNN dec cpu t2")),
        ("ours file cpu t1", mbs(".onnxz dec file cpu t1")),
        ("× file cpu t1", ratio(".onnxz dec file cpu t1", "ZipNN dec cpu t1")),
        ("× file wall t2", ratio(".onnxz dec file wall t2", "ZipNN dec wall t2"))])
    table("Unpack file -> file (ours: .onnxz -> .onnx, sha256 checked; ZipNN: decompress + write the file; "
          "both fsync'd) and pack, MB/s of the original file", rows, [
        ("ZipNN unpack wall t1", mbs("ZipNN unpack wall t1")), ("ours wall t1", mbs(".onnxz unpack wall t1")),
        ("× wall t1", ratio(".onnxz unpack wall t1", "ZipNN unpack wall t1")),
        ("× cpu t1", ratio(".onnxz unpack cpu t1", "ZipNN unpack cpu t1")),
        ("ZipNN unpack wall t2", mbs("ZipNN unpack wall t2")), ("ours wall t2", mbs(".onnxz unpack wall t2")),
        ("× wall t2", ratio(".onnxz unpack wall t2", "ZipNN unpack wall t2")),
        ("ZipNN enc wall t1", mbs("ZipNN enc wall t1")), ("ours pack wall t1", mbs(".onnxz pack wall t1")),
        ("ours pack cpu t1", mbs(".onnxz pack cpu t1")),
        ("ZipNN enc wall t2", mbs("ZipNN enc wall t2")), ("ours pack wall t2", mbs(".onnxz pack wall t2")),
        ("ours pack cpu t2", mbs(".onnxz pack cpu t2"))])
    (OUT / "lossless.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {OUT / 'lossless.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
