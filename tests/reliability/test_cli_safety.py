"""The command's promises about files (issue 6 item 5): no overwrite without --force, the input
never modified (also with -o naming it), read-only destinations and damaged inputs give one
clear line and a documented exit code, and --verify re-reads what was written.
"""
from __future__ import annotations

import pytest

from tools.surgeon_compress import main

from ._models import sha256


@pytest.fixture
def files(samples, tmp_path):
    src = tmp_path / "model.onnx"
    src.write_bytes(samples["all_families"].files[""])
    packed = tmp_path / "model.onnxz"
    packed.write_bytes(samples["all_families"].packed)
    return src, packed


def _commands(src, packed, out):
    return {
        "compress": ["compress", str(src), "-o", str(out)],
        "fold": ["fold", str(src), "-o", str(out)],
        "pack": ["pack", str(src), "-o", str(out)],
        "unpack": ["unpack", str(packed), "-o", str(out)],
    }


@pytest.mark.parametrize("command", ["compress", "fold", "pack", "unpack"])
def test_no_overwrite_without_force(files, tmp_path, command, capsys):
    src, packed = files
    out = tmp_path / "existing.out"
    out.write_bytes(b"keep me")
    before = {p: sha256(p) for p in (src, packed)}
    argv = _commands(src, packed, out)[command]
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0 and "exists" in err and len(err.strip().splitlines()) == 1, (code, err)
    assert out.read_bytes() == b"keep me"
    assert main(argv + ["--force"]) == 0
    assert out.read_bytes() != b"keep me"
    assert {p: sha256(p) for p in (src, packed)} == before


@pytest.mark.parametrize("command", ["compress", "pack"])
def test_output_naming_the_input_is_refused_or_replaces_it_whole(files, command, capsys):
    src, packed = files
    before = src.read_bytes()
    code = main(_commands(src, packed, src)[command] + ["--force"])
    capsys.readouterr()
    if code != 0:
        assert src.read_bytes() == before
    else:  # replaced: by a complete, readable output
        import passes

        passes.load(src)


def test_damaged_packed_input_exit_code(files, tmp_path, capsys):
    _, packed = files
    data = bytearray(packed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    packed.write_bytes(bytes(data))
    for argv in (["unpack", str(packed), "-o", str(tmp_path / "x.onnx")], ["verify", str(packed)], ["info", str(packed)]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 4, (argv, code, err)  # EXIT_CORRUPT
        assert err.count("\n") == 1 and ("damaged" in err or "truncated" in err), err
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("command", ["pack", "unpack", "compress"])
def test_verify_option_rereads_the_output(files, tmp_path, command, capsys):
    src, packed = files
    out = tmp_path / "verified.out"
    assert main(_commands(src, packed, out)[command] + ["--verify"]) == 0
    assert "verif" in capsys.readouterr().out.lower()


def _model_with_external_data(folder):
    """model.onnx whose two weights live in side files W and B beside it."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "B"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    src = folder / "model.onnx"
    onnx.save_model(m, str(src), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    return src


@pytest.mark.parametrize("command", ["compress", "fold", "pack"])
def test_output_naming_an_external_data_file_of_the_input_is_refused(tmp_path, command, capsys):
    # `compress model.onnx -o W --force` replaced the weights file the input reads its W from:
    # the input was damaged (exit 0), where -o naming the model file itself is refused
    src = _model_with_external_data(tmp_path)
    before = {p.name: sha256(p) for p in tmp_path.iterdir()}
    assert set(before) == {"model.onnx", "W", "B"}
    for data_file in ("W", "B"):
        code = main([command, str(src), "-o", str(tmp_path / data_file), "--force"])
        err = capsys.readouterr().err
        assert code == 1 and "input" in err and len(err.strip().splitlines()) == 1, (code, err)
        assert {p.name: sha256(p) for p in tmp_path.iterdir()} == before


def test_unpack_refuses_data_files_that_would_replace_the_pack(tmp_path, capsys):
    # the pack restores model.onnx + W + B beside -o: a pack named W in that folder would be
    # replaced by the data file it is decoding
    import passes

    folder = tmp_path / "src"
    folder.mkdir()
    src = _model_with_external_data(folder)
    packed = tmp_path / "W"
    passes.pack(src, packed)
    before = sha256(packed)
    code = main(["unpack", str(packed), "-o", str(tmp_path / "model.onnx"), "--force"])
    err = capsys.readouterr().err
    assert code == 1 and "input" in err and len(err.strip().splitlines()) == 1, (code, err)
    assert sha256(packed) == before


def _special_files(folder):
    """A pipe, and a character device node like /dev/null where this process may make one."""
    import os
    import stat

    made = {}
    fifo = folder / "pipe"
    os.mkfifo(fifo)
    made["pipe"] = fifo
    dev = folder / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made["character device"] = dev
    except (PermissionError, OSError):
        pass
    return made


@pytest.mark.parametrize("command", ["compress", "fold", "pack", "unpack"])
def test_output_that_is_a_device_or_pipe_is_never_replaced(files, tmp_path, command, capsys):
    # `-o /dev/null --force` renamed the new file over the device node: as root the system's
    # /dev/null became a regular file holding the model
    import stat

    src, packed = files
    for kind, special in _special_files(tmp_path).items():
        argv = _commands(src, packed, special)[command] + ["--force"]
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1 and kind in err and len(err.strip().splitlines()) == 1, (kind, code, err)
        mode = special.stat().st_mode
        assert stat.S_ISFIFO(mode) if kind == "pipe" else stat.S_ISCHR(mode), kind
        special.unlink()


def test_names_from_the_model_cannot_drive_the_terminal(tmp_path, capsys):
    # a tensor named with ESC sequences cleared the screen / retitled the terminal when `info`
    # or `compress -v` printed it, and a newline in a name broke the table's rows
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    hostile = "w\x1b[2J\x1b]0;owned\x07\nrow\tcol\u200b"
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), hostile)
    g = helper.make_graph([helper.make_node("MatMul", ["X", hostile], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])], [w])
    src = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    for argv in (["info", str(src), "--all"], ["compress", str(src), "-o", str(tmp_path / "q.onnx"), "-v"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "\t" not in out and "\u200b" not in out, argv
        assert "w\\x1b[2J\\x1b]0;owned\\x07\\nrow\\tcol\\u200b" in out, out
