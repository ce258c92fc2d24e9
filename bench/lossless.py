"""Lossless-stage benchmark (not a test): sizes and speeds of `.onnxz` against zip, zstd and ZipNN.

    python bench/lossless.py [--models open_nsfw,minilm_int8] [--no-int8] [--rounds 7]

For every corpus model, and for the int8 output of `passes.quantize_weights` on each float model:
the original size and, as % of it, zip -9 (deflate), zstd -19, ZipNN on the same tensors (each
payload the pack stage cuts out, ZipNN 0.5.4 `input_format="byte"` with the tensor's dtype; 1-byte
and integer types as "float32"; the rest of the file counted at our skeleton size), `.onnxz`, and
order-0 bounds per tensor (floats: sign/exponent o0 + raw rest, top-16-bit o0 + raw rest; other
types: o0 of each byte plane), plus int8 tensors against the o0 bound of their bytes. In the
per-tensor ratios ours counts each tensor's stream and its share of the index's shared tables.

Speeds, at 1 and 2 threads, ours and ZipNN interleaved round by round (--rounds, order alternating),
reported as the median and the slowest-fastest round, as CPU time of the process (all threads;
robust to other processes' load) and as wall clock; ratios are ratios of the medians. A sample is
the mean of several back-to-back calls where one call is short (~50 ms a sample for unpack, ~20 ms
for decode; the same count for every side of a figure):
- unpack file -> file, the figure the issue's target is judged on: ours `passes.unpack` (every
  chunk's XXH3 and the restored file's default digest checked: its XXH3-128 in format 1.2 files,
  which this run writes) against ZipNN reading its own container
  file (its compressed streams + the skeleton bytes stored raw, free for ZipNN), decompressing and
  writing the model file; both written through the same temp file + fsync + rename, neither
  checked by the other side's rules (ZipNN stores no checksum). "Both written the same way" means
  the same steps: a new temporary file beside the destination, fsynced, renamed over the
  destination (which exists: force=True), then the folder fsynced, as the README promises for
  every output; ZipNN's side through `_fileio.atomic_output` (a file object, as a user would
  write), ours through `_fileio.atomic_fd` (the same steps on a bare descriptor, which unpack
  writes with pwrite; O_DIRECT set when the file is created). That durable write is a fixed cost both sides pay; "output alone" times it by
  itself (the restored bytes written by `write_bytes_atomic`, through the page cache, same rounds),
  so that what each side spends besides it can be read off. Ours writes with O_DIRECT (its
  decode windows are page-aligned: no copy into the page cache), ZipNN through the page cache
  as its users would; "ZipNN direct" times ZipNN writing through our O_DIRECT window writer too
  (its outputs copied into the aligned windows), so the write technique can be told apart from
  the decoder. Ours with digest="sha256" (what
  `unpack --sha256` and 1.0/1.1 files cost) is timed in the same rounds, and the sha256 and the
  XXH3-128 of the restored file alone;
- decode of the cut tensors from bytes in memory (secondary): ZipNN `decompress` of its streams
  (its API allocates each output) against ours `PackedFile(bytes).tensors_bytes` into reused
  buffers; ours from the .onnxz file (one pread per chunk) as a third figure;
- pack: ours `passes.pack` (the whole file: sha256, index, fsync) against ZipNN compress of the
  cut tensors only (one run each).
The int8 rows need passes.quantize_weights (outputs cached in bench/out/int8/).

Needs `pip install zipnn` (bench only; not a project dependency). Writes bench/out/lossless.json;
zip/zstd sizes are cached in bench/out/lossless_cache.json by file sha256 (they are slow).
"""
from __future__ import annotations

import argparse
import base64
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
from passes._fileio import flush_released, write_bytes_atomic  # noqa: E402
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


def miller_madow_bits(sym: np.ndarray) -> float:
    """Bits by which the plug-in order-0 entropy of these symbols undercounts, to first order
    (Miller-Madow: (distinct symbols - 1) / (2 ln 2) over the whole sequence). The per-tensor
    bounds above are plug-in figures: on a tensor of a few thousand values with hundreds of
    distinct ones they lie below what any coder that does not know the values' distribution
    beforehand can reach (rapidocr_cls float32: 0.93% of its top-16 bound)."""
    return (len(np.unique(sym)) - 1) / (2 * np.log(2))


def pooled_bits(hist: np.ndarray) -> float:
    """Total bits of an ideal order-0 coder given the symbol counts."""
    c = hist[hist > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


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


def rounds(fns: dict, n: int, inner: int = 1) -> dict:
    """Samples of every function, the runs interleaved round by round (load on the machine hits
    both alike; the order alternates so neither always runs on a cache the other warmed): per
    function {"cpu": [...], "wall": [...]} in seconds per call, each sample the mean of `inner`
    back-to-back calls (millisecond calls: less timer and scheduling noise per sample).
    Outputs that replaced a file (every unpack here: force=True, ours and ZipNN's alike) leave
    the old file to _fileio's closer thread; each sample waits for those closes before its CPU
    time is read, so that a side's CPU holds the freeing of the files it replaced (ZipNN's old
    file, written through the page cache, costs more to free than ours) and never lands in the
    next side's sample; its wall time is read before that wait (the caller has its file then)."""
    out = {k: {"cpu": [], "wall": []} for k in fns}
    names = list(fns)
    for r in range(n):
        for k in (names if r % 2 == 0 else names[::-1]):
            fn = fns[k]
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                fn()
            out[k]["wall"].append((time.perf_counter() - w0) / inner)
            flush_released()
            out[k]["cpu"].append((time.process_time() - c0) / inner)
    return out


def record(row: dict, key: str, nbytes: int, samples) -> None:
    """row[key] = median MB/s; row[key + " lo/hi"] = (slowest, fastest) MB/s; raw samples too."""
    rates = sorted(nbytes / max(t, 1e-9) / MB for t in samples)
    row[key] = float(np.median(rates))
    row[key + " lo/hi"] = (rates[0], rates[-1])
    row[key + " samples s"] = list(samples)


def inner_calls(fn, seconds: float = 0.02) -> int:
    """Calls per sample so that one sample lasts about `seconds` (the fastest of three timed calls:
    the first may pay for cold caches)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(1, min(50, int(seconds / max(best, 1e-6))))


def whole_file_sizes(files, cache: dict) -> dict:
    data = b"".join(Path(f).read_bytes() for f in files)
    key = hashlib.sha256(data).hexdigest()
    if key not in cache:
        cache[key] = {
            "zip -9": len(zlib.compress(data, 9)) + 22 + 2 * (30 + 46),  # deflate + zip headers
            "zstd -19": len(zstd.ZstdCompressor(level=19, threads=2).compress(data)),
        }
    return cache[key]


def shared_table_shares(idx, cut) -> dict:
    """Bytes of the index's shared entropy tables (FORMAT.md 3.2) charged to the tensors that code
    with them, id(entry) -> bytes: each table split over its users in proportion to their sizes.
    A tensor's own stream holds its own tables, not these: without the share, the per-tensor
    figures below would leave out every shared table and favour the tensors that use one."""
    tables = [len(base64.b64decode(t)) for t in idx.raw.get("ans_tables", [])]
    users: dict = {}
    for t, data in cut:
        if t.stream.codec == "ans_shared":
            for table in {i for i in t.stream.params["tables"] if i >= 0}:
                users.setdefault(table, []).append((id(t), data.size))
    shares: dict = {}
    for table, tensors in users.items():
        total = sum(size for _, size in tensors)
        for key, size in tensors:
            shares[key] = shares.get(key, 0.0) + tables[table] * size / total
    return shares


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
    i8_raw = i8_bound = i8_ours = i8_mm = 0
    f32_ours = f32_t16 = f32_raw = f32_mm = 0
    # the same bounds over all the model's int8 (float32) weights pooled: one order-0 model for
    # the whole file, as a coder with one shared table would see them. The per-tensor sums above
    # are the stricter figure (they charge nothing for a table per tensor).
    table_share = shared_table_shares(idx, cut)
    i8_hist = np.zeros(256, np.int64)
    f32_hist = np.zeros(65536, np.int64)
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
                i8_mm += miller_madow_bits(data) / 8
                i8_ours += t.stream.stored + table_share.get(id(t), 0.0)
                i8_hist += np.bincount(data, minlength=256)
            if dtype == FLOAT:
                f32_ours += t.stream.stored + table_share.get(id(t), 0.0)
                f32_t16 += t16
                f32_raw += data.size
                if data.size % 4 == 0:
                    f32_hist += np.bincount(data.view(np.uint32) >> 16, minlength=65536)
                    f32_mm += miller_madow_bits(data.view(np.uint32) >> 16) / 8
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
        row["int8 ours/o0 pooled"] = i8_ours / (pooled_bits(i8_hist) / 8)
        row["int8 ours/o0 bias-corrected"] = i8_ours / (i8_bound + i8_mm)
    if f32_raw:
        row["f32 ours/top16"] = f32_ours / f32_t16
        row["f32 ours/top16 pooled"] = f32_ours / ((pooled_bits(f32_hist) + 16 * int(f32_hist.sum())) / 8)
        row["f32 ours/top16 bias-corrected"] = f32_ours / (f32_t16 + f32_mm)
    pf.close()

    # speeds on the same tensors
    speeds(row, name, path, packed, blobs, cut, zipnn_streams, original, repeat, tmp)
    for f in tmp.glob(f"{name}*"):
        f.unlink()
    return row


def zipnn_container(path: Path, blobs, fe, cut, zipnn_streams) -> list:
    """ZipNN's side of the packed file: the skeleton of file 0 (its bytes outside the cut tensors,
    stored raw: free for ZipNN) followed by ZipNN's compressed streams. Returns the layout
    [(file offset, length, stream index or -1 for skeleton bytes, position in the container, stored)]."""
    src = memoryview(blobs[0])
    stream_of = {t.offset: i for i, (t, _) in enumerate(cut) if t.file == 0}
    layout, parts, at, pos = [], [], 0, 0
    for off, ln, _ti in fe.cuts:
        if off > pos:
            layout.append((pos, off - pos, -1, at, off - pos))
            parts.append(src[pos:off])
            at += off - pos
        comp = zipnn_streams[stream_of[off]][1]
        layout.append((off, ln, stream_of[off], at, len(comp)))
        parts.append(comp)
        at += len(comp)
        pos = off + ln
    if len(src) > pos:
        layout.append((pos, len(src) - pos, -1, at, len(src) - pos))
        parts.append(src[pos:])
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)
    return layout


def zipnn_restore(container: Path, layout, zipnn_streams, codecs_, out_path, direct: bool = False):
    """ZipNN's side of unpack: read its container file (one read), decompress every cut payload
    and write the model file with the payloads spliced between the skeleton bytes, written the
    way ours is (temporary file, fsync, rename). No checksum is checked (ZipNN stores none).
    `direct`: written the way ours is to the byte, through our O_DIRECT window writer (ZipNN's
    outputs copied into its page-aligned windows first: O_DIRECT needs aligned memory, which
    ZipNN's freshly allocated outputs are not); else plain writes through the page cache, as a
    ZipNN user would write."""
    from passes._fileio import atomic_output
    from passes.onnxz import reader

    data = memoryview(container.read_bytes())

    def parts():
        for _off, _ln, si, at, stored in layout:
            part = data[at:at + stored]
            if si < 0:
                yield part
            else:
                dt, _comp, ok, _n = zipnn_streams[si]
                yield codecs_[dt].decompress(part) if ok else zstd.ZstdDecompressor().decompress(part)

    with atomic_output(out_path, True) as f:
        if not direct:
            for part in parts():
                f.write(part)
            return
        size = sum(ln for _off, ln, *_ in layout)
        writer = reader._WindowWriter(f, size)
        try:
            k = start = used = 0
            win = writer.target(0, min(reader.WINDOW_BYTES, size), 0)
            for part in parts():
                part = np.frombuffer(part, np.uint8)
                pos = 0
                while pos < part.size:
                    n = min(part.size - pos, win.size - used)
                    win[used:used + n] = part[pos:pos + n]
                    used += n
                    pos += n
                    if used == win.size:
                        writer.write(win)
                        start, used, k = start + used, 0, k + 1
                        if start < size:
                            win = writer.target(start, min(reader.WINDOW_BYTES, size - start), k)
            writer.finish()
        finally:
            writer.release()


def speeds(row, name, path, packed, blobs, cut, zipnn_streams, original, n_rounds, tmp):
    """Decode from memory (both) and ours from the file, unpack file -> file, pack: CPU and wall
    at 1 and 2 threads; ours and ZipNN interleaved round by round, median and spread of n_rounds."""
    raw_total = sum(d.size for _, d in cut)
    packed_bytes = packed.read_bytes()
    tensors = [t for t, _ in cut]
    outs = [np.empty(t.length, np.uint8) for t in tensors]
    files_index = PackedFile(packed_bytes).index.files
    container = tmp / f"{name}.zipnn"
    layout = zipnn_container(container, blobs, files_index[0], cut, zipnn_streams) if len(files_index) == 1 else None
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
                inner = inner_calls(zipnn_decode)
                got = rounds(fns, n_rounds, inner)
                for tag in ("cpu", "wall"):
                    record(row, f"ZipNN dec {tag} t{threads}", raw_total, got["ZipNN"][tag])
                    record(row, f".onnxz dec mem {tag} t{threads}", raw_total, got["mem"][tag])
                    record(row, f".onnxz dec file {tag} t{threads}", raw_total, got["file"][tag])
                row[f"ZipNN enc wall t{threads}"] = raw_total / best_of(zipnn_encode, 1) / MB
            for (t, data), out in zip(cut, outs):
                assert np.array_equal(out, data), t.key
        mem.close()
        disk.close()
        dst = tmp / f"{name}.t{threads}.onnx"
        zdst = tmp / f"{name}.zipnn.t{threads}.onnx"
        if layout is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                zddst = tmp / f"{name}.zipnn-direct.t{threads}.onnx"
                odst = tmp / f"{name}.output-alone.onnx"
                fns = {"ours": lambda: passes.unpack(packed, dst, threads=threads, force=True),
                       "ZipNN": lambda: zipnn_restore(container, layout, zipnn_streams, codecs_, zdst),
                       "ZipNN direct": lambda: zipnn_restore(container, layout, zipnn_streams, codecs_, zddst, direct=True),
                       "ours sha256": lambda: passes.unpack(packed, dst, threads=threads, force=True, digest="sha256")}
                if threads == 1:  # the durable write both sides make, alone (it does not depend on threads)
                    fns["output alone"] = lambda: write_bytes_atomic(odst, blobs[0], force=True)
                # each sample the mean of `inner` back-to-back calls, the same count for every side
                # (sized on ZipNN's call: ~50 ms a sample): a small model's unpack is 1-4 ms, and one
                # call per sample left its median at the mercy of single scheduling and fsync hiccups
                inner = inner_calls(fns["ZipNN"], 0.05)
                got = rounds(fns, n_rounds, inner)
                row[f"unpack inner t{threads}"] = inner
            for tag in ("cpu", "wall"):
                record(row, f".onnxz unpack {tag} t{threads}", original, got["ours"][tag])
                record(row, f"ZipNN unpack {tag} t{threads}", original, got["ZipNN"][tag])
                record(row, f"ZipNN unpack direct {tag} t{threads}", original, got["ZipNN direct"][tag])
                record(row, f".onnxz unpack sha {tag} t{threads}", original, got["ours sha256"][tag])
                if "output alone" in got:
                    record(row, f"output alone {tag} t{threads}", original, got["output alone"][tag])
            assert dst.read_bytes() == blobs[0]
            assert zdst.read_bytes() == blobs[0]
            assert zddst.read_bytes() == blobs[0]
        if threads == 1:  # what each whole-file digest of the restored file costs alone, same run
            import xxhash

            restored = dst.read_bytes() if dst.exists() else blobs[0]
            row["sha256 cpu"] = original / best_of(lambda: hashlib.sha256(restored).digest(), 3, time.process_time) / MB
            row["xxh3_128 cpu"] = original / best_of(lambda: xxhash.xxh3_128(restored).digest(), 3, time.process_time) / MB
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


def spread(key):
    return lambda r: f"{r[key]:.0f} ({r[key + ' lo/hi'][0]:.0f}–{r[key + ' lo/hi'][1]:.0f})"


def ratio(ours, theirs):
    return lambda r: f"{r[ours] / r[theirs]:.2f}"


def round_ratio(ours, theirs):
    """The median over rounds of theirs/ours time in the same round (ours and ZipNN ran back to
    back, so both saw the same load): steadier than the ratio of the medians when the load drifts
    between rounds (on big models a sample is one call)."""
    return lambda r: f"{np.median(np.array(r[theirs + ' samples s']) / np.array(r[ours + ' samples s'])):.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="corpus model names (space-separated)")
    ap.add_argument("--models", help="corpus model names, comma-separated (e.g. open_nsfw,minilm_int8)")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 outputs of quantize_weights")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per figure (median and spread; at least 5)")
    ap.add_argument("--repeat", type=int, help=argparse.SUPPRESS)  # old name of --rounds
    ap.add_argument("--json", default="lossless.json", help="file name under bench/out/")
    args = ap.parse_args(argv)
    if args.repeat is not None:
        args.rounds = args.repeat
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
            rows.append(bench_model(name, path, args.rounds, cache, tmp))
            cache_path.write_text(json.dumps(cache))
            r = rows[-1]
            print(f"  {name}: .onnxz {100 * r['.onnxz'] / r['bytes']:.2f}%", file=sys.stderr)
    pct = lambda c: (lambda r: f"{100 * r[c] / r['bytes']:.2f}%")
    table("Sizes (% of the original file)", rows,
          [("MB", lambda r: f"{r['bytes'] / MB:.1f}")] + [(c, pct(c)) for c in COLUMNS] + [
              (".onnxz ≤ min(ZipNN, zstd)", lambda r: "yes" if r[".onnxz"] <= min(r["ZipNN"], r["zstd -19"]) else "NO"),
              ("f32 ours/top16", lambda r: f"{r['f32 ours/top16']:.4f}"),
              ("f32 ours/top16 pooled", lambda r: f"{r['f32 ours/top16 pooled']:.4f}"),
              ("f32 ours/top16 bias-corrected", lambda r: f"{r['f32 ours/top16 bias-corrected']:.4f}"),
              ("int8 ours/o0", lambda r: f"{r['int8 ours/o0']:.4f}"),
              ("int8 ours/o0 pooled", lambda r: f"{r['int8 ours/o0 pooled']:.4f}"),
              ("int8 ours/o0 bias-corrected", lambda r: f"{r['int8 ours/o0 bias-corrected']:.4f}")])
    print(f"\nSpeeds: {args.rounds} rounds, ZipNN and ours interleaved round by round. Cells: median MB/s "
          "(slowest–fastest round); ×: ours / ZipNN, ratio of the medians, same run. cpu = CPU time of the whole "
          "process (all threads), wall = elapsed. MB/s of raw tensor bytes (decode) or of the original file (unpack).")
    print("TARGET (issue 3): unpack file -> file (what `surgeon-compress unpack` / passes.unpack does) ≥ 2× ZipNN at "
          "1 thread, judged on × cpu t1, and ≥ 1.5× at 2 threads, judged on × wall t2 (only wall shows the second "
          "core). Decode from memory is the secondary figure.")
    table("Unpack file -> file, MB/s of the original file. Ours: .onnxz read, every chunk's XXH3 and the "
          "restored file's XXH3-128 (format 1.2's default digest) checked, written with O_DIRECT (whole blocks "
          "from the decode windows: no page-cache copy; the tail through the page cache). ZipNN: its container read (ZipNN streams + the skeleton bytes raw), "
          "decompressed, nothing checked, written through the page cache; 'ZipNN direct': the same, its outputs copied into "
          "our O_DIRECT window writer. All through the same steps: temp file + fsync + rename + folder fsync (ZipNN: atomic_output, ours: atomic_fd); "
          "'output alone': that durable write of the restored bytes by itself (page cache), the fixed cost both sides pay", rows, [
        ("ZipNN cpu t1", spread("ZipNN unpack cpu t1")), ("ours cpu t1", spread(".onnxz unpack cpu t1")),
        ("**× cpu t1**", ratio(".onnxz unpack cpu t1", "ZipNN unpack cpu t1")),
        ("× cpu t1 per round", round_ratio(".onnxz unpack cpu t1", "ZipNN unpack cpu t1")),
        ("× wall t1", ratio(".onnxz unpack wall t1", "ZipNN unpack wall t1")),
        ("ZipNN wall t2", spread("ZipNN unpack wall t2")), ("ours wall t2", spread(".onnxz unpack wall t2")),
        ("**× wall t2**", ratio(".onnxz unpack wall t2", "ZipNN unpack wall t2")),
        ("× cpu t2", ratio(".onnxz unpack cpu t2", "ZipNN unpack cpu t2")),
        ("output alone cpu t1, ms", lambda r: f"{r['bytes'] / MB / r['output alone cpu t1'] * 1e3:.2f}"),
        ("ours cpu t1, ms", lambda r: f"{r['bytes'] / MB / r['.onnxz unpack cpu t1'] * 1e3:.2f}"),
        ("ZipNN cpu t1, ms", lambda r: f"{r['bytes'] / MB / r['ZipNN unpack cpu t1'] * 1e3:.2f}"),
        ("× cpu t1 vs ZipNN direct", ratio(".onnxz unpack cpu t1", "ZipNN unpack direct cpu t1")),
        ("× wall t1 vs ZipNN direct", ratio(".onnxz unpack wall t1", "ZipNN unpack direct wall t1")),
        ("× wall t2 vs ZipNN direct", ratio(".onnxz unpack wall t2", "ZipNN unpack direct wall t2")),
        ("× cpu t1, --sha256", ratio(".onnxz unpack sha cpu t1", "ZipNN unpack cpu t1")),
        ("× wall t2, --sha256", ratio(".onnxz unpack sha wall t2", "ZipNN unpack wall t2")),
        ("sha256 alone cpu", mbs("sha256 cpu")), ("xxh3_128 alone cpu", mbs("xxh3_128 cpu")),
        # an upper bound since 18cdedf: at 1 thread the digest is fed each chunk in cache as it decodes
        ("xxh3_128 alone / ours cpu t1 (bound)", lambda r: f"{r['.onnxz unpack cpu t1'] / r['xxh3_128 cpu']:.0%}")])
    table("Decode of the cut tensors from memory (secondary), MB/s of raw bytes. ZipNN: decompress() of its "
          "streams (it allocates each output); ours: PackedFile(bytes).tensors_bytes into reused buffers "
          "(XXH3 of every chunk checked); 'file': ours reading the .onnxz (one pread per chunk)", rows, [
        ("ZipNN cpu t1", spread("ZipNN dec cpu t1")), ("ours cpu t1", spread(".onnxz dec mem cpu t1")),
        ("× cpu t1", ratio(".onnxz dec mem cpu t1", "ZipNN dec cpu t1")),
        ("× wall t1", ratio(".onnxz dec mem wall t1", "ZipNN dec wall t1")),
        ("ZipNN wall t2", spread("ZipNN dec wall t2")), ("ours wall t2", spread(".onnxz dec mem wall t2")),
        ("× wall t2", ratio(".onnxz dec mem wall t2", "ZipNN dec wall t2")),
        ("× cpu t2", ratio(".onnxz dec mem cpu t2", "ZipNN dec cpu t2")),
        ("× file cpu t1", ratio(".onnxz dec file cpu t1", "ZipNN dec cpu t1")),
        ("× file wall t2", ratio(".onnxz dec file wall t2", "ZipNN dec wall t2"))])
    table("Pack (one run each), MB/s of the original file; ZipNN: compress of the cut tensors only", rows, [
        ("ZipNN enc wall t1", mbs("ZipNN enc wall t1")), ("ours pack wall t1", mbs(".onnxz pack wall t1")),
        ("ours pack cpu t1", mbs(".onnxz pack cpu t1")),
        ("ZipNN enc wall t2", mbs("ZipNN enc wall t2")), ("ours pack wall t2", mbs(".onnxz pack wall t2")),
        ("ours pack cpu t2", mbs(".onnxz pack cpu t2"))])
    (OUT / args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {OUT / args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
