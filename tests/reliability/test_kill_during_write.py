"""An interrupted write (SIGINT, SIGTERM, SIGKILL) never leaves a partial file under the final
name and never touches the input.

Each scenario is first run to completion to count its checkpoints (every system call of the
atomic write, and the data cut in pieces; see _killharness), then killed once at every
checkpoint with each signal. What must hold after each kill:

- the final name holds either its previous content (or nothing) or the complete new content,
  and the new content appears exactly when the kill came after the rename;
- the input file is byte-for-byte unchanged;
- SIGINT (KeyboardInterrupt) leaves no temporary file; SIGTERM under Python's default
  disposition and SIGKILL run no cleanup code, so they may leave one temporary file, which is
  hidden and named `.<final name>.<random>.part` in the destination folder, holds a prefix of
  the output, and is never read by anything (safe to delete; SECURITY.md says so).
"""
from __future__ import annotations

import re
import signal

import onnx

from passes._fileio import atomic_output, load_model, save_model, write_bytes_atomic

from ._killharness import run_writer
from ._models import inlined, matmul_model, sha256

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
PAYLOAD = bytes(range(256)) * 400  # 100 KiB


def _leftovers(folder, expected_names):
    return sorted(p.name for p in folder.iterdir() if p.name not in expected_names)


def _check_leftovers(leftovers, final_name, sig, problems, where, point_name):
    pattern = re.compile(r"^\." + re.escape(final_name) + r"\.[A-Za-z0-9_]+\.part$")
    if sig == signal.SIGINT and leftovers:
        problems.append(f"{where}: SIGINT left {leftovers}")
    for name in leftovers:
        if not pattern.match(name):
            problems.append(f"{where}: unexpected file {name!r}")
    if len(leftovers) > 1:
        problems.append(f"{where}: more than one temporary file {leftovers}")


def _kill_sweep(tmp_path, write, final, before, after, input_path=None):
    """Kill `write` at every checkpoint with every signal; return the list of violated rules.

    `before`: bytes under the final name before the write (None: absent); `after`: the new bytes.
    """
    folder = final.parent
    expected = {p.name for p in folder.iterdir()} | {final.name}
    input_sha = sha256(input_path) if input_path else None

    def reset():
        for p in folder.iterdir():
            if p.name not in expected or p == final:
                p.unlink()
        if before is not None:
            final.write_bytes(before)

    reset()
    full = run_writer(write, kill_at=None)
    assert full.exit_code == 0, f"uninterrupted write failed: {full}"
    assert final.read_bytes() == after
    points = full.checkpoints
    renamed_at = points.index("after replace")
    assert len(points) >= 20, points

    problems = []
    for sig in SIGNALS:
        for k, name in enumerate(points):
            reset()
            result = run_writer(write, kill_at=k, sig=sig)
            where = f"{signal.Signals(sig).name} at #{k} ({name})"
            now = final.read_bytes() if final.exists() else None
            expect = after if k >= renamed_at else before
            if now != expect:
                state = "new" if now == after else "old" if now == before else "absent" if now is None else "PARTIAL/OTHER"
                problems.append(f"{where}: final name holds {state} content")
            leftovers = _leftovers(folder, expected)
            _check_leftovers(leftovers, final.name, sig, problems, where, name)
            for name in leftovers:
                if not after.startswith((folder / name).read_bytes()):
                    problems.append(f"{where}: temporary file {name} is not a prefix of the output")
            if input_sha and sha256(input_path) != input_sha:
                problems.append(f"{where}: input modified")
            if sig == signal.SIGINT and result.exit_code != 130:
                problems.append(f"{where}: expected KeyboardInterrupt to end the writer, got {result}")
    return problems, len(points)


def test_atomic_output_new_file(tmp_path):
    final = tmp_path / "out.bin"

    def write():
        with atomic_output(final) as f:
            f.write(PAYLOAD)

    problems, n = _kill_sweep(tmp_path, write, final, None, PAYLOAD)
    assert n >= 20
    assert not problems, "\n".join(problems)


def test_write_bytes_atomic_replacing_with_force(tmp_path):
    final = tmp_path / "out.bin"
    old = b"previous complete output\n" * 100

    def write():
        write_bytes_atomic(final, PAYLOAD, force=True)

    problems, _ = _kill_sweep(tmp_path, write, final, old, PAYLOAD)
    assert not problems, "\n".join(problems)


def test_save_model_input_untouched(tmp_path):
    src = tmp_path / "in.onnx"
    src.write_bytes(matmul_model(64, seed=1).SerializeToString())
    final = tmp_path / "out.onnx"
    expected = load_model(src).SerializeToString()

    def write():
        save_model(load_model(src), final)

    problems, _ = _kill_sweep(tmp_path, write, final, None, expected, input_path=src)
    assert not problems, "\n".join(problems)


def test_save_model_over_its_own_input_with_force(tmp_path):
    """`-o` naming the input with --force: the input is only ever replaced whole."""
    final = tmp_path / "model.onnx"
    old = matmul_model(64, seed=2).SerializeToString()
    new = matmul_model(64, seed=3, extra_identity=True).SerializeToString()

    def write():
        model = onnx.ModelProto()
        model.ParseFromString(new)
        save_model(model, final, force=True)

    problems, _ = _kill_sweep(tmp_path, write, final, old, new)
    assert not problems, "\n".join(problems)


def _external_pair_sweep(tmp_path, sigs):
    """Replace an existing model + external data pair (force) and kill at every point.

    After any kill, loading the model must give the old model or the new one, or a documented
    error; never the old graph with the new data (or the reverse)."""
    from passes.errors import SurgeonError

    final = tmp_path / "m.onnx"
    old_model = matmul_model(64, seed=4)
    new_model = matmul_model(64, seed=5, extra_identity=True)
    save_model(old_model, final, external_data=True)
    old_files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    old_loaded = inlined(final).SerializeToString()

    def write():
        save_model(new_model, final, force=True, external_data=True)

    full = run_writer(write, kill_at=None)
    assert full.exit_code == 0
    new_loaded = inlined(final).SerializeToString()
    points = full.checkpoints
    assert old_loaded != new_loaded

    problems = []
    for sig in sigs:
        for k, name in enumerate(points):
            for p in tmp_path.iterdir():
                p.unlink()
            for fname, data in old_files.items():
                (tmp_path / fname).write_bytes(data)
            run_writer(write, kill_at=k, sig=sig)
            where = f"{signal.Signals(sig).name} at #{k} ({name})"
            try:
                now = inlined(final).SerializeToString()
            except SurgeonError:
                continue
            if now not in (old_loaded, new_loaded):
                problems.append(f"{where}: model file and its data file disagree (mixed old/new state loads silently)")
    return problems


def test_save_model_external_data_replacement_is_consistent(tmp_path):
    problems = _external_pair_sweep(tmp_path, [signal.SIGKILL])
    assert not problems, "\n".join(problems)


def test_sigint_right_after_mkstemp_leaves_no_temp_file(tmp_path):
    final = tmp_path / "out.bin"

    def write():
        with atomic_output(final) as f:
            f.write(PAYLOAD)

    points = run_writer(write, kill_at=None).checkpoints
    final.unlink()
    run_writer(write, kill_at=points.index("after mkstemp"), sig=signal.SIGINT)
    assert list(tmp_path.iterdir()) == []
