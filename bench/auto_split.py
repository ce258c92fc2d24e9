#!/usr/bin/env python3
"""The auto mode on both splits of a corpus model's feeds, and where the packed bytes go (issue 4; not a test).

bench/lossy.py part b calibrates on the first half of the feeds and measures on the second. A change
to the auto mode that shrinks a model there may be luck on that one split (open_nsfw's held-out
crops sit near ties), so this runs the same measurement on both splits:

    split "first":  passes.compress on the first half, packed and measured on the second (part b's)
    split "second": passes.compress on the second half, packed and measured on the first
    split "even" / "odd": on the feeds at even / odd positions, measured on the others (more draws)

and prints, for each packed auto model, the bytes per weight: its form (the auto report's), its
bits per weight after packing (the stored bytes of the tensors the pack codes apart for it: its
levels, and its scales where they are coded apart), its share of the file; and the bytes that are
no weight's: other coded tensors (biases, float vectors), and the graph skeleton + index, which
also holds the tensors too small to be coded apart (per-channel scales, BatchNormalization
parameters in Constant nodes, ...).

Then the same file by kind of tensor (kind_breakdown): levels, scales, zero points, float weights
the plan kept, float parameters (biases, normalisation vectors), integer constants, each with its
bytes coded apart plus its share of the zstd skeleton (the skeleton packed again with that kind's
small payloads cut out: the marginal bytes, scaled so that the kinds share exactly the skeleton's
bytes beyond the graph's own structure), the graph protobuf alone (the skeleton with every payload
cut out: nodes, names, tensor headers) and the pack's index + header. --keep DIR saves each auto
model and its report there, to break it down again without a new search.

    python bench/auto_split.py --only open_nsfw,rapidocr_cls \
        [--splits first,second] [--top 12] [--json bench/out/auto_split.json]

--target 'cosine>=0.9868' runs the auto mode at that target instead of part b's (on the models whose metric
it names): e.g. minilm_fp32 at quantize_dynamic's held-out fidelity, or a lower target to see what held-out
fidelity a model keeps at the size criterion.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import passes  # noqa: E402
from passes.onnxz import reader, writer  # noqa: E402

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))
TARGETS = {"top1": "top1>=0.99", "cosine": "cosine>=0.999"}  # bench/lossy.py part b's targets
# the tensors quantize_weights / cast_levels write for weight W (W_quantized, W_scale, ...)
WEIGHT_SUFFIXES = ("_quantized", "_scale", "_zero_point", "_shape")


def corpus_entries(only):
    manifest = json.loads((CORPUS / "MANIFEST.json").read_text())
    entries = manifest["entries"] if isinstance(manifest, dict) else manifest
    return [e for e in entries if e["name"] in only and e["metric"] in TARGETS]


def split_feeds(feeds, split):
    """(calibration, held-out) halves: 'first' calibrates on the first half (bench/lossy.py's split),
    'second' on the second; 'even' / 'odd' on the feeds at even / odd positions (the other ones held
    out): two more draws of the same size, to tell a change from the search's luck on one split."""
    if split in ("even", "odd"):
        even, odd = feeds[0::2], feeds[1::2]
        return (even, odd) if split == "even" else (odd, even)
    if split not in ("first", "second"):
        raise SystemExit(f"unknown split {split!r} (first, second, even, odd)")
    half = len(feeds) // 2
    first, second = feeds[:half], feeds[half:]
    return (first, second) if split == "first" else (second, first)


def owner_weight(tensor_name, weights):
    """The auto mode's weight a packed tensor belongs to (its levels, scales, shape), else None."""
    if tensor_name in weights:
        return tensor_name
    for suffix in WEIGHT_SUFFIXES:
        if tensor_name.endswith(suffix) and tensor_name[: -len(suffix)] in weights:
            return tensor_name[: -len(suffix)]
    return None


def byte_breakdown(packed_path, report):
    """Stored bytes of the .onnxz by auto-mode weight, and the rest (graph + index, small float tensors)."""
    forms = {t["name"]: t for t in report["tensors"]}
    with reader.open_packed(str(packed_path)) as pm:
        meta = pm.metadata()
    total = meta["packed_bytes"]
    per_weight, other_tensors = {}, 0
    for t in meta["tensors"]:
        stored = t["stored"] if t["stored"] is not None else 0
        w = owner_weight(t["name"], forms)
        if w is None:
            other_tensors += stored
        else:
            per_weight[w] = per_weight.get(w, 0) + stored
    rows = []
    for name, stored in per_weight.items():
        n = int(np.prod(forms[name]["shape"]))
        rows.append({"name": name, "form": forms[name]["form"], "elements": n, "stored_bytes": stored,
                     "bits_per_weight": 8 * stored / n, "share": stored / total,
                     "est_bits_per_weight": forms[name]["bits_after_packing"]})
    rows.sort(key=lambda r: -r["stored_bytes"])
    rest = total - sum(per_weight.values()) - other_tensors
    return {"packed_bytes": total, "weights": rows, "other_tensor_bytes": other_tensors,
            "graph_and_index_bytes": rest}


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _graph_tensors(model):
    """(name, TensorProto) of every initializer and Constant `value` of every graph; the nodes by the
    name of what they give; who reads each name (node, input index); a Constant tensor's own name ->
    the node's output name."""
    tensors, producers, readers, aliases = {}, {}, {}, {}

    def walk(g):
        for t in g.initializer:
            tensors[t.name] = t
        for n in g.node:
            for i, x in enumerate(n.input):
                readers.setdefault(x, []).append((n, i))
            for o in n.output:
                producers[o] = n
            for a in n.attribute:
                if n.op_type == "Constant" and a.name == "value":
                    tensors[n.output[0]] = a.t
                    if a.t.name and a.t.name != n.output[0]:  # the pack names it by the tensor's own name
                        aliases[a.t.name] = n.output[0]
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs):
                    walk(sub)

    walk(model.graph)
    return tensors, producers, readers, aliases


def tensor_kinds(model, report):
    """Kind of every tensor of the auto model, from who reads it: levels (DequantizeLinear's input 0,
    an integer tensor a Cast reads), scales / zero points (DequantizeLinear's 1 / 2, or what a Mul /
    Sub applies to a Cast of levels), the weights the plan kept float, float parameters, integer
    constants."""
    plan = {t["name"]: t["form"] for t in report["tensors"]}
    tensors, producers, readers, aliases = _graph_tensors(model)

    def from_levels(name):  # name is (a Sub / Cast / Reshape of) a Cast of an integer tensor
        n = producers.get(name)
        while n is not None and n.op_type in ("Sub", "Reshape", "Cast"):
            if n.op_type == "Cast":
                t = tensors.get(n.input[0])
                return t is not None and t.data_type not in FLOAT_TYPES
            n = producers.get(n.input[0])
        return False

    kinds = {}
    for name, t in tensors.items():
        uses = readers.get(name, [])
        kind = None
        dq = [i for n, i in uses if n.op_type == "DequantizeLinear"]
        if dq:
            kind = ("levels", "scales", "zero points")[min(dq)]
        elif t.data_type not in FLOAT_TYPES and any(n.op_type == "Cast" for n, _ in uses):
            kind = "levels"
        else:
            for n, i in uses:
                if n.op_type in ("Mul", "Sub") and len(n.input) == 2 and from_levels(n.input[1 - i]):
                    kind = "scales" if n.op_type == "Mul" else "zero points"
                    break
        if kind is None:
            if plan.get(name) == "float":
                kind = "float weights the plan kept"
            elif t.data_type in FLOAT_TYPES:
                kind = "float parameters (biases, norms)"
            else:
                kind = "integer constants (shapes, axes)"
        kinds[name] = kind
    for alias, name in aliases.items():
        kinds.setdefault(alias, kinds[name])
    return kinds


def kind_breakdown(model, report, packed_path):
    """Stored bytes of the .onnxz by kind of tensor (tensor_kinds), the graph protobuf, the index."""
    kinds = tensor_kinds(model, report)
    with reader.open_packed(str(packed_path)) as pm:
        meta = pm.metadata()
    total, skeleton = meta["packed_bytes"], meta["files"][0]["skeleton_stored"]
    rows = {}
    for t in meta["tensors"]:
        r = rows.setdefault(kinds.get(t["key"]) or kinds.get(t["name"], "other"),
                            {"apart": 0, "in_skeleton": 0, "elements": 0, "raw_bytes": 0, "stored_apart": 0,
                             "skeleton_share": 0.0})
        r["elements"] += int(np.prod(t["shape"])) if t["shape"] else 1
        r["raw_bytes"] += t["bytes"]
        if t["stored"] is None:
            r["in_skeleton"] += 1
        else:
            r["apart"] += 1
            r["stored_apart"] += t["stored"]
    # the skeleton again as the writer packs it, with payloads cut out: none / one kind's / all
    src = writer._load_sources(model)[0]
    cut = writer._plan_cuts(src, writer.MIN_CUT)
    cut_ids = {id(r) for r in cut}
    keys = dict(zip(map(id, src.refs), writer._keys(src.refs)))
    small = [r for r in src.refs if id(r) not in cut_ids]

    def packed_skeleton(cuts):
        sk = writer._skeleton(src.data, sorted(cuts, key=lambda r: r.offset))
        return len(writer._compress_skeleton(np.frombuffer(sk, np.uint8))) if sk else 0

    structure = packed_skeleton(writer._plan_cuts(src, 1))
    marginal = {}
    for kind in rows:
        mine = [r for r in small if (kinds.get(keys[id(r)]) or kinds.get(r.name, "other")) == kind]
        if mine:
            marginal[kind] = max(skeleton - packed_skeleton(cut + mine), 0)
    whole = sum(marginal.values())
    for kind, m in marginal.items():
        rows[kind]["skeleton_share"] = (skeleton - structure) * m / whole if whole else 0.0
    apart = sum(r["stored_apart"] for r in rows.values())
    return {"packed_bytes": total, "kinds": rows, "graph_protobuf_bytes": structure,
            "index_and_header_bytes": total - skeleton - apart}


def print_kinds(kb):
    total = kb["packed_bytes"]
    print("  | kind | tensors apart / in skeleton | elements | stored B | share | bits/element |")
    print("  |---|---|---|---|---|---|")
    for kind, r in sorted(kb["kinds"].items(), key=lambda kv: -(kv[1]["stored_apart"] + kv[1]["skeleton_share"])):
        b = r["stored_apart"] + r["skeleton_share"]
        print(f"  | {kind} | {r['apart']} / {r['in_skeleton']} | {r['elements']} | {b:.0f} | {100 * b / total:.1f}% | "
              f"{8 * b / max(r['elements'], 1):.2f} |")
    for label, key in (("graph protobuf (nodes, names, tensor headers)", "graph_protobuf_bytes"),
                       ("pack index + header", "index_and_header_bytes")):
        print(f"  | {label} | | | {kb[key]} | {100 * kb[key] / total:.1f}% | |")


def run_split(entry, split, tmp, keep=None, target=None):
    from passes.fidelity import evaluate, load_feeds

    name, metric = entry["name"], entry["metric"]
    src = CORPUS / name / f"{name}.onnx"
    feeds_path = CORPUS / entry.get("feeds", f"{name}/feeds.npz")
    feeds = load_feeds(feeds_path if feeds_path.exists() else CORPUS / name / "feeds.npz")
    calib, held = split_feeds(feeds, split)
    margs = entry.get("metric_args")
    target = target or TARGETS[metric]
    c0 = time.process_time()
    model, rep = passes.compress(str(src), target=target, feeds=calib, metric_args=margs)
    cpu = time.process_time() - c0
    packed = Path(tmp) / f"{name}_{split}.onnxz"
    passes.pack(model, packed, force=True)
    if keep:  # the auto model itself, to break its bytes down again without a new search
        Path(keep).mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(Path(keep) / f"{name}_{split}.onnx"))
        (Path(keep) / f"{name}_{split}.report.json").write_text(json.dumps(rep, default=str))
    res = evaluate(str(src), model, feeds=held, metric=metric, metric_args=margs)
    req = passes.fidelity.parse_requirement(target)
    bd = byte_breakdown(packed, rep)
    bd["kinds"] = kind_breakdown(model, rep, packed)
    return {"model": name, "split": split, "target": target, "packed_bytes": bd["packed_bytes"],
            "packed_pct": round(100 * bd["packed_bytes"] / src.stat().st_size, 2),
            "held_value": res.metrics.get(metric), "held_metrics": res.metrics, "met": bool(req.check(res)),
            "calib_metrics": rep["fidelity"], "cpu_s": round(cpu, 1), "breakdown": bd, "notes": rep["notes"]}


def print_row(r, top):
    bd = r["breakdown"]
    print(f"\n{r['model']} split={r['split']}: {r['packed_pct']:.2f}% ({r['packed_bytes']} B), held-out "
          f"{r['target'].split('>=')[0]} {r['held_value']:.5f} {'met' if r['met'] else 'MISSED'}, "
          f"calibration {json.dumps({k: round(v, 5) for k, v in r['calib_metrics'].items() if isinstance(v, float)})}, "
          f"auto CPU {r['cpu_s']} s")
    print(f"  graph+index {bd['graph_and_index_bytes']} B ({100 * bd['graph_and_index_bytes'] / bd['packed_bytes']:.1f}%), "
          f"other tensors (biases, small, float) {bd['other_tensor_bytes']} B "
          f"({100 * bd['other_tensor_bytes'] / bd['packed_bytes']:.1f}%)")
    print_kinds(bd["kinds"])
    forms = {}
    for w in bd["weights"]:
        f = forms.setdefault(w["form"], [0, 0, 0])
        f[0] += 1
        f[1] += w["stored_bytes"]
        f[2] += w["elements"]
    for form, (k, b, n) in sorted(forms.items(), key=lambda kv: -kv[1][1]):
        print(f"  {form:44s} {k:3d} weights {b:9d} B {100 * b / bd['packed_bytes']:5.1f}%  {8 * b / n:5.2f} bits/weight")
    print(f"  {'weight':40s} {'form':40s} {'elements':>9s} {'bits/w':>6s} {'est':>6s} {'share':>6s}")
    for w in bd["weights"][:top]:
        print(f"  {w['name'][:40]:40s} {w['form'][:40]:40s} {w['elements']:9d} {w['bits_per_weight']:6.2f} "
              f"{w['est_bits_per_weight']:6.2f} {100 * w['share']:5.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="open_nsfw,rapidocr_cls,open_nsfw_fp16,silero_vad_v6")
    ap.add_argument("--splits", default="first,second")
    ap.add_argument("--top", type=int, default=12, help="largest weights listed per model")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="folder to save each auto model (.onnx) and its report in")
    ap.add_argument("--target", default=None,
                    help="the auto target instead of part b's (e.g. 'cosine>=0.9868', quantize_dynamic's held-out "
                         "fidelity on minilm_fp32); only models whose metric it names are run")
    args = ap.parse_args()
    only = args.only.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        entries = corpus_entries(only)
        if args.target:
            from passes.fidelity import parse_requirement

            wanted = parse_requirement(args.target).metric  # refuses a malformed target before any run
            entries = [e for e in entries if e["metric"] == wanted]
        for e in entries:
            for split in args.splits.split(","):
                r = run_split(e, split, tmp, args.keep, args.target)
                rows.append(r)
                print_row(r, args.top)
    print("\n| model | split | auto packed | held-out value | met | auto CPU s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['split']} | {r['packed_pct']:.2f}% | {r['held_value']:.5f} | "
              f"{'yes' if r['met'] else 'NO'} | {r['cpu_s']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
