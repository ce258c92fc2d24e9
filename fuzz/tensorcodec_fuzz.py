"""Fuzz passes.decode_array (the lossy tensor codec's blob reader; compiled numba loops inside).

Blobs carry a CRC-32 of everything before it, so blind damage is refused at the door; this
harness also *crafts* blobs: bytes changed, then the CRC recomputed, so the parser and the
compiled decoder loops see hostile headers, tables and words. Each mutant must give a documented
error (SurgeonError) or an array of the declared shape; a segfault, a foreign exception or a hang
(default 2 s) is a finding. When the C decoder (passes/_tcodec.c) is built, every mutant is also
decoded by the numba decoder and by the C decoder's AVX-512 lanes alone and scalar lanes alone: a
different verdict or different values are a finding too. Runs in worker processes (a crash in compiled code kills only the
worker; it is counted and the worker restarted).

    python -m fuzz.tensorcodec_fuzz --seconds 300 --workers 2
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import random
import resource
import struct
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "fuzz"


def blobs():
    """A few blobs of encode_array: conv-like 4-D, 2-D, 1-D, with and without dependent quantization."""
    import numpy as np

    from passes import encode_array

    rng = np.random.default_rng(0)
    arrays = {
        "conv": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
        "matrix": (rng.laplace(0, 0.05, (32, 48))).astype(np.float32),
        "vector": rng.standard_normal(300).astype(np.float32),
        "f16": rng.standard_normal((16, 16)).astype(np.float16),
        "chunks": (rng.laplace(0, 0.05, (96, 512))).astype(np.float32),  # 3 chunks: lanes, threads
        "chunks7": (rng.laplace(0, 0.05, (200, 512))).astype(np.float32),  # 6 chunks + a short one:
        # the default C run starts in the vector lanes and hands the last chunks to the scalar lanes
    }
    out = {}
    for name, a in arrays.items():
        for bits in (4, 8):
            out[f"{name}-{bits}"] = (bytes(encode_array(a, bits=bits)), a.shape)
    return out


def craft(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    """Change 1-8 bytes (or truncate / extend the body), then recompute the trailing CRC."""
    body = bytearray(blob[:-4])
    kind = rng.choice(["bytes", "bytes", "header", "truncate", "extend"])
    if kind == "bytes" or kind == "header":
        top = 60 if kind == "header" else len(body)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(top, len(body)))
            body[i] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        desc = f"{kind} edits"
    elif kind == "truncate":
        body = body[:rng.randrange(len(body))]
        desc = f"truncated to {len(body)}"
    else:
        body += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        desc = "extended"
    return desc, bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def _worker(conn, mem_limit):
    import numpy as np

    import passes.tensorcodec as tc
    from passes import SurgeonError, decode_array

    resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    base = blobs()
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        name, seed = task
        blob, shape = base[name]
        desc, data = craft(random.Random(f"{name}/{seed}"), blob)
        t0 = time.perf_counter()
        verdict, arr = _decode_once(decode_array, data, SurgeonError, np, threads=2)
        if tc._FAST is not None:  # the C decoder ran: the numba one must agree, value for value,
            # and so must the C decoder's other lanes (AVX-512 lanes always / scalar lanes only)
            others = []
            simd = tc.SIMD
            for name, fast, lanes in (("C vector lanes", tc._FAST, 1), ("C scalar lanes", tc._FAST, 0),
                                      ("numba", None, simd)):
                tc._FAST, saved, tc.SIMD = fast, tc._FAST, lanes
                try:
                    others.append((name,) + _decode_once(decode_array, data, SurgeonError, np,
                                                         threads=1 if fast is None else 2))
                finally:
                    tc._FAST, tc.SIMD = saved, simd
            for name, verdict_o, arr_o in others:
                if verdict.startswith("crash"):
                    break
                if verdict == "decoded" and verdict_o == "decoded":
                    if arr.shape != arr_o.shape or arr.dtype != arr_o.dtype or arr.tobytes() != arr_o.tobytes():
                        verdict = f"crash: the C decoder and the {name} decoder returned different values"
                elif verdict != verdict_o:
                    verdict = f"crash: C decoder {verdict}, {name} decoder {verdict_o}"
        conn.send((task, desc, verdict, time.perf_counter() - t0))


def _decode_once(decode_array, data, SurgeonError, np, threads):
    """(verdict, array or None); numba runs single-threaded (its thread pool costs ~1 ms a call)."""
    try:
        arr = decode_array(data, threads=threads)
        return ("decoded" if isinstance(arr, np.ndarray) else f"crash: returned {type(arr).__name__}"), arr
    except SurgeonError:
        return "refused", None
    except BaseException as exc:  # noqa: BLE001
        return f"crash: {type(exc).__name__}: {str(exc)[:160]}", None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hang-seconds", type=float, default=2.0)
    ap.add_argument("--mem-limit-gib", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = sorted(blobs())
    ctx = mp.get_context("fork")
    mem = int(args.mem_limit_gib * (1 << 30))

    def start():
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b, mem), daemon=True)
        p.start()
        assert a.recv() == "ready"
        return {"p": p, "c": a, "task": None, "t": 0.0}

    slots = [start() for _ in range(args.workers)]
    rng = random.Random(args.seed)
    counts, findings = collections.Counter(), collections.Counter()
    examples = {}
    deadline = time.monotonic() + args.seconds
    t0 = time.perf_counter()
    while True:
        for s in slots:
            if s["task"] is None and time.monotonic() < deadline:
                s["task"] = (rng.choice(names), rng.randrange(1 << 30))
                s["c"].send(s["task"])
                s["t"] = time.monotonic()
        busy = [s for s in slots if s["task"] is not None]
        if not busy:
            break
        ready = mp.connection.wait([s["c"] for s in busy], timeout=0.05)
        for i, s in enumerate(slots):
            if s["task"] is None:
                continue
            if s["c"] in ready:
                try:
                    task, desc, verdict, dt = s["c"].recv()
                except EOFError:
                    s["p"].join()
                    verdict, task = f"crash: worker died (exit {s['p'].exitcode})", s["task"]
                    slots[i] = start()
                else:
                    s["task"] = None
                kind = verdict.split(":")[0]
                counts[kind] += 1
                if kind == "crash":
                    findings[verdict[:120]] += 1
                    examples.setdefault(verdict[:120], repr(task))
            elif time.monotonic() - s["t"] > args.hang_seconds:
                counts["hang"] += 1
                examples.setdefault("hang", repr(s["task"]))
                s["p"].kill()
                s["p"].join()
                slots[i] = start()
    for s in slots:
        s["c"].send(None)
    summary = {"command": "python -m fuzz.tensorcodec_fuzz " + " ".join(argv if argv is not None else sys.argv[1:]),
               "mutants": sum(counts.values()), "wall_seconds": round(time.perf_counter() - t0, 1),
               "verdicts": dict(counts), "findings": dict(findings), "examples": examples}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary-tensorcodec.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 1 if counts["crash"] or counts["hang"] else 0


if __name__ == "__main__":
    sys.exit(main())
