"""The command's option checks: a malformed or empty --target and an out-of-range --bits are
usage errors (exit 2) found before the model is read, as a malformed --require is; options the
auto mode would ignore are refused with it rather than dropped silently."""
from __future__ import annotations

import pytest

from tools.surgeon_compress import main

from ._models import matmul_model, sha256


@pytest.fixture
def src(tmp_path):
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save_model(matmul_model(64), str(path))
    return path


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip()


@pytest.mark.parametrize("target, words", [("", "empty requirement"), ("snr>=abc", "not a number"),
                                           ("foo>=1", "unknown metric")])
def test_bad_target_is_a_usage_error_before_the_model_is_read(tmp_path, capsys, target, words):
    missing = tmp_path / "absent.onnx"  # never opened: the options are checked first
    code, err = _run(capsys, ["compress", str(missing), "-o", str(tmp_path / "o.onnx"), "--target", target])
    assert code == 2 and "--target" in err and words in err, (code, err)
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("bits", ["0", "1", "9", "16", "-3"])
def test_bits_out_of_range_is_a_usage_error(tmp_path, capsys, bits):
    code, err = _run(capsys, ["compress", str(tmp_path / "absent.onnx"), "-o", str(tmp_path / "o.onnx"), "--bits", bits])
    assert code == 2 and "--bits" in err and "from 2 to 8" in err, (code, err)


@pytest.mark.parametrize("extra, named", [(["--bits", "4"], "--bits"), (["--exclude", "W"], "--exclude"),
                                          (["--include", "W"], "--include"), (["--asymmetric"], "--asymmetric"),
                                          (["--granularity", "tensor"], "--granularity"),
                                          (["--rounding", "rdo"], "--rounding rdo")])
def test_options_the_search_ignores_are_refused_with_target(src, tmp_path, capsys, extra, named):
    # before: `--target snr>=25 --exclude W` quantized W all the same, exit 0
    before = sha256(src)
    out = tmp_path / "o.onnx"
    code, err = _run(capsys, ["compress", str(src), "-o", str(out), "--target", "snr>=25", *extra])
    assert code == 1 and named in err and len(err.splitlines()) == 1, (code, err)
    assert not out.exists() and sha256(src) == before


def test_block_size_with_another_granularity_names_the_options(src, tmp_path, capsys):
    code, err = _run(capsys, ["compress", str(src), "-o", str(tmp_path / "o.onnx"), "--granularity", "tensor",
                              "--block-size", "32"])
    assert code == 1 and "--block-size needs --granularity block" in err, (code, err)


def test_min_elements_reaches_the_search(src, tmp_path, capsys):
    # 64 x 64 = 4096 weights: above the threshold nothing is quantized, below it W is
    import onnx

    for threshold, quantized in ((5000, False), (100, True)):
        out = tmp_path / f"o{threshold}.onnx"
        code, err = _run(capsys, ["compress", str(src), "-o", str(out), "--target", "snr>=20",
                                  "--min-elements", str(threshold)])
        assert code == 0, err
        # quantized: W stored as integer levels (DequantizeLinear or the auto mode's Cast+Mul form)
        stored = {t.name: t.data_type for t in onnx.load(str(out)).graph.initializer}
        integer = [name for name, dtype in stored.items() if dtype not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
        assert bool(integer) == quantized, (threshold, stored)
