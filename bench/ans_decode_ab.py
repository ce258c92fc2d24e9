"""A/B of the `ans` decoder (passes/onnxz/_ans.c): the in-tree build against another build of the
same extension, both loaded in one process, on the real coded chunks of `.onnxz` packs.

    python bench/ans_decode_ab.py OLD.so PACK.onnxz [PACK.onnxz ...] [--rounds 41]

OLD.so: a build of passes/onnxz/_planes.c + _ans.c (e.g. the in-tree .so copied aside before a
change). Every `ans` chunk of each pack (no `pairs`; float chunks take the fused decode + merge
path, int8 ones the plain decode) is decoded by the C call alone (`ans_decode`, 1 thread, outputs
reused), each round running both builds in a shuffled order. Prints thread CPU ms min / median
per build and the median (quartiles) of the per-round ratios new / old: at load 10-20 on 2 cores
one decode's time varies 1.5-2x between rounds, fresh processes per build moved more than the
differences measured, and the ratio of two calls made back to back stays steady. Exits 1 when the
two builds decode any chunk to different bytes.
"""
import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from passes.onnxz import _planes as built  # noqa: E402
from passes.onnxz.reader import PackedFile  # noqa: E402


def load_build(path: str):
    """Another build of the extension, under the same module name (its init function's)."""
    spec = importlib.util.spec_from_file_location("passes.onnxz._planes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ans_jobs(pack: Path):
    """(plane views, sign move, raw length) of every `ans` chunk without pairs."""
    data = pack.read_bytes()
    jobs = []
    with PackedFile(pack) as pf:
        for entry in pf.index.coded.values():
            stream = entry.stream
            if stream.codec != "ans" or stream.params.get("pairs"):
                continue
            for chunk in stream.chunks:
                planes, at = [], chunk.offset
                for length in chunk.planes:
                    planes.append(data[at:at + length])
                    at += length
                jobs.append((planes, bool(stream.params.get("sign")), chunk.raw_length))
    return jobs


def decode_all(mod, jobs, outs) -> None:
    for (planes, sign, _), out in zip(jobs, outs):
        err = mod.ans_decode(planes, sign, False, out)
        if err is not None:
            raise SystemExit(f"decode failed: {err}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the other build of passes/onnxz/_planes (.so)")
    ap.add_argument("packs", nargs="+", type=Path, help=".onnxz files whose ans chunks are decoded")
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args(argv)
    builds = {"old": load_build(args.old), "new": built}
    status = 0
    for pack in args.packs:
        jobs = ans_jobs(pack)
        if not jobs:
            print(f"{pack.name}: no ans chunks")
            continue
        outs = {k: [np.empty(n, np.uint8) for *_, n in jobs] for k in builds}
        for k, mod in builds.items():
            decode_all(mod, jobs, outs[k])
        same = all(np.array_equal(a, b) for a, b in zip(outs["old"], outs["new"]))
        if not same:
            print(f"{pack.name}: the two builds decode to different bytes")
            status = 1
            continue
        times = {k: [] for k in builds}
        for _ in range(args.rounds):
            order = list(builds)
            random.shuffle(order)
            for k in order:
                c0 = time.thread_time()
                decode_all(builds[k], jobs, outs[k])
                times[k].append(time.thread_time() - c0)
        total = sum(n for *_, n in jobs)
        cells = []
        for k, t in times.items():
            s = sorted(t)
            cells.append(f"{k} {s[0] * 1e3:.2f} / {s[len(s) // 2] * 1e3:.2f} ms")
        ratios = sorted(b / a for a, b in zip(times["old"], times["new"]))
        q = lambda f: ratios[int(f * (len(ratios) - 1))]
        print(f"{pack.name}: {len(jobs)} chunks, {total / 1e6:.1f} MB; CPU min / median {', '.join(cells)}; "
              f"new/old per round median {q(0.5):.3f} (quartiles {q(0.25):.3f}-{q(0.75):.3f})")
    return status


if __name__ == "__main__":
    sys.exit(main())
