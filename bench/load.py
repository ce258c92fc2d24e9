"""Benchmark: sessions from plain, compressed and packed models (issue 5). Not a test.

For each corpus model (and a generated ~3 GB model) and each way of loading it, in a fresh
subprocess each: time to a ready session, the memory the session adds (peak RSS after creating
it minus RSS just before: VmHWM - VmRSS from /proc/self/status), RSS after the runs, the mean run
time over the corpus feeds, and agreement with the original float model's outputs (the corpus
metric: cosine or top-1; plus max |difference| against the folded model for fold mode). The
generated model also runs plain without onnxruntime's weight prepacking ("plain-noprepack"): fold
mode turns prepacking off for it (over runtime.PREPACK_AUTO_LIMIT of shared weights), and
onnxruntime's MatMul then sums in another order; its fold row gives max |difference| against both
plain sessions (0 against the one that prepacks as it does). `--session-config KEY=VALUE` sets an
onnxruntime config entry on every session, the plain rows' included (BENCH_LOAD_SET in the environment sets
runtime constants in the workers: see _apply_settings). `--ab-env KEY=VALUE` runs every
passes row twice, as it is and with KEY=VALUE in its environment ("+ab" in the mode column), their
rounds interleaved with the others: an A/B of an environment switch of the runtime in one run, or
of a constant with --ab-env BENCH_LOAD_SET=module.NAME=value; the two are then also compared round
by round (as-is / +ab per round: median and quartiles, below the table), which cancels a burst of
load that hits both of a pair alike.

    python bench/load.py                                  # corpus models + ~3 GB model
    python bench/load.py --models minilm_fp32 --big-gb 0  # one model, no big one
    python bench/load.py --provider cuda                  # CUDA execution provider (onnxruntime-gpu)

Prints a table; writes bench/out/load.json. Ready time: "ready s", "cpu s" and their "x" are the
best of the rounds, "med x" the ratio of the medians. Run time: "run ms" and its "x" are medians over all
runs; "min x" sums, per feed, the fastest of the repeats (load from other processes only adds
time) and compares those sums. "sleeps": the median number of times the process's threads blocked
(voluntary context switches) while the session was made; "main": those of the calling thread
alone, where onnxruntime parses and initialises the model (a streamed model: its waits on our
decode and writer; the writer's own paced sleeps are in "sleeps" only). "ort ms": the median CPU
that threads Python did not start (onnxruntime's thread pools) used while the session was made:
its intra-op worker spins through the parse, on the core a packed file's decode needs. The rounds
of a model's variants are interleaved. Artefacts (compressed, packed, the big model) go to a
temporary folder, removed at the end. Subprocesses run one at a time (the big one needs room).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CORPUS = Path(os.environ.get("SURGEON_CORPUS") or os.environ.get("CORPUS") or ROOT.parent / "shared" / "corpus")
if not CORPUS.is_dir():
    CORPUS = Path("/work/shared/corpus")
OUT = ROOT / "bench" / "out"
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


# ---------------------------------------------------------------------- worker (one subprocess)

def _status_mb() -> tuple[float, float]:
    rss = hwm = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return rss, hwm


def _thread_sleeps() -> int:
    """Voluntary context switches of the calling thread so far (0 where /proc does not say)."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class NativeThreadsCpu:
    """CPU seconds of this process's threads that Python did not start: onnxruntime's thread pools
    (and C helpers). An intra-op worker spins for a while after its pool starts, which is while the
    model is parsed: on 2 cores it holds the core a packed file's decode would use. Python's threads
    are left out: those alive when this is made, and each one started later (threading.setprofile
    runs in every new thread as it begins, and notes its id: a thread that has just ended may still
    be listed by Linux, and no longer by threading). /proc/self/task/*/schedstat (0 where Linux
    does not say)."""

    def __init__(self):
        self._python = {t.native_id for t in threading.enumerate()}
        threading.setprofile(self._note)

    def _note(self, *_):
        self._python.add(threading.get_native_id())
        sys.setprofile(None)  # (this thread only: noted once)

    def close(self) -> None:
        threading.setprofile(None)

    def seconds(self) -> float:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return 0.0
        total = 0
        for tid in tids:
            if int(tid) in self._python:
                continue
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile)
                pass
        return total / 1e9


def worker(spec: dict) -> dict:
    import onnxruntime as ort

    import passes
    import passes.runtime  # noqa: F401  (imports done before the clock starts, as for plain onnxruntime)
    # (a module the load imports lazily is compiled from source inside the clock where no .pyc is
    # written, as with PYTHONDONTWRITEBYTECODE=1 on these hosts: cast_levels, imported by
    # runtime_fold.fold_facts, cost every passes row 4.2-4.7 ms of the calling thread's CPU; the
    # modules a load imports are reported, "imported in the clock")
    import passes.cast_levels  # noqa: F401
    import passes.quantize  # noqa: F401  (int8 mode's)
    import passes.runtime_fold  # noqa: F401
    import passes.runtime_int8  # noqa: F401
    import passes.runtime_source  # noqa: F401
    import passes.precision  # noqa: F401
    import passes.fold  # noqa: F401
    import passes.onnxz  # noqa: F401

    _apply_settings(os.environ.get("BENCH_LOAD_SET", ""))
    feeds = _load_feeds(spec)
    options = ort.SessionOptions()
    options.intra_op_num_threads = spec["threads"]
    for key, value in (spec.get("config") or {}).items():  # e.g. the spinning setting, for both sides alike
        options.add_session_config_entry(key, value)
    providers = [spec["provider"]] + (["CPUExecutionProvider"] if spec["provider"] != "CPUExecutionProvider" else [])
    rss0, _ = _status_mb()
    # voluntary context switches of all threads (a thread blocking on a pipe, a lock, an event):
    # counts what the load waits on, much as on a quiet machine, where times at load 15 do not
    sleeps0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    main_sleeps0 = _thread_sleeps()
    modules0 = set(sys.modules)
    native_clock = NativeThreadsCpu()
    native0 = native_clock.seconds()
    c0 = time.process_time()  # CPU time of all threads: robust to other processes' load
    t0 = time.perf_counter()
    if spec["how"] == "plain":
        session = ort.InferenceSession(spec["path"], options, providers=providers)
    else:
        session = passes.InferenceSession(spec["path"], options, providers=providers, mode=spec["how"],
                                          dtype=spec.get("dtype"))
    ready = time.perf_counter() - t0
    ready_cpu = time.process_time() - c0
    native = native_clock.seconds() - native0
    native_clock.close()
    sleeps = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - sleeps0
    main_sleeps = _thread_sleeps() - main_sleeps0
    imported = sorted(set(sys.modules) - modules0)
    _, hwm = _status_mb()
    outputs = [session.run(None, f) for f in feeds]
    times = []
    for _ in range(spec["repeat"]):
        for f in feeds:
            t = time.perf_counter()
            session.run(None, f)
            times.append(time.perf_counter() - t)
    rss_runs, _ = _status_mb()
    np.savez(spec["outputs"], **{f"{i}/{j}": o for i, out in enumerate(outputs) for j, o in enumerate(out)})
    # per feed, the fastest of the repeats (load from other processes only ever adds time), summed
    per_feed = np.asarray(times).reshape(spec["repeat"], len(feeds)).min(axis=0)
    return {"ready_s": ready, "ready_cpu_s": ready_cpu, "ready_native_cpu_s": native, "ready_sleeps": sleeps, "ready_main_sleeps": main_sleeps, "added_mb": hwm - rss0, "after_runs_mb": rss_runs - rss0,
            "run_ms": 1000 * float(np.mean(times)), "run_ms_median": 1000 * float(np.median(times)),
            "run_ms_min_sum": 1000 * float(per_feed.sum()), "mode": getattr(session, "mode", "plain"),
            "fold_route": getattr(session, "fold_route", None), "prepack": getattr(session, "prepack", None),
            "imported_in_clock": imported}


def _apply_settings(text: str) -> None:
    """BENCH_LOAD_SET="a.b.NAME=value[;...]" (e.g. through --ab-env): constants of the runtime set in
    the worker before the clock, each a Python literal; the dotted path is a module, then attributes
    (a class constant too), so a threshold or a switch is A/B-compared without an environment hook
    in the library: --ab-env BENCH_LOAD_SET=passes.runtime._DrainPacer.DRAIN_SHARE=0.5"""
    import ast
    import importlib

    for item in filter(None, (t.strip() for t in text.split(";"))):
        target, sep, value = item.partition("=")
        names = target.strip().split(".")
        if not sep or len(names) < 2:
            raise SystemExit(f"BENCH_LOAD_SET: want module.NAME=value, got {item!r}")
        owner = None
        for cut in range(len(names) - 1, 0, -1):  # the longest module prefix
            try:
                owner = importlib.import_module(".".join(names[:cut]))
            except ImportError:
                continue
            try:
                for name in names[cut:-1]:
                    owner = getattr(owner, name)
            except AttributeError:
                owner = None
            break
        if owner is None or not hasattr(owner, names[-1]):
            raise SystemExit(f"BENCH_LOAD_SET: nothing named {target.strip()!r}")
        setattr(owner, names[-1], ast.literal_eval(value.strip()))


def _load_feeds(spec):
    if spec.get("feeds"):
        from passes.fidelity import load_feeds

        return load_feeds(spec["feeds"])[: spec["n_feeds"]]
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((1, spec["big_width"]), dtype=np.float32)} for _ in range(spec["n_feeds"])]


def _read_outputs(path) -> list:
    z = np.load(path)
    out = {}
    for key in z.files:
        i, j = key.split("/")
        out.setdefault(int(i), {})[int(j)] = z[key]
    return [[out[i][j] for j in sorted(out[i])] for i in sorted(out)]


# ---------------------------------------------------------------------- artefacts

def _manifest() -> dict:
    data = json.loads((CORPUS / "MANIFEST.json").read_text())
    entries = data["entries"] if isinstance(data, dict) else data
    return {e["name"]: e for e in entries}


def prepare_corpus_model(name: str, tmp: Path) -> dict:
    import onnx

    import passes

    src = CORPUS / name / f"{name}.onnx"
    files = {"float.onnx": src}
    q8 = tmp / f"{name}.q8.onnx"
    onnx.save(passes.quantize_weights(str(src), bits=8), str(q8))
    files["q8.onnx"] = q8
    folded = tmp / f"{name}.q8.folded.onnx"
    onnx.save(passes.fold_dequantize(str(q8)), str(folded))
    files["q8.folded.onnx"] = folded
    for key, path in (("float.onnxz", src), ("q8.onnxz", q8)):
        dst = tmp / f"{name}.{key}"
        passes.pack(str(path), str(dst), force=True)
        files[key] = dst
    return files


def prepare_in_subprocess(name: str, tmp: Path) -> dict:
    """prepare_corpus_model with the code as it is now (the pack format may evolve while a long
    run goes on: files are written by the same code that the workers then read them with)."""
    proc = subprocess.run([sys.executable, __file__, "--prepare", json.dumps([name, str(tmp)])], capture_output=True,
                          text=True, cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"preparing {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return {k: Path(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def generate_big_model(tmp: Path, gigabytes: float, width: int = 4096) -> tuple[Path, int]:
    """A chain of MatMul (width x width float32) whose weights tile real corpus tensors, saved with
    external data, tensor by tensor (never the whole model in memory)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    source = onnx.load(str(CORPUS / "minilm_fp32" / "minilm_fp32.onnx"))
    real = np.concatenate([numpy_helper.to_array(t).ravel() for t in source.graph.initializer
                           if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and min(t.dims) > 1])
    del source
    real = real[np.isfinite(real)]
    per = width * width * 4
    layers = max(1, int(round(gigabytes * 1e9 / per)))
    path = tmp / "big.onnx"
    data_name = "big.onnx.data"
    nodes, inits, prev = [], [], "x"
    with open(tmp / data_name, "wb") as f:
        for i in range(layers):
            start = (i * 7919 * 1031) % real.size
            w = np.resize(np.roll(real, -start), (width, width)).astype(np.float32)
            w *= np.float32(1.0 / (np.sqrt(width) * (w.std() + 1e-12)))  # keeps activations O(1) through the chain
            offset = f.tell()
            f.write(w.tobytes())
            t = TensorProto()
            t.name, t.data_type = f"w{i}", TensorProto.FLOAT
            t.dims.extend([width, width])
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(w.nbytes))):
                e = t.external_data.add()
                e.key, e.value = k, v
            inits.append(t)
            nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"y{i}"]))
            prev = f"y{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, width])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path, layers * per


# ---------------------------------------------------------------------- driver

def run_worker(spec: dict, timeout: int = 1800) -> dict:
    env = dict(os.environ, **spec["env"]) if spec.get("env") else None
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


BEST_KEYS = ("ready_s", "ready_cpu_s", "added_mb", "after_runs_mb", "run_ms", "run_ms_median", "run_ms_min_sum")


def best_of(spec: dict, rounds: int) -> dict:
    """The machine is shared and noisy: each figure is the best of `rounds` fresh subprocesses."""
    return best_of_many([spec], rounds)[0]


def best_of_many(specs: list, rounds: int) -> list:
    """best_of for several specs, their rounds interleaved (round 1 of every spec, then round 2,
    ...): a burst of load from other processes then hits every variant alike, not one of them."""
    runs = [[] for _ in specs]
    for _ in range(max(1, rounds)):
        for i, spec in enumerate(specs):
            runs[i].append(run_worker(spec))
    out = []
    for spec_runs in runs:
        ok = [r for r in spec_runs if "error" not in r]
        if not ok:
            out.append(spec_runs[0])
            continue
        best = dict(ok[0])
        for key in BEST_KEYS:
            best[key] = min(r[key] for r in ok)
        # the median beside the best: a fresh-process load on this kind of machine spreads by
        # +-40% round to round, so the best of a few rounds alone can land either side of a target
        for key in ("ready_s", "ready_cpu_s", "ready_native_cpu_s", "ready_sleeps", "ready_main_sleeps"):
            if all(key in r for r in ok):
                best[key + "_median"] = float(np.median([r[key] for r in ok]))
        # every round's figures, in round order (None: a failed round), for paired comparisons
        for key in ("ready_s", "ready_cpu_s"):
            best[key + "_rounds"] = [r.get(key) if "error" not in r else None for r in spec_runs]
        best["imported_in_clock"] = sorted(set().union(*(r.get("imported_in_clock") or () for r in ok)))
        # (the float16 fold's route depends on the machine's load: rounds may differ)
        best["fold_route"] = "+".join(sorted({str(r.get("fold_route")) for r in ok})) if ok[0].get("fold_route") else None
        out.append(best)
    return out


def agreement(ref, cand, metric) -> dict:
    from passes.fidelity import compute_metrics

    try:
        m = compute_metrics(ref, cand, metric=metric if metric in ("cosine", "top1") else "cosine")
    except Exception as exc:  # metric needs what this output lacks
        return {"error": str(exc)[:100]}
    keep = {k: m[k] for k in ("cosine", "cosine_min", "top1", "maxabs") if k in m and m[k] is not None}
    return keep


def maxabs(a, b) -> float:
    return float(max(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))) for ra, rb in zip(a, b) for x, y in zip(ra, rb)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm_fp32,open_nsfw,minilm_fp16,open_nsfw_fp16")
    ap.add_argument("--big-gb", type=float, default=3.0, help="size of the generated model (0: none)")
    ap.add_argument("--feeds", type=int, default=16, help="corpus feeds used per model")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over the feeds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="each measurement repeated; the best round is kept")
    ap.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    ap.add_argument("--variants", default="all",
                    help="all, or 'fold' (the plain files and the fold rows only: more rounds in the same time), "
                         "or a comma list of file:mode (e.g. float.onnxz:fold,q8.onnx:int8); float.onnx:plain always runs")
    ap.add_argument("--session-config", action="append", default=[], metavar="KEY=VALUE",
                    help="an onnxruntime session config entry set on every session alike, the plain rows' too "
                         "(e.g. session.intra_op.allow_spinning=0); repeatable. The table says which were set")
    ap.add_argument("--ab-env", metavar="KEY=VALUE",
                    help="every passes row (not the plain ones) runs twice, its rounds interleaved: as it is and with "
                         "KEY=VALUE in its environment (mode shown with '+ab'): an A/B of a switch in one run")
    ap.add_argument("--out", default=str(OUT / "load.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prepare:
        name, folder = json.loads(args.prepare)
        print(json.dumps({k: str(v) for k, v in prepare_corpus_model(name, Path(folder)).items()}))
        return 0
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    provider = PROVIDERS[args.provider]
    config = {}
    for item in args.session_config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--session-config wants KEY=VALUE, got {item!r}")
        config[key] = value
    ab_env = None
    if args.ab_env:
        key, sep, value = args.ab_env.partition("=")
        if not sep or not key:
            ap.error(f"--ab-env wants KEY=VALUE, got {args.ab_env!r}")
        ab_env = {key: value}
    manifest = _manifest()
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    rows = []
    try:
        for name in [m for m in args.models.split(",") if m]:
            if name not in manifest or not (CORPUS / name / f"{name}.onnx").is_file():
                print(f"[{name}] not in the corpus at {CORPUS}: skipped", file=sys.stderr, flush=True)
                continue
            entry = manifest[name]
            print(f"[{name}] compressing and packing ...", file=sys.stderr, flush=True)
            files = prepare_in_subprocess(name, tmp)
            base = {"threads": args.threads, "repeat": args.repeat, "n_feeds": args.feeds, "provider": provider,
                    "feeds": str(CORPUS / entry["feeds"]), "config": config}
            variants = [("float.onnx", "plain"), ("q8.folded.onnx", "plain"), ("q8.onnx", "plain"),
                        ("float.onnxz", "fold"), ("q8.onnx", "fold"), ("q8.onnxz", "fold"),
                        ("q8.onnx", "int8"), ("q8.onnxz", "int8"), ("float.onnx", "int8"), ("q8.onnxz", "auto")]
            # precision at load: a float16 model as float32 (CPU), a float32 model as float16
            variants += [("float.onnxz", "fold:float32" if "fp16" in name else "fold:float16")]
            variants = _select(variants, args.variants)
            results, specs, keys = {}, [], []
            for key, how in variants:
                how, _, dtype = how.partition(":")
                how_key = f"{how}:{dtype}" if dtype else how
                for env in [None] + ([ab_env] if ab_env and how != "plain" else []):
                    tag = "+ab" if env else ""
                    specs.append(dict(base, path=str(files[key]), how=how, dtype=dtype or None, env=env,
                                      outputs=str(tmp / f"{name}.{key}.{how}{dtype}{tag}.npz")))
                    keys.append((key, how_key + tag))
            print(f"[{name}] {len(specs)} variants x {args.rounds} rounds, interleaved", file=sys.stderr, flush=True)
            for (key, how_key), spec, r in zip(keys, specs, best_of_many(specs, args.rounds)):
                if "error" not in r:
                    r["outputs"] = _read_outputs(spec["outputs"])
                results[(key, how_key)] = r
            _summarise(name, entry["metric"], results, rows)
        if args.big_gb > 0:
            _big(args, tmp, provider, rows, config)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if ab_env:
        print("rows marked +ab ran with " + ", ".join(f"{k}={v}" for k, v in ab_env.items()) + " in their environment")
    if config:
        print("onnxruntime session config on every row: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    _print_table(rows)
    if ab_env:
        _print_paired(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                                         indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _select(variants: list, spec: str) -> list:
    """The variants `spec` names (see --variants); the plain float .onnx always (the reference)."""
    if spec == "all":
        return variants
    if spec == "fold":
        keep = [v for v in variants if v[1] in ("plain", "fold") and v != ("q8.onnx", "plain")]
    else:
        wanted = {tuple(item.split(":", 1)) for item in spec.split(",") if item}
        keep = [v for v in variants if v in wanted]
    return [("float.onnx", "plain")] + [v for v in keep if v != ("float.onnx", "plain")]


def _summarise(name, metric, results, rows):
    base = results[("float.onnx", "plain")]
    folded = results.get(("q8.folded.onnx", "plain"), {})
    for (key, how), r in results.items():
        how, ab = (how[:-3], True) if how.endswith("+ab") else (how, False)
        row = {"model": name, "file": key, "mode": how}
        if "error" in r:
            row["error"] = r["error"]
            row["mode"] += "+ab" if ab else ""
            rows.append(row)
            continue
        row.update({k: r[k] for k in BEST_KEYS + ("mode", "ready_s_median", "ready_cpu_s_median", "ready_sleeps_median",
                                             "ready_main_sleeps_median", "ready_native_cpu_s_median", "ready_s_rounds", "ready_cpu_s_rounds")
                    if k in r})
        row["mode"] = how if how != "auto" else f"auto->{r['mode']}"
        row["mode"] = row["mode"].replace("fold:float", "fold->f")
        if r.get("fold_route") and "here" not in r["fold_route"]:  # (float16 on a CPU: onnxruntime's constant folding)
            row["mode"] += "/" + r["fold_route"].replace("onnxruntime", "ort")
        row["fold_route"] = r.get("fold_route")
        row["imported_in_clock"] = r.get("imported_in_clock")
        if ab:
            row["mode"] += "+ab"
            row["ab_env"] = True
        if "error" not in base:
            row["ready_x"] = r["ready_s"] / base["ready_s"]
            row["ready_cpu_x"] = r["ready_cpu_s"] / base["ready_cpu_s"]
            if "ready_s_median" in r and "ready_s_median" in base:
                row["ready_median_x"] = r["ready_s_median"] / base["ready_s_median"]
                row["ready_cpu_median_x"] = r["ready_cpu_s_median"] / base["ready_cpu_s_median"]
            row["added_x"] = r["added_mb"] / base["added_mb"]
            row["run_x"] = r["run_ms_median"] / base["run_ms_median"]
            if "run_ms_min_sum" in r and "run_ms_min_sum" in base:
                row["run_min_x"] = r["run_ms_min_sum"] / base["run_ms_min_sum"]
            row.update(agreement(base["outputs"], r["outputs"], metric))
        if key.startswith("q8") and how == "fold" and "outputs" in folded:
            row["maxabs_vs_folded"] = maxabs(folded["outputs"], r["outputs"])
        rows.append(row)


def _big(args, tmp, provider, rows, config):
    print(f"[big] generating ~{args.big_gb} GB ...", file=sys.stderr, flush=True)
    path, weight_bytes = generate_big_model(tmp, args.big_gb)
    print("[big] packing ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    packed = tmp / "big.onnxz"
    subprocess.run([sys.executable, "-c", "import sys, passes; passes.pack(sys.argv[1], sys.argv[2], force=True)",
                    str(path), str(packed)], check=True, cwd=str(ROOT))
    pack_s = time.perf_counter() - t
    base = {"threads": args.threads, "repeat": 2, "n_feeds": 4, "provider": provider, "feeds": None, "big_width": 4096}
    results = {}
    # the plain model also without onnxruntime's prepacking: fold mode turns it off for a model this
    # big (runtime.PREPACK_AUTO_LIMIT), and onnxruntime's MatMul then sums in another order, so
    # its outputs are compared with the plain session's that prepacks as it does (bit-equal) too
    unpacked = {"session.disable_prepacking": "1"}
    keys, specs = [], []
    for key, p, how, extra in (("big.onnx", path, "plain", None), ("big.onnx", path, "plain-noprepack", unpacked),
                                ("big.onnxz", packed, "fold", None)):
        keys.append((key, how))
        specs.append(dict(base, path=str(p), how=how.split("-")[0], config=dict(config, **(extra or {})),
                          outputs=str(tmp / f"big.{how}.npz")))
    # rounds interleaved, as for the corpus models: on these hosts the cost of fresh memory swings
    # several-fold from one process to the next (how much of it the kernel has handed back to the
    # hypervisor), the plain row's CPU 2.2 s in one run and 9.7 s in the next
    print(f"[big] {len(specs)} variants x {args.rounds} rounds, interleaved", file=sys.stderr, flush=True)
    for (key, how), spec, r in zip(keys, specs, best_of_many(specs, args.rounds)):
        if "error" not in r:
            r["outputs"] = _read_outputs(spec["outputs"])
        results[(key, how)] = r
    weights_mb = weight_bytes / 2**20
    plain = results[("big.onnx", "plain")]
    for (key, how), r in results.items():
        row = {"model": f"big{args.big_gb:g}GB", "file": key, "mode": how, "weights_mb": weights_mb,
               "packed_mb": packed.stat().st_size / 2**20, "pack_s": pack_s}
        if "error" in r:
            row["error"] = r["error"]
        else:
            row.update({k: r[k] for k in ("ready_s", "ready_cpu_s", "added_mb", "after_runs_mb", "run_ms",
                                          "run_ms_median", "ready_s_median", "ready_cpu_s_median") if k in r})
            row["added_over_weights"] = r["added_mb"] / weights_mb
            # (onnxruntime maps a plain file's external data and, without prepacking, reads it only
            # at the first run: the peak while the session is made is then tiny, the memory after
            # the runs is the weights)
            row["after_runs_over_weights"] = r["after_runs_mb"] / weights_mb
            if "error" not in plain:
                row["ready_x"] = r["ready_s"] / plain["ready_s"]
                row["ready_cpu_x"] = r["ready_cpu_s"] / plain["ready_cpu_s"]
                if "ready_s_median" in r and "ready_s_median" in plain:
                    row["ready_median_x"] = r["ready_s_median"] / plain["ready_s_median"]
                    row["ready_cpu_median_x"] = r["ready_cpu_s_median"] / plain["ready_cpu_s_median"]
                row["added_x"] = r["added_mb"] / plain["added_mb"]
                row["run_x"] = r["run_ms_median"] / plain["run_ms_median"]
                row["maxabs_vs_plain"] = maxabs(plain["outputs"], r["outputs"])
            same = results[("big.onnx", "plain" if r.get("prepack") in (None, True) else "plain-noprepack")]
            if how == "fold" and "error" not in same:
                row["maxabs_vs_plain_same_prepack"] = maxabs(same["outputs"], r["outputs"])
        rows.append(row)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _print_paired(rows):
    """Each passes row against its +ab twin round by round (the rounds are interleaved, so a burst
    of load hits both of a pair alike): the median and quartiles of as-is / +ab ready time and CPU."""
    twins = {(r["model"], r["file"], r["mode"][:-3]): r for r in rows if r.get("ab_env")}
    lines = []
    for r in rows:
        twin = twins.get((r["model"], r["file"], r.get("mode")))
        if r.get("ab_env") or twin is None:
            continue
        parts, counts = [], []
        for key in ("ready_s", "ready_cpu_s"):
            pairs = [a / b for a, b in zip(r.get(key + "_rounds") or (), twin.get(key + "_rounds") or ()) if a and b]
            counts.append(len(pairs))
            if pairs:
                q1, med, q3 = np.percentile(pairs, [25, 50, 75])
                parts.append(f"{key[:-2].replace('_', ' ')} {med:.2f} ({q1:.2f}-{q3:.2f})")
        if parts:
            lines.append(f"  {r['model']:14s} {r['file']:15s} {r['mode']:12s} " + ", ".join(parts) + f"  [{counts[0]} rounds]")
    if lines:
        print("as-is / +ab, paired by round: median (quartiles)")
        print("\n".join(lines))


def _print_table(rows):
    head = f"{'model':<13} {'file':<15} {'mode':<12} {'ready s':>8} {'x':>5} {'med x':>5} {'cpu s':>6} {'x':>5} {'med x':>5} {'added MB':>9} {'x':>5} {'after MB':>9} " \
           f"{'run ms':>8} {'x':>5} {'min x':>5} {'cosine':>8} {'top1':>6} {'vs fold':>8} {'sleeps':>6} {'main':>5} {'ort ms':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<13} {r['file']:<15} {r['mode']:<12} ERROR {r['error']}")
            continue
        extra = r.get("maxabs_vs_folded", r.get("maxabs_vs_plain"))
        print(f"{r['model']:<13} {r['file']:<15} {r['mode']:<12} {r['ready_s']:8.3f} {_fmt(r.get('ready_x'), '5.2f')} "
              f"{_fmt(r.get('ready_median_x'), '5.2f')} {r['ready_cpu_s']:6.2f} {_fmt(r.get('ready_cpu_x'), '5.2f')} "
              f"{_fmt(r.get('ready_cpu_median_x'), '5.2f')} {r['added_mb']:9.1f} {_fmt(r.get('added_x'), '5.2f')} {r['after_runs_mb']:9.1f} {r['run_ms_median']:8.2f} "
              f"{_fmt(r.get('run_x'), '5.2f')} {_fmt(r.get('run_min_x'), '5.2f')} {_fmt(r.get('cosine'), '8.5f')} {_fmt(r.get('top1'), '6.3f')} "
              f"{_fmt(extra, '8.1e')} {_fmt(r.get('ready_sleeps_median'), '6.0f')} "
              f"{_fmt(r.get('ready_main_sleeps_median'), '5.0f')} "
              f"{_fmt(None if r.get('ready_native_cpu_s_median') is None else 1000 * r['ready_native_cpu_s_median'], '6.1f')}")
    for r in rows:
        if r.get("imported_in_clock"):  # (their import, compiled from source without a .pyc, is in the ready time)
            print(f"{r['model']} {r['file']} {r['mode']}: modules imported while the session was made: "
                  f"{', '.join(r['imported_in_clock'])}")
    for r in rows:
        if "added_over_weights" in r:
            print(f"{r['model']} {r['file']} {r['mode']}: weights {r['weights_mb']:.0f} MB, packed {r['packed_mb']:.0f} MB "
                  f"in {r['pack_s']:.1f} s; added peak = {r['added_over_weights']:.2f} x weights, after the runs "
                  f"{_fmt(r.get('after_runs_over_weights'), '.2f')} x; max |diff| vs plain "
                  f"{_fmt(r.get('maxabs_vs_plain'), '.1e')}, vs the plain session prepacking as this one does "
                  f"{_fmt(r.get('maxabs_vs_plain_same_prepack'), '.1e')}")


if __name__ == "__main__":
    sys.exit(main())
