"""Regenerate the golden `.onnxz` files of tests/golden/ (format stability, issue 6 item 7).

    python tests/golden/make_golden.py --dest tests/golden/v1.1   # writes v1.1/*.onnxz + MANIFEST.json
    python tests/golden/make_golden.py --dest tests/golden/v1.2   # ans_shared (format 1.2)
    python tests/golden/make_golden.py --dest tests/golden/v1.3   # catalog, transpose (format 1.3)
    python tests/golden/make_golden.py --dest tests/golden/v1.4   # same: a payload stored once (format 1.4)
    python tests/golden/make_golden.py --check                     # only checks that v1.0 decodes to its manifest

v1.0/ was written by the 1.0 writer from `cases()`; v1.1/ (codec `ans`) from `cases_v11()`; v1.2/
(codec `ans_shared`, shared tables) from `cases_v12()`. The
folder name picks the case set; today's writer would no longer choose the 1.0 codecs for `cases()`.

Each golden file is a tiny model whose weights go through one codec of FORMAT.md (the script
checks that the writer really chose that codec). MANIFEST.json records, for every file, the
SHA-256 of the restored model (and external data) files and of every tensor's bytes with its
dtype and shape, computed here from the arrays *before* packing, so the test never trusts the
reader to define what is right. `newer-*.onnxz` are the same files with a newer major version,
nonzero flags or an unknown codec: readers must say "written by a newer version".

When to run it: only when a new format version or codec is added (add a folder v1.1/ etc. and
keep the old folders: old files must stay readable forever). Never regenerate an existing
version's folder to make a failing test pass: a failing golden test means the reader broke
compatibility.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
VERSION_DIR = HERE / "v1.0"
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # fuzz.samples.forced_fpairs


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _model(inits, extra_nodes=(), opset=17):
    nodes, outputs = list(extra_nodes), []
    for t in inits:
        nodes.append(helper.make_node("Identity", [t.name], [t.name + "_out"]))
        outputs.append(helper.make_tensor_value_info(t.name + "_out", t.data_type, list(t.dims)))
    for n in extra_nodes:
        if n.op_type == "If":
            outputs.append(helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, [400]))
    graph = helper.make_graph(nodes, "golden", [], outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="golden")
    model.ir_version = 8
    return model


def cases():
    """name -> (model, expected codecs (at least one tensor must use each), pack options, external?)"""
    rng = np.random.default_rng(20261129)
    # every payload >= 1 KiB: the writer keeps smaller ones inside the skeleton stream
    q = np.clip(np.round(rng.laplace(0, 10, 1500)), -127, 127).astype(np.int8)
    out = {
        "bytes-int8": ([numpy_helper.from_array(q, "w_int8")], {"bytes"}, {}, False),
        "bytes-lz": ([numpy_helper.from_array(np.tile(rng.standard_normal(16).astype(np.float32), 128), "w_repeat")],
                     {"bytes"}, {}, False),
        "planes-w2": ([numpy_helper.from_array(rng.integers(-300, 300, 800).astype(np.int16), "w_int16")], {"planes"}, {}, False),
        "planes-w4": ([numpy_helper.from_array(rng.integers(-5000, 5000, 400).astype(np.int32), "w_int32")], {"planes"}, {}, False),
        "fplanes-w2": ([numpy_helper.from_array(rng.standard_normal(800).astype(np.float16), "w_f16")], {"fplanes"}, {}, False),
        "fplanes-w4": ([numpy_helper.from_array(rng.standard_normal(400).astype(np.float32), "w_f32")], {"fplanes"}, {}, False),
        "fplanes-w8": ([numpy_helper.from_array(rng.standard_normal(200) * 1e-3, "w_f64")], {"fplanes"}, {}, False),
        "narrow-f32-f16": ([numpy_helper.from_array(rng.standard_normal(400).astype(np.float16).astype(np.float32), "w_f32_f16")],
                           {"narrow"}, {}, False),
        "narrow-f32-bf16": ([numpy_helper.from_array(
            (rng.standard_normal(400).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32), "w_f32_bf16")],
            {"narrow"}, {}, False),
        "narrow-f64-f32": ([numpy_helper.from_array(rng.standard_normal(200).astype(np.float32).astype(np.float64), "w_f64_f32")],
                           {"narrow"}, {}, False),
        "multi-chunk": ([numpy_helper.from_array(rng.standard_normal(1024).astype(np.float32), "w_chunked"),
                         numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 10, 2048)), -127, 127).astype(np.int8), "w_chunked_i8")],
                        {"fplanes", "bytes"}, {"chunk_bytes": 256}, False),
        "typed-fields": ([helper.make_tensor("w_float_data", TensorProto.FLOAT, [400], rng.standard_normal(400).astype(np.float32).tolist()),
                          helper.make_tensor("w_int64_data", TensorProto.INT64, [200], rng.integers(-2**40, 2**40, 200).tolist()),
                          helper.make_tensor("w_int32_data", TensorProto.INT8, [600], rng.integers(-128, 128, 600).tolist())],
                         {"bytes", "fplanes"}, {}, False),
        "external-data": ([numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w_ext_f32"),
                           numpy_helper.from_array(q, "w_ext_i8")], {"fplanes", "bytes"}, {}, True),
    }
    # fpairs is kept by the writer only where it is smaller: forced here (see fuzz.samples.forced_fpairs)
    wide = (rng.standard_normal(600) * np.exp2(rng.integers(-30, 30, 600))).astype(np.float32)  # > 15 exponents: escapes
    bf16 = helper.make_tensor("w_bf16", TensorProto.BFLOAT16, [600],
                              (rng.standard_normal(600).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    held = (rng.standard_normal(600).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    out["fpairs-w4-escapes"] = ([numpy_helper.from_array(wide, "w_f32_wide")], {"fpairs"}, {"force_fpairs": True, "chunk_bytes": 1024}, False)
    out["fpairs-w2-bfloat16"] = ([bf16], {"fpairs"}, {"force_fpairs": True}, False)
    out["narrow-bf16-fpairs"] = ([numpy_helper.from_array(held, "w_f32_bf16_pairs")], {"narrow", "fpairs"}, {"force_fpairs": True}, False)
    # a Constant inside an If branch, an empty tensor, a tiny tensor left in the skeleton
    branch_w = helper.make_tensor("w_branch", TensorProto.FLOAT, [400], rng.standard_normal(400).astype(np.float32).tobytes(), raw=True)
    branch = helper.make_graph([helper.make_node("Constant", [], ["b"], value=branch_w)], "then", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [400])])
    cond = helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("cond_v", TensorProto.BOOL, [], [True]))
    if_node = helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch)
    out["subgraph-empty-small"] = ([numpy_helper.from_array(np.zeros((0, 8), np.float32), "w_empty"),
                                    numpy_helper.from_array(np.arange(3, dtype=np.float32), "w_tiny")],
                                   {"fplanes", "skeleton"}, {"extra_nodes": [cond, if_node]}, False)
    # bpairs (few distinct byte values; the writer picks it from about 4 KiB), drawn last so that
    # the arrays above stay those of the first golden set
    out["bpairs-ternary"] = ([numpy_helper.from_array(rng.integers(-1, 2, 4096).astype(np.int8), "w_ternary")],
                             {"bpairs"}, {}, False)
    return out


def cases_v11():
    """The `ans` codec of format 1.1 (FORMAT.md 3.1): every width, sign move or not, pairs, every
    lane count (1, 4, 32, 64), constant planes, several chunks, inside `narrow`."""
    rng = np.random.default_rng(20261130)
    f32 = rng.standard_normal(20000).astype(np.float32)
    low0 = (rng.standard_normal(3000).astype(np.float32).view(np.uint32) & 0xFFFFFF00).view(np.float32)  # plane 3 constant
    bf16 = helper.make_tensor("w_bf16", TensorProto.BFLOAT16, [3000],
                              (rng.standard_normal(3000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    wide = (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 30, 20000))).astype(np.float32)  # > 15 exponents: escapes
    return {
        "ans-w1-int8": ([numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 10, 70000)), -127, 127).astype(np.int8), "w_int8")],
                        {"ans"}, {}, False),
        "ans-w1-ternary-64lanes": ([numpy_helper.from_array(rng.choice(np.array([-1, 0, 1], np.int8), 140000, p=[0.2, 0.6, 0.2]),
                                                            "w_ternary")], {"ans"}, {}, False),
        "ans-w1-ternary-128lanes": ([numpy_helper.from_array(rng.choice(np.array([-1, 0, 1], np.int8), 270000, p=[0.1, 0.8, 0.1]),
                                                             "w_ternary_big")], {"ans"}, {}, False),
        "ans-w4-float32-1lane": ([numpy_helper.from_array(rng.standard_normal(1000).astype(np.float32), "w_f32_small")], {"ans"}, {},
                                 False),
        "ans-w4-float32": ([numpy_helper.from_array(f32, "w_f32")], {"ans"}, {}, False),
        "ans-w4-constant-plane": ([numpy_helper.from_array(low0, "w_f32_low0")], {"ans"}, {}, False),
        "ans-w2-float16": ([numpy_helper.from_array(rng.standard_normal(40000).astype(np.float16), "w_f16")], {"ans"}, {}, False),
        "ans-w2-bfloat16": ([bf16], {"ans"}, {}, False),
        "ans-w8-float64": ([numpy_helper.from_array(rng.standard_normal(1000) * 1e-3, "w_f64")], {"ans"}, {}, False),
        "ans-w2-int16": ([numpy_helper.from_array(rng.integers(-300, 300, 3000).astype(np.int16), "w_int16")], {"ans"}, {}, False),
        "ans-w4-int32": ([numpy_helper.from_array(rng.integers(-5000, 5000, 2000).astype(np.int32), "w_int32")], {"ans"}, {}, False),
        "ans-pairs-w4-escapes": ([numpy_helper.from_array(wide, "w_f32_wide")], {"ans"}, {"force_ans_pairs": True, "chunk_bytes": 32768},
                                 False),
        "ans-pairs-w2-bfloat16": ([bf16], {"ans"}, {"force_ans_pairs": True}, False),
        "ans-narrow-f32-f16": ([numpy_helper.from_array(rng.standard_normal(3000).astype(np.float16).astype(np.float32), "w_f32_f16")],
                               {"narrow", "ans"}, {}, False),
        "ans-multi-chunk": ([numpy_helper.from_array(rng.standard_normal(3000).astype(np.float32), "w_chunked"),
                             numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 10, 5000)), -127, 127).astype(np.int8), "w_chunked_i8")],
                            {"ans"}, {"chunk_bytes": 2048}, False),
    }


def cases_v12():
    """`ans_shared` of format 1.2 (FORMAT.md 3.2): several small tensors of a kind coding their
    planes with tables stored once in the index: int8 (width 1, 1 and 4 lanes), float32 (shared
    exponent table, sign move), int16 (width 2, no sign move), and short blobs whose whole blob
    (table put back) is longer than the plane (`shared_long`: forced
    whatever the writer's SHARED_WHOLE_BELOW_PLANE; the C `ans_decode` cannot take them, the
    reader must still decode them)."""
    rng = np.random.default_rng(20261201)

    def i8(name, n, scale):
        return numpy_helper.from_array(np.clip(np.round(rng.laplace(0, scale, n)), -127, 127).astype(np.int8), name)

    int8s = [i8(f"w_i8_{k}", n, s) for k, (n, s) in enumerate([(1500, 6), (2500, 8), (9000, 9), (1800, 7)])]
    f32s = [numpy_helper.from_array((rng.standard_normal(n) * 0.05).astype(np.float32), f"w_f32_{k}")
            for k, n in enumerate([400, 900, 1500, 3000])]
    i16s = [numpy_helper.from_array(np.round(rng.laplace(0, 40, n)).astype(np.int16), f"w_i16_{k}") for k, n in enumerate([800, 1600, 2400])]
    long8 = [i8(f"w_i8_long_{k}", n, 30) for k, n in enumerate([1100, 1300, 1200, 1000])]
    return {
        "ans-shared-int8": (int8s, {"ans_shared"}, {}, False),
        "ans-shared-float32": (f32s, {"ans_shared"}, {}, False),
        "ans-shared-int16": (i16s, {"ans_shared"}, {}, False),
        "ans-shared-mixed": (int8s[:2] + f32s[:2], {"ans_shared"}, {}, False),
        "ans-shared-long-blobs": (long8, {"ans_shared"}, {"shared_long": True}, False),
    }


def cases_v13():
    """Format 1.3 (FORMAT.md 4.1, 3): the catalog (tensors left in the skeleton listed apart from
    the index: small ones between coded ones, and a Constant in a subgraph) and the codec
    `transpose` (an STFT basis stored column by column; one chunk, and several chunks of whole rows)."""
    rng = np.random.default_rng(20261202)
    n = 128
    k, t = np.arange(n // 2 + 1)[:, None], np.arange(n)[None, :]
    w = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)
    basis = np.concatenate([np.cos(2 * np.pi * k * t / n) * w, -np.sin(2 * np.pi * k * t / n) * w]).astype(np.float32)[:, None, :]
    small = [numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), f"b_{i}") for i, m in enumerate([3, 16, 40, 7])]
    big = [numpy_helper.from_array(rng.standard_normal(3000).astype(np.float32), "w_f32"),
           numpy_helper.from_array(np.clip(np.round(rng.laplace(0, 9, 5000)), -127, 127).astype(np.int8), "w_i8")]
    then = helper.make_graph([helper.make_node("Constant", [], ["c_out"], value=numpy_helper.from_array(np.ones(400, np.float32), "c_out"))],
                             "then", [], [helper.make_tensor_value_info("c_out", TensorProto.FLOAT, [400])])
    other = helper.make_graph([helper.make_node("Constant", [], ["e_out"], value=numpy_helper.from_array(np.zeros(400, np.float32), "e_out"))],
                              "else", [], [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [400])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    if_node = helper.make_node("If", ["cond"], ["if_out"], then_branch=then, else_branch=other)
    return {
        "catalog-mixed": ([small[0], big[0], small[1], small[2], big[1], small[3], cond], {"ans"},
                          {"extra_nodes": [if_node]}, False),
        "transpose-basis": ([numpy_helper.from_array(basis, "stft_basis"), small[0]], {"transpose"}, {}, False),
        "transpose-chunks": ([numpy_helper.from_array(basis, "stft_basis")], {"transpose"}, {"chunk_bytes": 16384}, False),
    }


def cases_v14():
    """Format 1.4 (FORMAT.md 3.3): the codec `same`, a payload equal to an earlier one stored once
    (a tied weight: float32 twice, int8 twice beside a different one; and the same in external data)."""
    rng = np.random.default_rng(20261204)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    q = np.clip(np.round(rng.laplace(0, 9, 4000)), -127, 127).astype(np.int8)
    other = np.clip(np.round(rng.laplace(0, 5, 4000)), -127, 127).astype(np.int8)
    tied = [numpy_helper.from_array(w, "embed"), numpy_helper.from_array(w.copy(), "lm_head"),
            numpy_helper.from_array(q, "q_a"), numpy_helper.from_array(other, "q_b"), numpy_helper.from_array(q.copy(), "q_c")]
    return {
        "same-tied": (tied, {"same"}, {}, False),
        "same-external": ([numpy_helper.from_array(w, "embed"), numpy_helper.from_array(w.copy(), "lm_head")], {"same"}, {}, True),
    }


@contextlib.contextmanager
def shared_long():
    """The writer with short blobs allowed to reach the plane's size once their table is put back."""
    from passes.onnxz import codecs

    saved = codecs.SHARED_WHOLE_BELOW_PLANE
    codecs.SHARED_WHOLE_BELOW_PLANE = False
    try:
        yield
    finally:
        codecs.SHARED_WHOLE_BELOW_PLANE = saved


@contextlib.contextmanager
def forced_ans_pairs():
    """The writer with `ans` pairs as the only float codec (it takes pairs only with effort="max"
    and only where smaller)."""
    from passes.onnxz import codecs

    saved = codecs._float_specs
    codecs._float_specs = lambda width, value_type, size, effort="default": [("ans", width, codecs.ANS_PAIRS)]
    try:
        yield
    finally:
        codecs._float_specs = saved


def _all_tensors(model):
    from onnx.external_data_helper import _get_all_tensors

    return list(_get_all_tensors(model))


def build(dest: Path) -> dict:
    from passes import open_packed, pack

    dest.mkdir(parents=True, exist_ok=True)
    version = dest.name.lstrip("v")
    manifest = {"format": version, "generator": "tests/golden/make_golden.py", "files": {}}
    case_sets = {"1.1": cases_v11, "1.2": cases_v12, "1.3": cases_v13, "1.4": cases_v14}
    for name, (inits, want_codecs, opts, external) in case_sets.get(version, cases)().items():
        opts = dict(opts)
        model = _model(inits, opts.pop("extra_nodes", ()))
        force = opts.pop("force_fpairs", False)
        force_pairs = opts.pop("force_ans_pairs", False)
        long_blobs = opts.pop("shared_long", False)
        onnx.checker.check_model(model, full_check=True)
        expected_tensors = {}
        for t in _all_tensors(model):
            arr = numpy_helper.to_array(t)
            expected_tensors[t.name or "?"] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "sha256": _sha(arr.tobytes())}
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"{name}.onnx"
            if external:
                onnx.save_model(model, src, save_as_external_data=True, all_tensors_to_one_file=True,
                                location=f"{name}.weights", size_threshold=0)
            else:
                src.write_bytes(model.SerializeToString())
            files = {p.name: _sha(p.read_bytes()) for p in Path(tmp).iterdir()}
            out = dest / f"{name}.onnxz"
            from fuzz.samples import forced_fpairs

            with forced_fpairs() if force else forced_ans_pairs() if force_pairs else shared_long() if long_blobs \
                    else contextlib.nullcontext():
                pack(src, out, threads=1, force=True, **opts)
        with open_packed(out, threads=1) as pm:
            used = {t["codec"] for t in pm.metadata()["tensors"]} | {
                t["params"]["inner"]["codec"] for t in pm.metadata()["tensors"] if t["codec"] == "narrow"}
            keys = {k: pm.get_tensor(k) for k in pm.keys()}
        missing = want_codecs - used
        print(f"  {name}: codecs {sorted(used)}")
        if missing:
            raise SystemExit(f"{name}: the writer used {sorted(used)}, not {sorted(missing)}: update the case")
        for key in keys:
            if key.split("#")[0] not in expected_tensors:
                raise SystemExit(f"{name}: packed key {key!r} matches no tensor of the model")
        manifest["files"][f"{name}.onnxz"] = {
            "restored_files": files,
            "model_file": f"{name}.onnx",
            "codecs": sorted(used),
            "tensors": {k: expected_tensors[k.split("#")[0]] for k in sorted(keys)},
        }
    if version == "1.0":  # the newer-version files live there once
        _write_newer(dest, manifest)
    else:
        manifest["newer"] = {}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _header_with(data: bytes, **changes) -> bytes:
    fmt = struct.Struct("<8sHHIQQQQI8s")
    names = ["magic", "major", "minor", "flags", "index_offset", "index_length", "index_raw_length", "file_length",
             "index_crc", "reserved"]
    fields = list(fmt.unpack(data[:60]))
    for k, v in changes.items():
        fields[names.index(k)] = v
    head = fmt.pack(*fields)
    return head + struct.pack("<I", zlib.crc32(head)) + data[64:]


def _with_codec(data: bytes, codec: str) -> bytes:
    """The file with its first coded tensor's codec renamed (index re-encoded, CRCs and sizes fixed)."""
    import zstandard as zstd

    fmt = struct.Struct("<8sHHIQQQQI8s")
    fields = list(fmt.unpack(data[:60]))
    ioff, ilen = fields[4], fields[5]
    index = json.loads(zstd.ZstdDecompressor().decompress(data[ioff:ioff + ilen]))
    for t in index["tensors"]:
        if t.get("stream"):
            t["stream"]["codec"] = codec
            break
    index["format"] = [1, 9]
    text = json.dumps(index, separators=(",", ":")).encode()
    frame = zstd.ZstdCompressor(level=19, write_checksum=True, write_content_size=True).compress(text)
    body = data[64:ioff]
    fields[2] = 9
    fields[4], fields[5], fields[6], fields[7], fields[8] = 64 + len(body), len(frame), len(text), 64 + len(body) + len(frame), zlib.crc32(frame)
    head = fmt.pack(*fields)
    return head + struct.pack("<I", zlib.crc32(head)) + body + frame


def _write_newer(dest: Path, manifest: dict) -> None:
    base = (dest / "fplanes-w4.onnxz").read_bytes()
    newer = {
        "newer-major.onnxz": (_header_with(base, major=2), "major version 2"),
        "newer-flags.onnxz": (_header_with(base, flags=4), "unknown header flag"),
        "newer-codec.onnxz": (_with_codec(base, "future-codec"), "unknown codec 'future-codec' (format 1.9)"),
    }
    manifest["newer"] = {}
    for name, (data, what) in newer.items():
        (dest / name).write_bytes(data)
        manifest["newer"][name] = what


def check(dest: Path) -> int:
    """Decode every golden file and compare with the manifest; print one line per file."""
    from passes import NewerFormatError, load, open_packed

    manifest = json.loads((dest / "MANIFEST.json").read_text())
    bad = 0
    for name, entry in manifest["files"].items():
        with open_packed(dest / name, threads=1) as pm:
            got = {k: pm.get_tensor(k) for k in pm.keys()}
        ok = set(got) == set(entry["tensors"]) and all(
            str(a.dtype) == entry["tensors"][k]["dtype"] and list(a.shape) == entry["tensors"][k]["shape"]
            and _sha(a.tobytes()) == entry["tensors"][k]["sha256"] for k, a in got.items())
        ok = ok and _sha(load(dest / name, threads=1).SerializeToString()) is not None
        print(f"{'ok ' if ok else 'BAD'} {name}")
        bad += not ok
    for name in manifest["newer"]:
        try:
            open_packed(dest / name)
            print(f"BAD {name}: opened")
            bad += 1
        except NewerFormatError as exc:
            print(f"ok  {name}: {exc}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--dest", type=Path, default=VERSION_DIR)
    args = ap.parse_args(argv)
    if not args.check:
        m = build(args.dest)
        total = sum((args.dest / n).stat().st_size for n in list(m["files"]) + list(m["newer"]))
        print(f"wrote {len(m['files'])} golden files + {len(m['newer'])} newer-version files, {total} bytes, to {args.dest}")
    return check(args.dest)


if __name__ == "__main__":
    sys.exit(main())
