"""Models over 2 GB end to end (a benchmark, not a test: it needs minutes and several GB of disk).

Builds a float16 (or float32) model of --size-gb from real weights (minilm_fp32's FFN matrices
and embedding table, tiled to 4096-wide layers; every layer's rows rolled and scaled a little so
no two tensors are equal), saved with external data in a temporary folder outside the repo; then
runs each step in a fresh process under /usr/bin/time -v (wall, CPU, peak RSS):

  compress   surgeon-compress compress (int8 per channel)       + onnx.checker by path
  fold       surgeon-compress fold of the compressed model       + onnx.checker by path
  pack       surgeon-compress pack of the original
  unpack     surgeon-compress unpack, then sha256 of model + data files against the original
  session    passes.InferenceSession(mode="fold") on the compressed model, one run

    python bench/large.py [--size-gb 2.5] [--dtype float16|float32] [--keep] [--skip pack,unpack]

Prints a table and writes bench/out/large.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
WIDTH = 4096
VOCAB = 32000


def _real_tensors() -> list[np.ndarray]:
    """Float 2-D weights of minilm_fp32 (FFN, attention, embeddings) as float32 arrays."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(CORPUS / "minilm_fp32" / "minilm_fp32.onnx"))
    found = [numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == 1]
    return sorted(found, key=lambda a: -a.size)


def _tiled(src: np.ndarray, shape: tuple[int, int], seed: int, dtype) -> np.ndarray:
    """`src` tiled to `shape`, rows rolled by a seed-dependent amount and each row scaled by
    1 +- 2% (noise per element): real value statistics, yet every generated tensor differs."""
    reps = (-(-shape[0] // src.shape[0]), -(-shape[1] // src.shape[1]))
    big = np.tile(src, reps)[: shape[0], : shape[1]]
    rng = np.random.default_rng(seed)
    big = np.roll(big, int(rng.integers(0, shape[0])), axis=0)
    # elementwise noise too: tiles repeating exactly would let the lossless stage find them
    noise = rng.standard_normal(shape, dtype=np.float32)
    noise *= 0.02
    noise += 1
    noise *= big
    return noise.astype(dtype)


def build_model(path: Path, size_gb: float, dtype_name: str) -> dict:
    """Gather(embedding) -> MatMul chain of WIDTH x WIDTH layers with Tanh, ~size_gb of weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    dtype = np.float16 if dtype_name == "float16" else np.float32
    elem = TensorProto.FLOAT16 if dtype_name == "float16" else TensorProto.FLOAT
    real = _real_tensors()
    embed_src = real[0]  # word embeddings 30522 x 384
    layer_srcs = [a for a in real[1:] if min(a.shape) >= 384][:4]
    emb = _tiled(embed_src, (VOCAB, WIDTH), 0, dtype)
    inits = [numpy_helper.from_array(emb, "embeddings")]
    total = emb.nbytes
    per_layer = WIDTH * WIDTH * np.dtype(dtype).itemsize
    n_layers = max(1, int((size_gb * 1e9 - total) // per_layer))
    nodes = [helper.make_node("Gather", ["embeddings", "ids"], ["h0"], name="embed")]
    for i in range(n_layers):
        w = _tiled(layer_srcs[i % len(layer_srcs)], (WIDTH, WIDTH), i + 1, dtype)
        inits.append(numpy_helper.from_array(w, f"layer{i}.weight"))
        total += w.nbytes
        nodes.append(helper.make_node("MatMul", [f"h{i}", f"layer{i}.weight"], [f"m{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"], name=f"act{i}"))
    graph = helper.make_graph(
        nodes, "large", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info(f"h{n_layers}", elem, [1, "T", WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    return {"layers": n_layers, "weight_bytes": int(total)}


def _files(path: Path) -> list[Path]:
    sys.path.insert(0, str(ROOT))
    from passes._fileio import model_files

    return model_files(path)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


def _digest(path: Path) -> list[str]:
    out = []
    for f in _files(path):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        out.append(h.hexdigest())
    return out


def timed(argv: list[str], cwd: Path) -> dict:
    """Run argv in a fresh process under /usr/bin/time -v: wall s, CPU s, peak RSS bytes, rc."""
    cmd = ["/usr/bin/time", "-v"] + argv
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    err = proc.stderr

    def field(name: str) -> str:
        m = re.search(rf"{re.escape(name)}: (.+)", err)
        return m.group(1).strip() if m else "0"

    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    rss = int(field("Maximum resident set size (kbytes)")) * 1024
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode:  # the command's own message, before /usr/bin/time's report
        own = [ln for ln in err.split("\tCommand being timed")[0].strip().splitlines()
               if not ln.startswith("Command exited")]
        tail = own[-1] if own else f"exit {proc.returncode}"
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss": rss, "rc": proc.returncode, "last_line": tail}


CHECK = "import onnx, sys; onnx.checker.check_model(sys.argv[1], full_check=True); print('checker ok')"
SESSION = """
import sys, time, numpy as np
sys.path.insert(0, {root!r})
import passes
t0 = time.perf_counter()
s = passes.InferenceSession(sys.argv[1], mode="fold", providers=["CPUExecutionProvider"])
t1 = time.perf_counter()
y = s.run(None, {{"ids": np.array([[1, 2, 3, 4]], dtype=np.int64)}})[0]
print(f"load {{t1 - t0:.1f}} s, run ok, output {{y.shape}} {{y.dtype}} finite={{bool(np.isfinite(y.astype(np.float32)).all())}}")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.5)
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--workdir", help="folder for the generated files (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip (compress,fold,pack,unpack,session)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "large.json"))
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="surgeon-large-"))
    work.mkdir(parents=True, exist_ok=True)
    cli = [str(Path(sys.executable).parent / "surgeon-compress")]
    py = [sys.executable]
    src = work / f"large_{args.dtype}.onnx"
    results: dict = {"size_gb": args.size_gb, "dtype": args.dtype, "workdir": str(work), "steps": {}}
    try:
        t0 = time.perf_counter()
        results["model"] = build_model(src, args.size_gb, args.dtype)
        results["model"].update(build_s=round(time.perf_counter() - t0, 1), bytes_on_disk=_size(src))
        print(f"built {src} ({results['model']['layers']} layers, {results['model']['bytes_on_disk'] / 1e9:.2f} GB on disk)")
        steps = results["steps"]
        # unpack restores the data file under its original name: into a folder of its own
        (work / "unpacked").mkdir(exist_ok=True)
        q, f, z, u = work / "q.onnx", work / "folded.onnx", work / "large.onnxz", work / "unpacked" / src.name
        plan = [  # (name, argv, output, steps it needs)
            ("compress", cli + ["compress", str(src), "-o", str(q)], q, ()),
            ("check int8", py + ["-c", CHECK, str(q)], None, ("compress",)),
            ("fold", cli + ["fold", str(q), "-o", str(f)], f, ("compress",)),
            ("check folded", py + ["-c", CHECK, str(f)], None, ("fold",)),
            ("session", py + ["-c", SESSION.format(root=str(ROOT)), str(q)], None, ("compress",)),
            ("pack", cli + ["pack", str(src), "-o", str(z)], z, ()),
            ("unpack", cli + ["unpack", str(z), "-o", str(u)], u, ("pack",)),
        ]
        for name, argv, output, needs in plan:
            if name in skip or any(n in skip or steps.get(n, {}).get("rc") for n in needs):
                skip.add(name)
                continue
            r = timed(argv, ROOT)
            if output is not None and output.exists():
                r["output_bytes"] = _size(output)
                r["output_files"] = len(_files(output))
            if name == "unpack" and r["rc"] == 0:
                r["byte_identical"] = _digest(u) == _digest(src)
            steps[name] = r
            print(f"  {name:<13} rc={r['rc']} wall {r['wall_s']:>7.1f} s  cpu {r['cpu_s']:>7.1f} s  "
                  f"peak RSS {r['peak_rss'] / 1e9:5.2f} GB  {r['last_line'][:90]}", flush=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    size = results.get("model", {}).get("bytes_on_disk", 0)
    print()
    print(f"model: {args.dtype}, {size / 1e9:.2f} GB on disk (external data)")
    print(f"{'step':<13} {'rc':>3} {'wall s':>8} {'cpu s':>8} {'MB/s (wall)':>12} {'peak RSS GB':>12} {'RSS/model':>10} {'output GB':>10}  note")
    for name, r in results["steps"].items():
        mbps = size / 1e6 / r["wall_s"] if r["wall_s"] and name in ("compress", "pack") else None
        note = "byte-identical" if r.get("byte_identical") else ("NOT identical" if "byte_identical" in r else r["last_line"][:40])
        print(f"{name:<13} {r['rc']:>3} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {mbps and f'{mbps:.0f}' or '':>12} "
              f"{r['peak_rss'] / 1e9:>12.2f} {r['peak_rss'] / max(size, 1):>10.2f} "
              f"{r.get('output_bytes', 0) / 1e9:>10.2f}  {note}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r["rc"] == 0 for r in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
