"""surgeon-compress: compress ONNX model weights (int8 + DequantizeLinear), gate on fidelity, pack losslessly.

This module only parses arguments and prints; every decision lives in the `passes` library.

Exit codes:
  0    success
  1    error: bad input file or model, unwritable output, unsupported option for this model, ...
  2    usage error (unknown option, malformed --require expression, ...)
  3    fidelity gate failed (--require not met); compress then writes no output file
  4    a packed file is damaged, truncated, foreign or differs from --against (verify, unpack, info),
       or --verify found the written output unreadable (the output is then removed)
  70   internal error (a bug: please report it; SURGEON_DEBUG=1 shows the traceback)
  130  interrupted (Ctrl-C); no partial output is left behind
"""
from __future__ import annotations

import sys


def _interrupted_quietly(kind, value, tb):
    """sys.excepthook while the command starts: a Ctrl-C that reaches the top level before main() catches
    it (while this module's own definitions load, after the imports below) says the one line and exits
    130; anything else is reported as Python would."""
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("surgeon-compress: interrupted\n")
        sys.stderr.flush()
        import os as _os

        _os._exit(130)
    sys.__excepthook__(kind, value, tb)


# only for the command itself (the console script, python -m / the file), never for a program importing this module
# (Windows launchers: surgeon-compress.exe, surgeon-compress-script.py)
if sys.excepthook is sys.__excepthook__ and (__name__ == "__main__" or sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1]
                                             in ("surgeon-compress", "surgeon-compress.exe", "surgeon-compress-script.py")):
    sys.excepthook = _interrupted_quietly

try:  # Ctrl-C while the console script imports this module: the one line and 130, not a traceback
    import argparse
    import dataclasses
    import json
    import math
    import os
    from pathlib import Path
    from typing import Any, Sequence
except KeyboardInterrupt:
    sys.stderr.write("surgeon-compress: interrupted\n")
    raise SystemExit(130) from None

PROG = "surgeon-compress"
MIN_BITS, MAX_BITS = 2, 8  # the widths passes.quantize_weights writes
DEFAULT_BITS = 8

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_GATE_FAILED = 3
EXIT_CORRUPT = 4
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------------------------
# formatting


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _jsonable(value: Any) -> Any:
    """JSON-ready copy: non-finite floats as "inf"/"-inf"/"nan", tuples as lists, paths as strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = value.to_dict() if hasattr(value, "to_dict") else dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        value = value.item()  # numpy scalar
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)


# whether this run has printed its JSON report: a failure after it (the gate, exit 3) adds none
_json_printed = False


def print_json(obj: dict) -> None:
    global _json_printed
    print(json.dumps(_jsonable(obj), indent=2, sort_keys=False, allow_nan=False))
    _json_printed = True


def _print_json_failure(command: str | None, message: str, code: int) -> None:
    """--json and a failure before any report: one JSON object on stdout all the same, so that a CI
    step parsing it (`--json > report.json`) reads why instead of an empty file."""
    if not _json_printed:
        sys.stdout.flush()
        print_json({"command": command, "error": message, "exit_code": code})


def printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped (\\t, \\n, \\x1b, \\u200b): tensor
    names come from the model file, and a hostile one could move the cursor, clear the screen or
    retitle the terminal (ESC sequences), or break the table's lines (newline, tab)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> None:
    """Plain aligned columns; `right` lists the indexes of right-aligned (numeric) columns."""
    cells = [[printable(str(c)) for c in headers]] + [[printable(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, row in enumerate(cells):
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  " + line.rstrip())
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _snr(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "exact" if value > 0 else "-inf"
    return f"{value:.1f}"


def file_size(path: str | os.PathLike) -> int:
    """Bytes of a model on disk, its external data files included."""
    from passes._fileio import size_on_disk

    return size_on_disk(path)


def _progress(label: str):
    from passes.progress import progress_bar

    return progress_bar(label)


# --------------------------------------------------------------------------------------------
# shared steps


def _input_files(src: str) -> list[Path]:
    """The input model file and the external data files it reads (a .onnxz is one file)."""
    from passes._fileio import looks_packed, model_files

    if str(src).endswith(".onnxz") or looks_packed(src):
        return [Path(src)]
    return model_files(src)


def _check_distinct(src: str, dst: str, dst_data_files: Sequence[str] = (), feeds: str | None = None) -> None:
    """Refuse an output that would replace a file the input is read from: the model file itself or,
    with --force, one of its external data files (the input model then read the new bytes), or
    the --feeds file. `dst_data_files`: names of the data files written beside `dst` (unpack
    restores them)."""
    from passes import InvalidArgumentError
    from passes._fileio import same_file

    inputs = [(path, "the input file" if k == 0 else f"an external data file of the input {src}")
              for k, path in enumerate(_input_files(src))]
    if feeds:
        inputs.append((Path(feeds), "the --feeds file"))
    folder = Path(dst).parent
    for out in [Path(dst)] + [folder / name for name in dst_data_files]:
        for used, what in inputs:
            if not same_file(used, out):
                continue
            shown = dst if out == Path(dst) else f"{dst} writes {out}, which"
            raise InvalidArgumentError(f"output {shown} is {what}; the input is never modified: choose another -o")


def _check_output(path: str, force: bool) -> None:
    """Fail before the long work, not after: OUT's folder writable, OUT absent or --force, and an
    existing OUT a regular file (check_writable refuses device nodes, pipes and sockets)."""
    from passes._fileio import check_writable

    check_writable(path, force)


def _wants_pack(output: str, pack_flag: bool) -> bool:
    return pack_flag or str(output).endswith(".onnxz")


def _write_model(model, output: str, force: bool, pack: bool, threads=None):
    """Save (or pack) `model` atomically; returns the pack stage's statistics (None when saved as .onnx)."""
    import passes

    if pack:
        with _progress("pack") as bar:
            return passes.pack(model, output, threads=threads, force=force, progress=bar)
    passes.save_model(model, output, force=force)
    return None


def _pack_fields(stats) -> dict:
    """The --json fields of a pack written along the way (none when the output is an .onnx)."""
    return {"pack": _jsonable(stats)} if stats is not None else {}


def _print_pack_note(stats) -> None:
    """Why a pack came out larger than its input (a tiny model: the container costs more than coding
    saves), so that a size above 100% is not taken for a fault."""
    note = getattr(stats, "note", None)
    if note:
        print(f"  note       {printable(note)}")


def _verification_failed(written: Sequence[Path], what: str):
    """Remove what a --verify found unreadable (a file that fails its re-read must not be mistaken
    for a good one by the next step of a script) and return the error to raise (exit 4)."""
    from passes import CorruptFileError

    for path in written:
        try:
            Path(path).unlink()
        except OSError:
            pass  # gone already, or not removable: the message below still says not to trust it
    names = ", ".join(str(p) for p in written)
    return CorruptFileError(f"--verify: re-reading {names} failed: {what}; removed")


def _failed_checks(checks) -> str:
    """The checks of a passes.verify result that failed, as 'check: detail; ...' ('' when none)."""
    return "; ".join(f"{c.get('check')}: {c.get('detail')}" for c in checks if not c.get("ok"))


def _verify_packed(packed: str, against: str | None, threads=None) -> None:
    """Re-read a written .onnxz: every checksum and the sha256 of each restored file; with
    `against`, also byte for byte against that original."""
    import passes
    from passes import CorruptFileError

    try:
        result = passes.verify(packed, against, threads=threads)
    except CorruptFileError as exc:
        raise _verification_failed([Path(packed)], str(exc)) from None
    if not result.ok:
        raise _verification_failed([Path(packed)], _failed_checks(result.checks) or "differs from its source")


def _verify_unpacked(src: str, restored: Path, threads=None) -> None:
    """Re-read the restored .onnx and its data files: their bytes must be those the pack records
    (decoded again and compared, which also checks each file's recorded sha256)."""
    import passes
    from passes import CorruptFileError

    try:
        result = passes.verify(src, restored, threads=threads)
        problem = _failed_checks(result.checks)
    except CorruptFileError as exc:
        result, problem = None, str(exc)
    if result is not None and result.ok:
        return
    with passes.open_packed(src) as packed:  # the data files unpack wrote beside the model
        names = [f["name"] for f in packed.metadata()["files"][1:]]
    raise _verification_failed([restored] + [restored.parent / n for n in names], problem or "differs from the pack")


def _verify_saved(path: str) -> None:
    """Re-read a written .onnx (external data included) and run onnx's checker on it by path
    (by path: models above 2 GB are checked too)."""
    import onnx

    from passes import SurgeonError
    from passes._fileio import load_model

    try:
        load_model(path)
        onnx.checker.check_model(str(path), full_check=True)
    except (SurgeonError, onnx.checker.ValidationError) as exc:
        raise _verification_failed([Path(path)], " ".join(str(exc).split())[:300]) from None


def _check_restored_size(path: str, max_bytes: int | None) -> None:
    """--max-bytes: refuse a .onnxz declaring more restored bytes than the cap before anything is
    decoded (the pack reader checks the index on opening); a plain .onnx is not capped."""
    import passes
    from passes._fileio import looks_packed

    if max_bytes is None or not looks_packed(path):
        return
    with passes.open_packed(path, max_bytes=max_bytes):
        pass


def _metric_args(items: Sequence[tuple[str, int]] | None) -> dict | None:
    """--metric-arg pairs (checked by `_metric_arg` as the arguments are read) as the library's dict."""
    return dict(items) if items else None


def _evaluate(original, candidate, args, feeds=None) -> Any:
    """Run both models on `feeds` (None: synthesised) with the metric options of `args`."""
    import passes.fidelity as fidelity

    with _progress("evaluate") as bar:
        return fidelity.evaluate(
            original, candidate, feeds=feeds, metric=args.metric, metric_args=_metric_args(args.metric_arg),
            providers=args.provider, run_as=args.run_as, progress=bar,
        )


def _oldest_runnable_opset() -> int:
    """legacy_opset.OLDEST_RUNNABLE_OPSET: _measurable may raise a model of an older opset (all of it)."""
    if __package__:
        from .legacy_opset import OLDEST_RUNNABLE_OPSET
    else:
        from legacy_opset import OLDEST_RUNNABLE_OPSET
    return OLDEST_RUNNABLE_OPSET


def _measurable(model, feeds, what: str) -> tuple[Any, list[str]]:
    """`model`, or where onnxruntime has no kernels for its old opset, the model raised to an opset
    it runs, checked against onnx's reference evaluator of `model` (tools/legacy_opset.py), with the
    note that says so."""
    if __package__:  # tools.surgeon_compress in the repository, surgeon_compress_cli.surgeon_compress installed
        from .legacy_opset import measurable
    else:  # run as a file (python tools/surgeon_compress.py): its folder is on sys.path
        from legacy_opset import measurable

    raised, note = measurable(model, feeds, what)
    return raised, [note] if note else []


def _random_notes(model) -> list[str]:
    """The note that `model` draws random values (Dropout in training mode, RandomNormal, ...), if it does."""
    from passes.inspect import random_nodes_note

    note = random_nodes_note(model)
    return [note] if note else []


def _gate_checks(result, requirements) -> tuple[list[dict], bool]:
    checks = [{"requirement": str(r), "value": r.value(result), "passed": r.check(result)} for r in requirements]
    return checks, all(c["passed"] for c in checks)


def _shown(check: dict) -> str:
    """A gate check's measured value with the digits that show it meets or misses its requirement
    (Requirement.shown: 6 significant digits, more where those would round a miss onto the threshold)."""
    from passes.fidelity import parse_requirement

    return parse_requirement(check["requirement"]).shown(check["value"])


def _raise_if_gate_failed(checks, passed: bool, suffix: str = "") -> None:
    from passes import FidelityError

    if not passed:
        failed = "; ".join(f"{c['requirement']} (got {_shown(c)})" for c in checks if not c["passed"])
        raise FidelityError(f"fidelity gate failed: {failed}{suffix}")


def _print_fidelity(result, checks) -> None:
    print(f"  fidelity   {result.summary()}")
    for note in result.notes:
        print(f"  note       {printable(note)}")
    for c in checks:
        verdict = "ok" if c["passed"] else "FAILED"
        print(f"  gate       {c['requirement']}: {_shown(c)} {verdict}")


# --------------------------------------------------------------------------------------------
# commands


def _refuse_options_the_search_ignores(args) -> None:
    """--target chooses each weight's width, scheme and rounding itself: the options of the plain
    mode were silently ignored with it (--exclude W quantized W all the same). --min-elements is
    the one the search takes."""
    from passes import InvalidArgumentError

    if not args.target:
        return
    given = [flag for flag, value in (("--bits", args.bits), ("--granularity", args.granularity),
                                      ("--block-size", args.block_size), ("--include", args.include),
                                      ("--exclude", args.exclude), ("--rd-max-snr-loss", args.rd_max_snr_loss))
             if value is not None]
    given += ["--asymmetric"] * bool(args.asymmetric) + ["--rounding rdo"] * (args.rounding != "nearest")
    if given:
        raise InvalidArgumentError(f"--target chooses each weight's width and rounding itself: {', '.join(given)} "
                                   "cannot be used with it (--min-elements can)")


def _check_option_combinations(args) -> None:
    """Options that only make sense together, refused before the model is read."""
    from passes import InvalidArgumentError

    if args.rd_max_snr_loss is not None and args.rounding != "rdo":
        raise InvalidArgumentError("--rd-max-snr-loss needs --rounding rdo")
    _refuse_options_the_search_ignores(args)
    if args.block_size is not None and args.granularity not in (None, "block"):
        raise InvalidArgumentError(f"--block-size needs --granularity block (got --granularity {args.granularity})")
    if args.pack and not str(args.output).endswith(".onnxz"):
        # a pack under an .onnx name is a file onnxruntime and onnx.load refuse
        raise InvalidArgumentError(f"--pack writes an .onnxz pack: name the output {Path(str(args.output)).stem}.onnxz "
                                   "(the name alone implies --pack)")


def _quantize_options(args) -> dict[str, Any]:
    """The keyword arguments of passes.quantize_weights that the plain (not --target) mode passes."""
    options: dict[str, Any] = {"bits": args.bits or DEFAULT_BITS,
                               "granularity": args.granularity or ("block" if args.block_size else "channel"),
                               "symmetric": not args.asymmetric}
    optional = {"block_size": args.block_size, "min_elements": args.min_elements,
                "include": list(args.include or []) or None, "exclude": list(args.exclude or []) or None,
                "rounding": None if args.rounding == "nearest" else args.rounding,
                "rd_max_snr_loss_db": args.rd_max_snr_loss}
    options.update({key: value for key, value in optional.items() if value is not None})
    return options


def _search(model, feeds, args, report):
    """Auto mode (--target): the smallest model meeting the target on the feeds. The target is also
    the gate (added to args.require), so OUT is written only when it is met.
    Returns (compressed model, the search's record, the options to report)."""
    import passes
    from passes.fidelity import parse_requirements

    chosen = {} if args.min_elements is None else {"min_elements": args.min_elements}
    compressed, record = passes.compress(model, target=args.target, feeds=feeds,
                                         metric_args=_metric_args(args.metric_arg), run_as=args.run_as,
                                         report=report, **chosen)
    required = {str(r) for r in args.require or []}
    args.require = list(args.require or []) + [t for t in parse_requirements(args.target) if str(t) not in required]
    return compressed, record, {"target": args.target}


def cmd_compress(args) -> int:
    import passes
    from passes._fileio import check_readable, looks_packed

    check_readable(args.input)
    _check_distinct(args.input, args.output, feeds=args.feeds)
    _check_output(args.output, args.force)  # fail before the long work, not after
    _check_option_combinations(args)
    _check_restored_size(args.input, args.max_bytes)
    pack = _wants_pack(args.output, args.pack)
    model = passes.load_model(args.input)
    feeds = passes.load_feeds(args.feeds, model, max_bytes=args.max_bytes) if args.feeds else None

    report = passes.Report()
    auto = None
    measuring = bool(args.require or args.feeds or args.metric or args.target)
    measured, notes = _measurable(model, feeds, "the original") if measuring else (model, [])
    raised = bool(notes)  # the original is an old-opset model measured raised: the candidate may be one too
    if args.target:  # the search runs the original: an old-opset one is searched at the opset it was measured at
        compressed, auto, options = _search(measured, feeds, args, report)
        notes = [n + "; the written model is built from that one" for n in notes]
    else:
        options = _quantize_options(args)
        with _progress("quantize") as bar:
            # (dedupe outside `options`: the --json "options" are those the user chose)
            compressed = passes.quantize_weights(model, report=report, progress=bar, dedupe=True, **options)
    if measuring:
        notes += _random_notes(model)

    result = None
    checks: list[dict] = []
    passed = True
    if args.require or args.feeds or args.metric:
        candidate, candidate_notes = _measurable(compressed, feeds, "the candidate") if raised else (compressed, [])
        original = measured
        if measured is model and not looks_packed(args.input):
            # the check runs the original from its file (onnxruntime memory-maps external data) and the
            # loaded copy goes: it and onnxruntime's copy of it were the peak
            original = args.input
        model = measured = None
        result = _evaluate(original, candidate, args, feeds)
        result.notes[:0] = notes + candidate_notes
        checks, passed = _gate_checks(result, args.require or [])

    stats = None
    if passed:
        stats = _write_model(compressed, args.output, args.force, pack)
        if args.verify and pack:
            _verify_packed(args.output, None)  # the source is in memory: the recorded sha256s are the reference
        elif args.verify:
            _verify_saved(args.output)

    in_bytes = file_size(args.input)
    out_bytes = file_size(args.output) if passed else None
    if args.json:
        print_json({
            "command": "compress",
            "input": args.input, "output": args.output, "written": passed, "packed": pack,
            "input_bytes": in_bytes, "output_bytes": out_bytes,
            "ratio": (out_bytes / in_bytes) if passed and in_bytes else None,
            "options": options,
            "report": report.to_dict(),
            **({"auto": {k: v for k, v in auto.items() if k != "trials"}} if auto else {}),
            "fidelity": result.to_dict() if result else None,
            "gate": None if not args.require else {"passed": passed, "checks": checks},
            "verified": bool(args.verify and passed),
            **_pack_fields(stats),
        })
    else:
        _print_compressed(args, pack, in_bytes, out_bytes, stats, report, result, checks)
    _raise_if_gate_failed(checks, passed, f"; {args.output} was not written")
    return EXIT_OK


def _print_compressed(args, pack: bool, in_bytes: int, out_bytes: int | None, stats, report, result, checks) -> None:
    """compress's report for a terminal; out_bytes is None when the gate failed and OUT was not written."""
    written = out_bytes is not None
    # a tensor the plan keeps float is not rewritten, whatever its bytes_after: the auto search
    # reports the size it expects the pack to give each tensor, float ones included (ppocr4_det
    # with --target and no feeds, every weight kept float: '63 tensor(s) rewritten: 4.66 MB ->
    # 3.87 MB' beside a file 99.9% of the input). The sums cover the rewritten tensors only.
    quantized = [t for t in report.tensors if t.bytes_after != t.bytes_before and t.scheme != "float"]
    print(printable(f"{'compressed' if written else 'NOT written'}: {args.input} -> {args.output}{' (packed)' if pack else ''}"))
    if written:
        print(f"  file       {human_bytes(in_bytes)} -> {human_bytes(out_bytes)}  ({100 * out_bytes / max(in_bytes, 1):.1f}% of the input)")
        _print_pack_note(stats)
        if args.verify:
            print(printable(f"  verified   re-read {args.output}: ") + ("every checksum ok" if pack else "loads and passes onnx.checker"))
    before, after = sum(t.bytes_before for t in quantized), sum(t.bytes_after for t in quantized)
    print(f"  weights    {len(quantized)} tensor(s) rewritten: {human_bytes(before)} -> {human_bytes(after)}"
          f"; {len(report.tensors) - len(quantized)} kept as they were")
    for note in report.notes:
        print(f"  note       {printable(note)}")
    if result is not None:
        _print_fidelity(result, checks)
    if args.verbose and report.tensors:
        print()
        print_table(
            ["tensor", "shape", "dtype", "scheme", "before", "after", "SNR dB", "location"],
            [[t.name, _shape(t.shape), t.dtype, t.scheme, t.bytes_before, t.bytes_after, _snr(t.snr_db), t.location]
             for t in report.tensors],
            right=(4, 5, 6),
        )


def _left_quantized_note(folded) -> str | None:
    """What fold leaves quantized, said: integer weights read by onnxruntime's own quantized ops
    (MatMulNBits, QLinearConv, MatMulInteger, ...) are not DequantizeLinear and stay as they are,
    run by onnxruntime as they were (a MatMulNBits model folded to the same bytes said nothing)."""
    from passes.inspect import INTEGER_WEIGHT_OPS, describe_model

    ops: dict[str, list[int]] = {}
    for row in describe_model(folded).rows:
        op = row.scheme.rsplit("/", 1)[-1]
        if op in INTEGER_WEIGHT_OPS:
            counted = ops.setdefault(op, [0, 0])
            counted[0] += 1
            counted[1] += row.bytes
    if not ops:
        return None
    parts = ", ".join(f"{n} read by {op} ({b:,} bytes)" for op, (n, b) in sorted(ops.items()))
    return (f"integer weights left as they are: {parts}; fold turns DequantizeLinear (and this tool's palette and "
            "Cast+Mul forms) into float weights, not onnxruntime's own quantized operators, which run them as before")


def cmd_fold(args) -> int:
    import passes
    from passes._fileio import check_readable

    check_readable(args.input)
    _check_distinct(args.input, args.output)
    _check_output(args.output, args.force)
    _check_restored_size(args.input, args.max_bytes)
    model = passes.load_model(args.input)
    report = passes.Report()
    pack = _wants_pack(args.output, False)
    with _progress("fold") as bar:
        if pack:
            folded = passes.fold_dequantize(model, dtype=args.dtype, report=report, progress=bar)
        else:  # the same file as save_model(fold_dequantize(...)), big weights never copied into protobuf
            from passes.fold import fold_file

            folded = fold_file(model, args.output, dtype=args.dtype, force=args.force, report=report, progress=bar)
    del model  # (the input's payloads: not needed for the rest)
    note = _left_quantized_note(folded)
    if note:
        report.note(note)
    stats = _write_model(folded, args.output, args.force, pack) if pack else None
    in_bytes, out_bytes = file_size(args.input), file_size(args.output)
    if args.json:
        print_json({"command": "fold", "input": args.input, "output": args.output, "dtype": args.dtype,
                    "input_bytes": in_bytes, "output_bytes": out_bytes, "report": report.to_dict(), **_pack_fields(stats)})
    else:
        print(printable(f"folded: {args.input} -> {args.output}"))
        print(f"  file       {human_bytes(in_bytes)} -> {human_bytes(out_bytes)}")
        _print_pack_note(stats)
        # DequantizeLinear nodes, palettes and Cast -> Mul levels alike; a weight that sat in a
        # Constant node stays one (-v shows where each went)
        print(f"  weights    {len(report.tensors)} weight(s) folded to float"
              f"{' (' + args.dtype + ')' if args.dtype else ''}")
        for note in report.notes:
            print(f"  note       {printable(note)}")
        if args.verbose and report.tensors:
            print()
            print_table(["tensor", "shape", "dtype", "scheme", "before", "after"],
                        [[t.name, _shape(t.shape), t.dtype, t.scheme, t.bytes_before, t.bytes_after] for t in report.tensors],
                        right=(4, 5))
    return EXIT_OK


SMALL_TENSOR_BYTES = 1024


def cmd_info(args) -> int:
    import passes
    from passes._fileio import check_readable, looks_packed
    from passes.inspect import describe_model

    path = check_readable(args.file)
    packed_meta = None
    if looks_packed(path):  # by its magic, as load_model tells them: an .onnx named .onnxz is read as one
        with passes.open_packed(path, max_bytes=args.max_bytes) as packed:
            packed_meta = packed.metadata()
    desc = describe_model(path)
    size = file_size(path)
    if args.json:
        print_json({"command": "info", "file": str(path), "file_bytes": size, **desc.to_dict(),
                    "packed": packed_meta})
        return EXIT_OK
    opsets = ", ".join(f"{k} {v}" for k, v in desc.opsets.items())
    external = f" (with external data: {', '.join(desc.external_files)})" if desc.external_files else ""
    print(printable(f"{path}: {human_bytes(size)} on disk{external}, {desc.nodes} nodes, IR {desc.ir_version}, opsets {opsets}"))
    print(f"  weights: {len(desc.rows)} tensors, {human_bytes(desc.total_bytes)}")
    for op, v in desc.attribute_floats.items():
        print(f"  node attributes: {printable(op)} ({v['nodes']} node(s)) holds {v['values']:,} float values, "
              "not tensors (compress leaves them as they are)")
    print()
    print("  by dtype")
    print_table(["dtype", "tensors", "bytes", "share"],
                [[k, v["count"], human_bytes(v["bytes"]), f"{100 * v['bytes'] / max(desc.total_bytes, 1):.1f}%"]
                 for k, v in desc.by_dtype.items()], right=(1, 2, 3))
    print()
    print("  by scheme")
    print_table(["scheme", "tensors", "bytes", "share"],
                [[k, v["count"], human_bytes(v["bytes"]), f"{100 * v['bytes'] / max(desc.total_bytes, 1):.1f}%"]
                 for k, v in desc.by_scheme.items()], right=(1, 2, 3))
    rows = sorted(desc.rows, key=lambda r: (-r.bytes, r.name))
    shown = rows if args.all else [r for r in rows if r.bytes >= SMALL_TENSOR_BYTES]
    print()
    print("  tensors" + ("" if args.all else f" (>= {SMALL_TENSOR_BYTES} bytes; --all lists every one)"))
    print_table(["name", "dtype", "shape", "bytes", "scheme", "location"],
                [[r.name, r.dtype, _shape(r.shape), r.bytes, r.scheme, r.location] for r in shown], right=(3,))
    hidden = len(rows) - len(shown)
    if hidden:
        print(f"  ... and {hidden} smaller tensor(s), {human_bytes(sum(r.bytes for r in rows[len(shown):]))}")
    if packed_meta is not None:
        print()
        _print_packed_metadata(packed_meta, args.all)
    return EXIT_OK


PACKED_COLUMNS = ("name", "dtype", "shape", "bytes", "stored", "codec", "chunks", "file")


def _print_packed_metadata(meta: Any, show_all: bool = False) -> None:
    """The pack stage's metadata: scalar fields as lines, the tensor table by codec and per tensor."""
    meta = _jsonable(meta)
    if not isinstance(meta, dict):
        print(printable(f"  packed: {meta}"))
        return
    print("  packed file")
    tables = {}
    for key, value in meta.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables[key] = value
        elif isinstance(value, dict):
            print(printable(f"    {key}: " + ", ".join(f"{k}={v}" for k, v in value.items())))
        else:
            print(printable(f"    {key}: {value}"))
    tensors = tables.pop("tensors", None)
    for key, records in tables.items():
        print()
        print(printable(f"  packed {key}"))
        _print_records(records, [k for r in records for k in r])
    if tensors:
        has_sizes = all(isinstance(r.get("bytes"), int) for r in tensors)
        if has_sizes and any("codec" in r for r in tensors):
            by_codec: dict[str, list[int]] = {}
            for r in tensors:
                entry = by_codec.setdefault(str(r.get("codec")), [0, 0, 0])
                entry[0] += 1
                entry[1] += r["bytes"]
                entry[2] += r["stored"] if isinstance(r.get("stored"), int) else r["bytes"]  # None: kept in place
            print()
            print("  packed tensors by codec")
            print_table(["codec", "tensors", "bytes", "stored", "stored %"],
                        [[k, n, human_bytes(b), human_bytes(st), f"{100 * st / max(b, 1):.1f}%"]
                         for k, (n, b, st) in sorted(by_codec.items(), key=lambda kv: -kv[1][1])], right=(1, 2, 3, 4))
        shown = tensors
        if has_sizes:
            shown = sorted(tensors, key=lambda r: -r["bytes"])
            if not show_all:
                shown = [r for r in shown if r["bytes"] >= SMALL_TENSOR_BYTES]
        print()
        print("  packed tensors" + ("" if show_all or not has_sizes else f" (>= {SMALL_TENSOR_BYTES} bytes; --all lists every one)"))
        columns = [c for c in PACKED_COLUMNS if any(c in r for r in tensors)] or [k for r in tensors for k in r]
        _print_records(shown, columns)


def _print_records(records: list[dict], columns: list[str]) -> None:
    columns = list(dict.fromkeys(columns))
    numeric = [i for i, c in enumerate(columns) if all(isinstance(r.get(c), int) for r in records if c in r)]
    print_table(columns, [[_cell(r.get(c, "")) for c in columns] for r in records], right=numeric)


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return _shape(value) if all(isinstance(v, int) for v in value) else f"{len(value)} items"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def cmd_eval(args) -> int:
    import passes
    from passes._fileio import check_readable

    check_readable(args.original)
    check_readable(args.candidate)
    _check_restored_size(args.original, args.max_bytes)
    _check_restored_size(args.candidate, args.max_bytes)
    from passes.fidelity import model_structure, runs_from_file
    from passes.graph import default_opset

    # a plain file is read without its external data: onnxruntime reads the original from the file
    original = model_structure(args.original)
    feeds = passes.load_feeds(args.feeds, original, max_bytes=args.max_bytes) if args.feeds else None
    if 0 < default_opset(original) < _oldest_runnable_opset():
        original = passes.load_model(args.original)
    original, notes = _measurable(original, feeds, "the original")
    candidate = args.candidate
    if notes:  # the original is an old-opset model: the candidate may be one too
        candidate, candidate_notes = _measurable(passes.load_model(args.candidate), feeds, "the candidate")
        notes += candidate_notes
    result = _evaluate(args.original if not notes and runs_from_file(args.original) else original, candidate, args,
                       feeds)
    result.notes[:0] = notes + _random_notes(original)
    checks, passed = _gate_checks(result, args.require or [])
    if args.json:
        print_json({"command": "eval", "original": args.original, "candidate": args.candidate,
                    "original_bytes": file_size(args.original), "candidate_bytes": file_size(args.candidate),
                    "fidelity": result.to_dict(),
                    "gate": None if not args.require else {"passed": passed, "checks": checks}})
    else:
        print(printable(f"eval: {args.candidate} against {args.original}"))
        print(f"  file       {human_bytes(file_size(args.original))} -> {human_bytes(file_size(args.candidate))}")
        _print_fidelity(result, checks)
    _raise_if_gate_failed(checks, passed)
    return EXIT_OK


def cmd_pack(args) -> int:
    import passes
    from passes._fileio import check_readable

    check_readable(args.input)
    _check_distinct(args.input, args.output)
    _check_output(args.output, args.force)
    with _progress("pack") as bar:
        stats = passes.pack(args.input, args.output, threads=args.threads, force=args.force, progress=bar,
                            effort=args.effort)
    if args.verify:
        _verify_packed(args.output, args.input, threads=args.threads)
    in_bytes, out_bytes = file_size(args.input), Path(args.output).stat().st_size
    if args.json:
        print_json({"command": "pack", "input": args.input, "output": args.output, "input_bytes": in_bytes,
                    "output_bytes": out_bytes, "ratio": out_bytes / max(in_bytes, 1), "stats": _jsonable(stats),
                    "verified": bool(args.verify)})
    else:
        print(printable(f"packed: {args.input} -> {args.output}"))
        print(f"  file       {human_bytes(in_bytes)} -> {human_bytes(out_bytes)}  ({100 * out_bytes / max(in_bytes, 1):.1f}%)")
        _print_pack_note(stats)
        if args.verify:
            print(printable(f"  verified   re-read {args.output}: restores {args.input} byte for byte"))
    return EXIT_OK


def _check_is_pack(path: str, command: str) -> None:
    """unpack and verify read what pack writes: an .onnx given in its place is a mix-up of commands
    (exit 1), anything else without the pack magic a foreign file (exit 4); both messages name the
    file, which the reader's 'bad magic' did not (eval and verify --against take two)."""
    from passes import CorruptFileError, InvalidArgumentError
    from passes._fileio import looks_packed

    if looks_packed(path):
        return
    if Path(path).suffix.lower() == ".onnx":
        raise InvalidArgumentError(f"{path} is an .onnx file, not an .onnxz pack: {command} reads what "
                                   f"`{PROG} pack` writes")
    raise CorruptFileError(f"{path}: not an .onnxz file (it does not start with the .onnxz magic)")


def _packed_data_files(path: str, max_bytes: int | None) -> list[str]:
    """Names of the external data files a pack restores beside its model file."""
    import passes

    with passes.open_packed(path, max_bytes=max_bytes) as packed:
        return [f["name"] for f in packed.metadata()["files"][1:]]


def cmd_unpack(args) -> int:
    import passes
    from passes._fileio import check_readable

    check_readable(args.input)
    _check_is_pack(args.input, "unpack")
    if args.output is not None:
        _check_distinct(args.input, args.output, _packed_data_files(args.input, args.max_bytes))
        _check_output(args.output, args.force)
    out = passes.unpack(args.input, args.output, threads=args.threads, force=args.force, max_bytes=args.max_bytes,
                        digest="sha256" if args.sha256 else "fast", direct_io=not args.page_cache)
    if args.verify:
        _verify_unpacked(args.input, out, threads=args.threads)
    in_bytes, out_bytes = Path(args.input).stat().st_size, file_size(out)
    if args.json:
        print_json({"command": "unpack", "input": args.input, "output": str(out),
                    "input_bytes": in_bytes, "output_bytes": out_bytes, "verified": bool(args.verify),
                    "digest": "sha256" if args.sha256 else "fast"})
    else:
        print(printable(f"unpacked: {args.input} -> {out}"))
        print(f"  file       {human_bytes(in_bytes)} -> {human_bytes(out_bytes)}")
        if args.verify:
            print(printable(f"  verified   re-read {out}: the sha256 the pack records"))
    return EXIT_OK


def cmd_verify(args) -> int:
    import passes
    from passes import CorruptFileError, InvalidArgumentError
    from passes._fileio import check_readable, looks_packed

    check_readable(args.file)
    _check_is_pack(args.file, "verify")
    if args.against:
        check_readable(args.against)
        if looks_packed(args.against):
            raise InvalidArgumentError(f"--against {args.against} is an .onnxz pack: --against takes the original "
                                       f"ONNX model, whose bytes the pack must restore")
    result = passes.verify(args.file, args.against, threads=args.threads, max_bytes=args.max_bytes)
    ok = result.ok  # a VerifyResult always says (a missing field must not read as "ok")
    details = _jsonable(result)
    checks = result.checks
    if args.json:
        print_json({"command": "verify", "file": args.file, "against": args.against, "ok": ok, "result": details})
    else:
        what = f", restores {args.against} byte for byte" if args.against and ok else ""
        print(printable(f"verify: {args.file}: {'ok' + what if ok else 'FAILED'}"))
        for c in checks:  # (the details name the files the pack stores: names from the file, not from the user)
            print(f"  {'ok    ' if c.get('ok') else 'FAILED'}  " + printable(f"{c.get('check', '')}: {c.get('detail', '')}"))
    if not ok:
        raise CorruptFileError(f"{args.file}: verification failed: {_failed_checks(checks) or details}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# arguments


def _requirement(text: str):
    from passes import SurgeonError
    from passes.fidelity import parse_requirements

    try:
        return parse_requirements(text)
    except SurgeonError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _target(text: str) -> str:
    """--target is read when the arguments are: a malformed or empty one is a usage error (exit 2)
    before the model is loaded, as a malformed --require is (an empty one was ignored: plain int8)."""
    _requirement(text)
    return text


def _path(text: str) -> str:
    """A file argument: an empty one (a shell variable left unset) is a usage error; as a path it
    meant the current folder, and the error then spoke of '.'."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _bits(text: str) -> int:
    value = _integer(text)
    if not MIN_BITS <= value <= MAX_BITS:
        raise argparse.ArgumentTypeError(f"must be an integer from {MIN_BITS} to {MAX_BITS}, got {value}")
    return value


class _ExtendRequirements(argparse.Action):
    """--require may repeat and each may hold several comma-separated expressions."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.extend(values)
        setattr(namespace, self.dest, items)


def _decibels(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of dB, 0 or more, got {text}")
    return value


METRIC_ARG_KEYS = ("time_axis", "class_axis", "blank", "batch_axis")  # what the ctc metric and cosine_min read


def _metric_arg(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or key not in METRIC_ARG_KEYS:
        raise argparse.ArgumentTypeError(f"expects KEY=INTEGER with KEY one of {', '.join(METRIC_ARG_KEYS)}, got {text!r}")
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be an integer") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


# passes.fidelity.METRICS, spelled out so that --help need not import onnx (~1 s); test_cli checks
# that the two agree
METRICS = ("cosine", "top1", "ctc", "maxabs", "snr")


def _add_fidelity_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--feeds", metavar="FEEDS.npz", type=_path,
                   help="inputs to compare on: .npz with keys INDEX/INPUT_NAME (or INPUT_NAME for one feed); "
                        "without it, random inputs are synthesised from the model's input specs")
    p.add_argument("--require", metavar="EXPR", type=_requirement, action=_ExtendRequirements, default=[],
                   help="fidelity gate, e.g. 'cosine>=0.999', 'top1>=0.99', 'maxabs<=0.01', 'snr>=30' "
                        "(also cosine_min: the worst sample, each row of a batched feed where the output's batch axis is "
                        "known (named as an input's first dimension, or --metric-arg batch_axis=N), else the worst feed; "
                        "snr_min: the worst output; ctc with --metric ctc); repeat, or "
                        "separate with commas; exit 3 when not met")
    p.add_argument("--metric", choices=METRICS, help="the metric that matters for this model, recorded in the JSON report; "
                                                     "ctc (greedy-CTC string agreement) is computed only when named, with --metric-arg")
    p.add_argument("--metric-arg", metavar="KEY=INT", action="append", type=_metric_arg,
                   help="metric parameter, e.g. --metric-arg time_axis=0 --metric-arg class_axis=2 --metric-arg blank=0 "
                        "(ctc); --metric-arg batch_axis=0: the measured output's batch axis, for cosine_min per sample")
    p.add_argument("--provider", choices=("cpu", "cuda"), default=None, help="onnxruntime device for the runs (default cpu)")
    p.add_argument("--run-as", choices=("onnxruntime", "fold"), default="onnxruntime",
                   help="how the compressed model is run for the fidelity check: as onnxruntime runs the file "
                        "(default; its int8 MatMul fusion also quantizes activations) or with weights folded "
                        "to float, as fold / passes.InferenceSession(mode='fold') run it")


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr, like every other error: the usage block argparse prints
    ahead of the message pushed it out of sight in CI logs (`--help` still shows the usage)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Compress ONNX model weights to int8 + DequantizeLinear, check fidelity, pack losslessly.",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 fidelity gate failed, 4 damaged packed file, 70 internal error (a bug), "
               "130 interrupted",
    )
    from passes import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def verify_option(p):
        p.add_argument("--verify", action="store_true",
                       help="re-read OUT after writing it before reporting success (exit 4 and OUT removed when it fails)")

    def max_bytes_option(p, feeds=False):
        p.add_argument("--max-bytes", type=_non_negative_int, metavar="N",
                       help="refuse a .onnxz that restores to more than N bytes, before decoding it (default: 1 TiB)"
                            + (", and --feeds whose arrays declare more than N bytes, before reading them (default: "
                               "no bound beyond what each array's entry in the .npz holds)" if feeds else "")
                            + "; for untrusted files")

    def common(p, output=True, output_required=True, output_help="output file"):
        if output:
            p.add_argument("-o", "--output", required=output_required, metavar="OUT", type=_path,
                           help=f"{output_help} (never overwritten without --force)")
            p.add_argument("--force", action="store_true", help="replace OUT if it exists")
        p.add_argument("--json", action="store_true", help="print a machine-readable report on stdout")

    p = sub.add_parser("compress", help="float weights -> int8 (or fewer bits) + DequantizeLinear",
                       description="Quantize the float weights of IN and write OUT; with --require, write OUT only "
                                   "when the fidelity gate passes (exit 3 otherwise).")
    p.add_argument("input", metavar="IN", type=_path, help="ONNX model (.onnx or .onnxz)")
    common(p)
    p.add_argument("--bits", type=_bits, help=f"bits per weight, {MIN_BITS} to {MAX_BITS} (default 8)")
    p.add_argument("--target", metavar="EXPR", type=_target,
                   help="auto mode: the smallest model meeting EXPR on --feeds, e.g. 'top1>=0.99', 'cosine>=0.999' "
                        "(per-tensor widths by measured sensitivity, error-feedback rounding); also the gate")
    p.add_argument("--granularity", choices=("tensor", "channel", "block"), help="one scale per tensor, per output channel (default) or per block")
    p.add_argument("--block-size", type=_positive_int, metavar="N", help="weights per scale block (implies --granularity block)")
    p.add_argument("--asymmetric", action="store_true", help="use a zero point (default symmetric)")
    p.add_argument("--include", action="append", metavar="PATTERN", help="only weights whose name or consumer op type matches (repeatable); a name pattern also "
                   "quantizes small, 1-D and bias weights it names")
    p.add_argument("--exclude", action="append", metavar="PATTERN", help="leave weights whose name or consumer op type matches (repeatable)")
    p.add_argument("--min-elements", type=_non_negative_int, metavar="N",
                   help="leave tensors with fewer elements as they are (default 1024; 128 with --target)")
    p.add_argument("--rounding", choices=("nearest", "rdo"), default="nearest",
                   help="rdo: each channel/block takes the step that trades error against packed size (1.5-5%% smaller packs)")
    p.add_argument("--rd-max-snr-loss", type=_decibels, metavar="DB",
                   help="with --rounding rdo: dB of weight SNR each tensor may lose against nearest rounding (default 0.5)")
    p.add_argument("--pack", action="store_true", help="write a lossless .onnxz pack (-o must end in .onnxz, which alone implies it)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the per-tensor table")
    verify_option(p)
    max_bytes_option(p, feeds=True)
    _add_fidelity_options(p)
    p.set_defaults(func=cmd_compress)

    p = sub.add_parser("fold", help="DequantizeLinear of constants -> float initializers",
                       description="Materialise float weights: every DequantizeLinear of constant inputs, palette "
                                   "and Cast -> Mul level tensor becomes a float weight (-o NAME.onnxz packs the result).")
    p.add_argument("input", metavar="IN", type=_path, help="ONNX model (.onnx or .onnxz)")
    common(p)
    p.add_argument("--dtype", choices=("float16", "float32"), help="float type of the folded weights (default: what the node produced)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the per-tensor table")
    max_bytes_option(p)
    p.set_defaults(func=cmd_fold)

    p = sub.add_parser("info", help="weights by dtype and scheme, sizes, per-tensor table",
                       description="Describe a model's weights (.onnx; .onnxz also shows the packed tensor table).")
    p.add_argument("file", metavar="FILE", type=_path, help="ONNX model (.onnx or .onnxz)")
    p.add_argument("--all", action="store_true", help="list every tensor, small ones too")
    common(p, output=False)
    max_bytes_option(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("eval", help="compare a candidate model's outputs with the original's",
                       description="Run ORIGINAL and CANDIDATE on the same feeds and print the metrics; with --require, exit 3 when not met.")
    p.add_argument("original", metavar="ORIGINAL", type=_path, help="the reference model (.onnx or .onnxz)")
    p.add_argument("candidate", metavar="CANDIDATE", type=_path, help="the model to compare with it (.onnx or .onnxz)")
    common(p, output=False)
    max_bytes_option(p, feeds=True)
    _add_fidelity_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("pack", help="lossless entropy-coded .onnxz of any ONNX file",
                       description="Pack IN into OUT.onnxz; unpack restores IN byte for byte.")
    p.add_argument("input", metavar="IN", type=_path, help="any ONNX model (.onnx, with its external data files)")
    common(p)
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads (default: the CPUs this process may use)")
    p.add_argument("--effort", choices=["default", "max"], default="default",
                   help="max: also tries layouts that shave up to ~0.1%% off float32 weights, for slower "
                        "decoding of those tensors (open_nsfw: 0.04%% smaller, restore ~1.2x the CPU time)")
    verify_option(p)
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("unpack", help=".onnxz -> the original .onnx, byte for byte",
                       description="Restore the .onnx packed in IN (and its external data files, beside it) byte for "
                                   "byte, every checksum checked.")
    p.add_argument("input", metavar="IN.onnxz", type=_path, help="the pack")
    common(p, output_required=False, output_help="the restored .onnx (default: IN with .onnxz replaced by .onnx)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads (default: the CPUs this process may use)")
    p.add_argument("--sha256", action="store_true",
                   help="check each restored file by its sha256 (identity with the original's published hash; "
                        "default: the stored XXH3-128, ~10x faster; 1.0/1.1 files always use the sha256)")
    p.add_argument("--page-cache", action="store_true",
                   help="write through the page cache, for a file read right after (default: O_DIRECT where "
                        "the filesystem takes it: less CPU, and a large model does not evict the cache)")
    verify_option(p)
    max_bytes_option(p)
    p.set_defaults(func=cmd_unpack)

    p = sub.add_parser("verify", help="check every checksum of a .onnxz (and compare with the original)",
                       description="Decode FILE in memory and check every chunk checksum and each restored file's "
                                   "digests; with --against, also compare the restored bytes with the original. "
                                   "Nothing is written (exit 4 on damage or a mismatch).")
    p.add_argument("file", metavar="FILE", type=_path, help="the .onnxz pack")
    p.add_argument("--against", metavar="ORIGINAL", type=_path, help="the original .onnx: the unpacked bytes must equal it")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="worker threads (default: the CPUs this process may use)")
    common(p, output=False)
    max_bytes_option(p)
    p.set_defaults(func=cmd_verify)
    return parser


def _exit_code(exc) -> int:
    from passes import CorruptFileError, FidelityError

    if isinstance(exc, FidelityError):
        return EXIT_GATE_FAILED
    if isinstance(exc, CorruptFileError):
        return EXIT_CORRUPT
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the parser is built (its imports take ~1 s): nothing written yet
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    import contextlib
    import io

    if _interrupted_while_importing(["passes"]):  # (the parser reads its version; a Ctrl-C inside its dataclasses
        print(f"{PROG}: interrupted", file=sys.stderr)  # came out as a RuntimeError and a traceback)
        return EXIT_INTERRUPTED
    from passes import SurgeonError

    global _json_printed
    _json_printed = False
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # argparse's message, also for the JSON below
            args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help/--version exit 0
        sys.stderr.write(said.getvalue())
        code = exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if code and "--json" in words:
            lines = [line for line in said.getvalue().splitlines() if line.strip()]
            command = next((w for w in words if not w.startswith("-")), None)
            last = lines[-1] if lines else "usage error"
            _print_json_failure(command, last.split(": error: ", 1)[-1], code)
        return code
    sys.stderr.write(said.getvalue())
    as_json = bool(getattr(args, "json", False))
    if _interrupted_while_importing(_heavy_modules(args)):
        print(f"{PROG}: interrupted", file=sys.stderr)
        if as_json:
            _print_json_failure(args.command, "interrupted", EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    restore = _sigterm_unwinds()
    try:
        return args.func(args)
    except SurgeonError as exc:
        sys.stdout.flush()
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{PROG}: error: {printable(message)}", file=sys.stderr)
        if as_json:
            _print_json_failure(args.command, message, _exit_code(exc))
        return _exit_code(exc)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{PROG}: interrupted", file=sys.stderr)
        if as_json:
            _print_json_failure(args.command, "interrupted", EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except MemoryError:
        print(f"{PROG}: error: out of memory", file=sys.stderr)
        if as_json:
            _print_json_failure(args.command, "out of memory", EXIT_ERROR)
        return EXIT_ERROR
    except BrokenPipeError:  # `surgeon-compress info x | head`: the reader left, nothing to report
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:  # a bug: one line unless the user asks for the traceback
        if os.environ.get("SURGEON_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        print(f"{PROG}: internal error: {type(exc).__name__}: {first} (a bug; SURGEON_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        if as_json:
            _print_json_failure(args.command, f"internal error: {type(exc).__name__}: {first}", EXIT_INTERNAL)
        return EXIT_INTERNAL
    finally:
        restore()


def _heavy_modules(args) -> list[str]:
    """The extension-heavy modules the command will import: numpy and onnx for every one, onnxruntime where
    it runs models (eval; compress measuring or searching)."""
    names = ["numpy", "onnx"]
    if args.command == "eval" or (args.command == "compress" and (args.require or args.feeds or args.metric
                                                                  or args.target)):
        names.append("onnxruntime")
    return names


def _interrupted_while_importing(names: Sequence[str]) -> bool:
    """Import `names` with Ctrl-C held until they are in; True when one came meanwhile (the caller then
    stops with the one line and 130). Why: a KeyboardInterrupt raised inside an extension module's
    initialisation leaves it half made, and the command then crashed (SIGSEGV, no message) or failed on
    the broken module (exit 70) instead of stopping. Only in the main thread with Python's own handler
    (an embedding program keeps its own); a module that cannot be imported is the command's to report."""
    import importlib
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        for name in names:
            if held:
                break
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return bool(held)


def _sigterm_unwinds():
    """SIGTERM (kill, timeout, CI cancellation) unwinds like Ctrl-C, so that temporary outputs are
    removed; Python's default would end the process on the spot. Only when SIGTERM has its default
    disposition and we run in the main thread (an embedding program keeps its own handler).
    Returns the function that restores the previous state."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
