"""The long fuzz run of the `.onnxz` readers: many mutants, worker processes, a hang watchdog.

    python -m fuzz.run --seconds 900 --workers 2               # random blind + crafted mutants
    python -m fuzz.run --sweeps --masks ff,01,80 --workers 2   # every byte flip / truncation of every sample
    python -m fuzz.run --replay "('crafted', 'family_i8', 123)"  # one mutant, verdict printed

Every mutant goes through every reader (fuzz/oracle.py). A worker answers within the hang limit
(default 2 s) or is killed, the mutant counted as a hang and saved; each worker runs under an
address-space limit (default 4 GiB) so that an allocation driven by a declared size shows up as a
MemoryError (a crash) instead of swapping the machine. Counts go to stdout and to
bench/out/fuzz/summary.json; every finding's bytes and spec to bench/out/fuzz/findings/.
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "fuzz"


def _fast_tmp() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _worker(conn, samples, mem_limit):
    from .campaign import make_mutant
    from .oracle import Oracle

    if mem_limit:
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    base = Path(tempfile.mkdtemp(prefix="onnxz-fuzz-", dir=_fast_tmp()))
    try:
        oracles = {s.name: Oracle(s, base / s.name) for s in samples}
        packed = {s.name: s.packed for s in samples}
        conn.send("ready")
        while True:
            spec = conn.recv()
            if spec is None:
                break
            t0 = time.perf_counter()
            desc, data, crafted = make_mutant(spec, packed)
            v = oracles[spec[1]].judge(data, crafted=crafted)
            conn.send((spec, desc, v.verdict, v.findings, v.errors, time.perf_counter() - t0))
    finally:  # (a worker killed by the watchdog leaves its folder: the parent removes those)
        shutil.rmtree(base, ignore_errors=True)


def _retry_within(spec, samples, limit_s, mem_limit) -> bool:
    """True when `spec` is judged within `limit_s` by a fresh worker with nothing else to do."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, [s for s in samples if s.name == spec[1]], mem_limit), daemon=True)
    proc.start()
    try:
        if not parent.poll(60) or parent.recv() != "ready":
            return False
        parent.send(spec)
        return parent.poll(limit_s) and parent.recv() is not None
    finally:
        proc.kill()
        proc.join()


class Pool:
    """Worker processes fed one spec at a time; a worker silent past the limit is killed."""

    def __init__(self, samples, workers, hang_s, mem_limit):
        self.samples, self.hang_s, self.mem_limit = samples, hang_s, mem_limit
        self.ctx = mp.get_context("fork")
        self.slots = [self._start() for _ in range(workers)]

    def _start(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, self.samples, self.mem_limit), daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        return {"proc": proc, "conn": parent, "spec": None, "since": 0.0}

    def run(self, specs, on_result, on_hang, deadline=None):
        specs = iter(specs)
        exhausted = False
        while True:
            for i, slot in enumerate(self.slots):
                if slot["spec"] is None and not exhausted and (deadline is None or time.monotonic() < deadline):
                    spec = next(specs, None)
                    if spec is None:
                        exhausted = True
                    else:
                        slot["conn"].send(spec)
                        slot["spec"], slot["since"] = spec, time.monotonic()
            busy = [s for s in self.slots if s["spec"] is not None]
            if not busy:
                return
            ready = mp.connection.wait([s["conn"] for s in busy], timeout=0.05)
            for slot in busy:
                if slot["conn"] in ready:
                    try:
                        msg = slot["conn"].recv()
                    except EOFError:  # the worker died (a crash in compiled code, or killed by the OS)
                        slot["proc"].join(timeout=5)
                        on_hang(slot["spec"], f"worker died (exit code {slot['proc'].exitcode})")
                        self._restart(slot)
                        continue
                    slot["spec"] = None
                    on_result(msg)
                elif time.monotonic() - slot["since"] > self.hang_s:
                    on_hang(slot["spec"], f"no answer within {self.hang_s} s")
                    self._restart(slot)

    def _restart(self, slot):
        slot["proc"].kill()
        slot["proc"].join()
        slot.update(self._start())

    def close(self):
        for slot in self.slots:
            try:
                slot["conn"].send(None)
            except OSError:
                pass
            slot["proc"].join(timeout=5)
            if slot["proc"].is_alive():
                slot["proc"].kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="time budget of the random campaign")
    ap.add_argument("--count", type=int, default=None, help="stop after this many random mutants")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--crafted-share", type=float, default=0.5)
    ap.add_argument("--sweeps", action="store_true", help="every byte flip and truncation of every sample instead")
    ap.add_argument("--masks", default="ff", help="XOR masks of the sweeps, hex, comma separated")
    ap.add_argument("--hang-seconds", type=float, default=2.0)
    ap.add_argument("--mem-limit-gib", type=float, default=4.0)
    ap.add_argument("--replay", help="one spec (a Python tuple literal): print its verdict")
    ap.add_argument("--samples", default="all", help="comma separated: small (the generated samples), real "
                    "(models/*.onnx and an int8 one; larger, slower), all, or one builder of "
                    "fuzz.samples.SAMPLE_BUILDERS (e.g. shared: the ans_shared samples of format 1.2)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    from .campaign import random_specs, sweep_specs
    from .samples import SAMPLE_BUILDERS, build_all, check_families, real_models

    t_build = time.perf_counter()
    chosen = set(args.samples.split(","))
    samples = []
    if chosen & {"all", "small"}:
        samples += build_all()
    if chosen & {"all", "real"}:
        samples += real_models()
    for name in sorted(chosen & (set(SAMPLE_BUILDERS) - {"real"})):  # one builder's samples only
        samples += SAMPLE_BUILDERS[name]()
    packed = {s.name: s.packed for s in samples}
    names = sorted(packed)
    print(f"{len(samples)} samples built in {time.perf_counter() - t_build:.1f} s; codec families: "
          f"{sorted(check_families(samples))}", flush=True)

    if args.replay:
        from .campaign import make_mutant
        from .oracle import Oracle

        spec = ast.literal_eval(args.replay)
        desc, data, crafted = make_mutant(spec, packed)
        sample = next(s for s in samples if s.name == spec[1])
        v = Oracle(sample, Path(tempfile.mkdtemp(dir=_fast_tmp()))).judge(data, crafted=crafted)
        print(f"{spec}: {desc}: {v.verdict}")
        for f in v.findings:
            print("  ", f)
        print("   errors:", v.errors)
        return 1 if v.bad else 0

    if args.sweeps:
        masks = [int(m, 16) for m in args.masks.split(",")]
        specs = sweep_specs(packed, names, masks)
        deadline = None
    else:
        specs = random_specs(names, args.seed, args.count or 10**12, args.crafted_share)
        deadline = time.monotonic() + args.seconds

    findings_dir = args.out / "findings"
    findings_dir.mkdir(parents=True, exist_ok=True)
    counts = collections.Counter()
    by_kind = collections.defaultdict(collections.Counter)
    by_sample = collections.Counter()
    error_classes = collections.Counter()
    finding_kinds = collections.Counter()
    slowest = [0.0, None]
    saved = 0

    def save(spec, desc, verdict, lines):
        nonlocal saved
        saved += 1
        if saved > 500:
            return
        stem = findings_dir / f"{verdict}-{saved:04d}"
        _, data, _ = __import__("fuzz.campaign", fromlist=["make_mutant"]).make_mutant(spec, packed)
        stem.with_suffix(".onnxz").write_bytes(data)
        stem.with_suffix(".txt").write_text(f"{spec!r}\n{desc}\n" + "\n".join(lines) + "\n")

    def on_result(msg):
        spec, desc, verdict, lines, errors, elapsed = msg
        counts[verdict] += 1
        by_kind[spec[0]][verdict] += 1
        by_sample[spec[1]] += 1
        for api, cls in errors.items():
            error_classes[f"{api.split('(')[0]}:{cls}"] += 1
        if elapsed > slowest[0]:
            slowest[:] = [elapsed, repr(spec)]
        if verdict in ("crash", "wrong", "partial"):
            for line in lines:
                if "accepted" not in line:
                    finding_kinds[line.split(" (at ")[0][:160]] += 1
            save(spec, desc, verdict, lines)

    def on_hang(spec, why):
        # A worker can miss the limit because the machine is busy: the mutant is run again,
        # alone, and counted as a hang only if it misses the limit again.
        if why.startswith("no answer") and _retry_within(spec, samples, args.hang_seconds, mem):
            counts["slow_under_load"] += 1
            return
        counts["hang"] += 1
        by_kind[spec[0]]["hang"] += 1
        save(spec, "hang", "hang", [why])

    mem = int(args.mem_limit_gib * (1 << 30)) if args.mem_limit_gib else 0
    pool = Pool(samples, args.workers, args.hang_seconds, mem)
    t0 = time.perf_counter()
    last = t0

    def progress(msg):
        nonlocal last
        on_result(msg)
        now = time.perf_counter()
        if now - last > 30:
            last = now
            print(f"  {sum(counts.values())} mutants, {dict(counts)}, {now - t0:.0f} s", flush=True)

    before_dirs = set(Path(_fast_tmp()).glob("onnxz-fuzz-*"))
    try:
        pool.run(specs, progress, on_hang, deadline)
    finally:
        pool.close()
        for stale in set(Path(_fast_tmp()).glob("onnxz-fuzz-*")) - before_dirs:  # workers killed mid-run
            shutil.rmtree(stale, ignore_errors=True)
    wall = time.perf_counter() - t0
    total = sum(counts.values())
    summary = {
        "command": "python -m fuzz.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "mutants": total, "wall_seconds": round(wall, 1), "per_second": round(total / wall, 1) if wall else None,
        "verdicts": dict(counts), "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "by_sample": dict(by_sample), "error_classes": dict(error_classes),
        "findings": dict(finding_kinds.most_common()), "slowest_mutant_seconds": round(slowest[0], 3),
        "slowest_mutant": slowest[1], "hang_limit_seconds": args.hang_seconds,
        "mem_limit_gib": args.mem_limit_gib, "workers": args.workers,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "summary-sweeps.json" if args.sweeps else "summary.json"
    (args.out / name).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    bad = counts["crash"] + counts["wrong"] + counts["partial"] + counts["hang"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
