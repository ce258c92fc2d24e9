"""Throughput of the whole quantize_weights and fold_dequantize calls on corpus models.

CPU time (process_time, all threads) and wall time are both reported: the machine is shared, so
wall time moves with other people's load while CPU time stays comparable between runs. MB/s are
float weight bytes (quantize input, fold output) per second; best of --repeat runs.

    python bench/speed.py [--repeat 3] [--models minilm_fp32,minilm_fp16,...] [--src OTHER_CHECKOUT]

--src runs another checkout's `passes` (e.g. an older commit unpacked with git archive) for a
before/after table. Writes bench/out/speed.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
DEFAULT_MODELS = "minilm_fp32,minilm_fp16,open_nsfw,open_nsfw_fp16"


def _best(fn, repeat: int) -> tuple[float, float, object]:
    best_cpu = best_wall = float("inf")
    result = None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        result = fn()
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    return best_cpu, best_wall, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--src", default=str(ROOT), help="checkout whose passes/ is measured")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "speed.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.src).resolve()))
    import passes
    from passes._fileio import load_model, weight_bytes

    print(f"passes from {Path(passes.__file__).parent}")
    rows = []
    for name in args.models.split(","):
        path = CORPUS / name / f"{name}.onnx"
        if not path.exists():
            continue
        model = load_model(path)
        cpu, wall, q = _best(lambda: passes.quantize_weights(model), args.repeat)
        float_in = sum(t.bytes_before for t in _report(passes, model).tensors if not t.scheme.startswith("kept"))
        fcpu, fwall, folded = _best(lambda: passes.fold_dequantize(q), args.repeat)
        float_out = weight_bytes(folded) - (weight_bytes(q) - _levels_bytes(q))
        rows.append({"model": name, "float_MB": float_in / 1e6,
                     "quantize_cpu_s": cpu, "quantize_wall_s": wall,
                     "quantize_MBps_cpu": float_in / 1e6 / cpu, "quantize_MBps_wall": float_in / 1e6 / wall,
                     "fold_out_MB": float_out / 1e6, "fold_cpu_s": fcpu, "fold_wall_s": fwall,
                     "fold_GBps_cpu": float_out / 1e9 / fcpu, "fold_GBps_wall": float_out / 1e9 / fwall})
    hdr = f"{'model':<16} {'float MB':>9} {'q cpu s':>8} {'q wall s':>9} {'q MB/s cpu':>11} {'q MB/s wall':>12} " \
          f"{'fold cpu s':>10} {'fold wall s':>11} {'fold GB/s cpu':>13} {'fold GB/s wall':>14}"
    print(hdr)
    for r in rows:
        print(f"{r['model']:<16} {r['float_MB']:>9.1f} {r['quantize_cpu_s']:>8.2f} {r['quantize_wall_s']:>9.2f} "
              f"{r['quantize_MBps_cpu']:>11.0f} {r['quantize_MBps_wall']:>12.0f} {r['fold_cpu_s']:>10.3f} "
              f"{r['fold_wall_s']:>11.3f} {r['fold_GBps_cpu']:>13.2f} {r['fold_GBps_wall']:>14.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"src": args.src, "load_avg": os.getloadavg(), "rows": rows}, indent=2))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; wrote {out}")
    return 0


def _report(passes, model):
    report = passes.Report()
    passes.quantize_weights(model, report=report)
    return report


def _levels_bytes(q) -> int:
    """Payload bytes of the tensors fold replaces (levels, scales, zero points of DequantizeLinear)."""
    consumed = {i for n in q.graph.node if n.op_type == "DequantizeLinear" for i in n.input}
    return sum(len(t.raw_data) for t in q.graph.initializer if t.name in consumed)


if __name__ == "__main__":
    sys.exit(main())
