"""Judge what the `.onnxz` readers do with one (possibly damaged) file.

Every public reader is run on the file: `load`, `open_packed` (+ `keys`, `metadata`, `get_tensor`
of every key), `unpack`, `verify` (with and without `against`) and `InferenceSession` in modes
fold and int8 (its outputs compared with those of the intact file). Each one must either

- raise a documented error of the pack stage (CorruptFileError, including NewerFormatError, or
  LimitExceededError): verdict "refused"; or
- return exactly what the original files hold (the model byte for byte, every tensor with the
  same dtype, shape and bytes): verdict "identical".

Anything else is a finding: "crash" (any other exception escaped, including MemoryError and
RecursionError), "wrong" (a result that differs from the original), "partial" (unpack failed but
left a file under a final name that is not the original file's exact bytes), "escape" (unpack
wrote outside its destination folder).

Files that were *crafted* (their checksums recomputed after the change, as an attacker would)
can legitimately decode to something else than the original for the APIs that do not hash the
whole restored file (`open_packed(...).get_tensor`): there, "different but well-formed" is counted
as "accepted", never as a pass of the integrity promise; crashes count the same in both modes.
"""
from __future__ import annotations

import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from passes.errors import CorruptFileError, LimitExceededError, SurgeonError

# What the pack stage documents for damaged, foreign or oversized files. Any other SurgeonError
# (e.g. InvalidModelError from a crafted tensor entry) is still a documented, clean refusal; its
# class is recorded in Verdict.errors so that the reports show which one each API raised.
PACK_ERRORS = (CorruptFileError, LimitExceededError)
DOCUMENTED = (SurgeonError,)
SEVERITY = {"identical": 0, "refused": 0, "accepted": 1, "partial": 3, "wrong": 3, "crash": 4, "hang": 4, "escape": 4}


@dataclass
class Verdict:
    verdict: str = "identical"
    findings: List[str] = field(default_factory=list)   # one line per API that misbehaved
    errors: Dict[str, str] = field(default_factory=dict)  # api -> documented error class name

    def note(self, verdict: str, api: str, detail: str = "") -> None:
        if SEVERITY[verdict] >= 1:
            self.findings.append(f"{api}: {verdict}: {detail}")
        if SEVERITY[verdict] > SEVERITY[self.verdict] or (verdict == "refused" and self.verdict == "identical"):
            self.verdict = verdict

    @property
    def bad(self) -> bool:
        return SEVERITY[self.verdict] >= 3


def _crash_detail(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} {tb[-1].name}" if tb else "?"
    return f"{type(exc).__name__}: {str(exc)[:200]} (at {where})"


def _same_array(a, b) -> bool:
    return (isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and a.tobytes() == b.tobytes())


class Oracle:
    """Expected results for one sample, and the judge of a mutant of it."""

    def __init__(self, sample, workdir: Path):
        from passes import load

        self.sample = sample
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.original_dir = self.workdir / "original"
        self.original_dir.mkdir(exist_ok=True)
        for name, data in sample.files.items():
            (self.original_dir / (name or "model.onnx")).write_bytes(data)
        ref = self.workdir / "reference.onnxz"
        ref.write_bytes(sample.packed)
        self.expected_model = load(ref, threads=1).SerializeToString()
        self.expected_files = {(n or "model.onnx"): d for n, d in sample.files.items()}
        self._session_reference = {}

    SESSION_MODES = ("fold", "int8")

    def session_reference(self, mode):
        """Outputs of InferenceSession(mode) on the intact file, or None when it cannot run the
        sample at all (then the mutants are not judged by it)."""
        if mode not in self._session_reference:
            from passes import InferenceSession

            try:
                sess = InferenceSession(self.workdir / "reference.onnxz", mode=mode, threads=1)
                self._session_reference[mode] = [np.asarray(o) for o in sess.run(None, self.sample.feeds)]
            except Exception:  # noqa: BLE001 - e.g. a dtype onnxruntime has no kernel for
                self._session_reference[mode] = None
        return self._session_reference[mode]

    def judge(self, data: bytes, *, crafted: bool = False, apis=("load", "open_packed", "unpack", "verify", "session"),
              threads: int = 1, max_bytes: Optional[int] = None) -> Verdict:
        from passes import load, unpack, verify

        path = self.workdir / "mutant.onnxz"
        path.write_bytes(data)
        v = Verdict()
        limits = {} if max_bytes is None else {"max_bytes": max_bytes}

        def attempt(api, fn):
            try:
                return True, fn()
            except DOCUMENTED as exc:
                v.note("refused", api)
                v.errors[api] = type(exc).__name__
            except BaseException as exc:  # noqa: BLE001 - every other escape is the finding
                if isinstance(exc, KeyboardInterrupt):
                    raise
                v.note("crash", api, _crash_detail(exc))
            return False, None

        if "load" in apis:
            ok, model = attempt("load", lambda: load(path, threads=threads, **limits))
            if ok and model.SerializeToString() != self.expected_model:
                v.note("wrong", "load", "model differs from the original")

        if "open_packed" in apis:
            self._judge_open_packed(path, v, attempt, crafted, threads, limits)

        if "unpack" in apis:
            out = self.workdir / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            known = {p.name for p in self.workdir.iterdir()}
            ok, _ = attempt("unpack", lambda: unpack(path, out / "model.onnx", threads=threads, **limits))
            strays = {p.name for p in self.workdir.iterdir()} - known
            if strays:
                v.note("escape", "unpack", f"wrote {sorted(strays)} outside its destination folder")
            restored = {p.relative_to(out).as_posix(): p for p in out.rglob("*") if p.is_file()}
            for rel, p in sorted(restored.items()):
                want = self.expected_files.get(rel)
                if want is not None and p.read_bytes() == want:
                    continue
                if crafted and want is None:
                    # a crafted index may rename an external data file: the bytes are still
                    # checked against the stored sha256, the name is the file's own claim
                    v.note("accepted", "unpack", f"restored {rel!r} under a name the crafted index gives")
                else:
                    v.note("wrong" if ok else "partial", "unpack", f"{rel} is not the original file")
            if ok and not crafted and set(restored) != set(self.expected_files):
                v.note("wrong", "unpack", "restored files differ from the original set")

        if "session" in apis:
            from passes import InferenceSession

            for mode in self.SESSION_MODES:
                want = self.session_reference(mode)
                if want is None:
                    continue
                api = f"InferenceSession({mode})"
                ok, got = attempt(api, lambda m=mode: InferenceSession(path, mode=m, threads=threads).run(None, self.sample.feeds))
                if ok and (len(got) != len(want) or not all(_same_array(np.asarray(g), w) for g, w in zip(got, want))):
                    v.note("accepted" if crafted else "wrong", api, "outputs differ from the intact file's")

        if "verify" in apis:
            ok, res = attempt("verify", lambda: verify(path, threads=threads, **limits))
            if ok and not res.ok:
                v.note("crash", "verify", "returned ok=False without `against`")
            ok, res = attempt("verify --against", lambda: verify(path, against=self.original_dir / "model.onnx", threads=threads, **limits))
            if ok and not res.ok:
                # a crafted index that renames a data file restores correct bytes under another
                # name: saying "differs from the original" is the right answer there
                v.note("accepted" if crafted else "wrong", "verify --against", "restored files differ from the original")
        return v

    def _judge_open_packed(self, path, v, attempt, crafted, threads, limits):
        from passes import open_packed

        ok, pm = attempt("open_packed", lambda: open_packed(path, threads=threads, **limits))
        if not ok:
            return
        try:
            ok, keys = attempt("keys", pm.keys)
            attempt("metadata", pm.metadata)
            if not ok:
                return
            expected = self.sample.tensors
            if list(keys) != list(expected) and not crafted:
                v.note("wrong", "keys", f"{list(keys)[:5]}... differ from the original keys")
            for key in keys:
                ok, arr = attempt(f"get_tensor({key!r})", lambda k=key: pm.get_tensor(k))
                if not ok:
                    continue
                want = expected.get(key)
                if want is not None and _same_array(arr, want):
                    continue
                if crafted:
                    if not isinstance(arr, np.ndarray):
                        v.note("crash", "get_tensor", f"returned {type(arr).__name__}")
                    else:
                        v.note("accepted", f"get_tensor({key!r})", "crafted file decodes to other values")
                else:
                    v.note("wrong", f"get_tensor({key!r})", "tensor differs from the original")
        finally:
            attempt("close", pm.close)
