"""Golden files of format 1.2 written with each file's XXH3-128 restore digest (FORMAT.md 4) and
the 1.2 writer's lane counts (32 lanes from 16K symbols), into tests/golden/v1.2-digest/.

    python tests/golden/make_golden_digest.py            # build + check

The files of v1.2/ (ans_shared) were written before the digest existed and stay as they are:
together they show that a 1.2 reader takes 1.2 files with and without `xxh3_128`. Same rules as
make_golden.py: never regenerate this folder to make a failing test pass.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_golden  # noqa: E402

DEST = HERE / "v1.2-digest"


def cases_digest():
    rng = np.random.default_rng(20261201)
    i8 = np.clip(np.round(rng.laplace(0, 10, 20000)), -127, 127).astype(np.int8)
    return {
        # 20000 symbols: 32 lanes from 1.2 on (4 before)
        "digest-ans-w1-int8-32lanes": ([numpy_helper.from_array(i8, "w_int8_20k")], {"ans"}, {}, False),
        "digest-ans-w4-float32-32lanes": ([numpy_helper.from_array(rng.standard_normal(20000).astype(np.float32), "w_f32_20k")],
                                          {"ans"}, {}, False),
        "digest-shared-mixed": make_golden.cases_v12()["ans-shared-mixed"],
        # two restored files, two digests
        "digest-external-data": ([numpy_helper.from_array(rng.standard_normal(5000).astype(np.float32), "w_ext_f32"),
                                  numpy_helper.from_array(i8[:6000].copy(), "w_ext_i8")], {"ans"}, {}, True),
    }


def check_digests(dest: Path) -> None:
    """Every file carries `xxh3_128` and the 20K-symbol planes have 32 lanes."""
    from passes import open_packed

    for path in sorted(dest.glob("*.onnxz")):
        with open_packed(path, threads=1) as pm:
            pf = pm.packed_file
            if not all(f.xxh3_128 for f in pf.index.files):
                raise SystemExit(f"{path.name}: a file without xxh3_128")
            for t in pf.index.tensors:
                if t.stream is not None and t.stream.codec == "ans" and t.key.endswith("_20k"):
                    lanes = {1 << (f[0] - 1) for c in t.stream.chunks for f in pf._frames(c) if len(f) < c.raw_length and f[0]}
                    if 32 not in lanes:
                        raise SystemExit(f"{path.name}: {t.key} has lanes {lanes}, not 32")


def main() -> int:
    make_golden.cases = cases_digest  # build() takes the case set of an unknown folder name from `cases`
    m = make_golden.build(DEST)
    print(f"wrote {len(m['files'])} golden files to {DEST}")
    check_digests(DEST)
    return make_golden.check(DEST)


if __name__ == "__main__":
    sys.exit(main())
