"""The surgeon-compress command: every subcommand and error path, via main(argv), plus a smoke
test of the installed console script."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import passes
from passes.progress import ProgressBar
from tools import surgeon_compress as cli
from tools.surgeon_compress import main

from conftest import MODELS, REPO, skip_or_fail

SAMPLE = MODELS / "rapidocr_cls.onnx"
SAMPLE_FP16 = MODELS / "rapidocr_cls_fp16.onnx"
FEEDS = MODELS / "rapidocr_cls_feeds.npz"


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("surgeon-compress: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], err


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> Path:
    """The sample model compressed once (int8 per channel), shared by read-only tests."""
    out = tmp_path_factory.mktemp("c") / "r8.onnx"
    assert main(["compress", str(SAMPLE), "-o", str(out)]) == 0
    return out


# ------------------------------------------------------------------------------ compress


def test_compress_writes_a_smaller_valid_model_and_leaves_the_input_alone(tmp_path, capsys):
    before = sha256(SAMPLE)
    out = tmp_path / "r8.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out)
    assert code == 0, err
    assert sha256(SAMPLE) == before
    assert out.stat().st_size < SAMPLE.stat().st_size * 0.6
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    assert "compressed:" in stdout and "% of the input" in stdout
    assert "fidelity" not in stdout  # no feeds, no requirement: no evaluation asked for
    assert [p.name for p in tmp_path.iterdir()] == ["r8.onnx"]  # no temporary files left


def test_a_search_that_keeps_every_weight_float_says_nothing_was_rewritten(tmp_path, capsys):
    """The auto search gives each tensor the size it expects the pack to store, float ones
    included; a plan that keeps every weight float rewrote nothing, and the weights line said
    'N tensor(s) rewritten' with a smaller size beside an unchanged file."""
    out = tmp_path / "t.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out, "--target", "snr>=200", "--feeds", FEEDS)
    assert code == 0, err
    assert "every weight kept float" in stdout
    weights = next(line for line in stdout.splitlines() if line.startswith("  weights "))
    assert "  weights    0 tensor(s) rewritten: 0 B -> 0 B;" in weights, weights


def test_compress_is_deterministic(tmp_path, compressed):
    again = tmp_path / "again.onnx"
    assert main(["compress", str(SAMPLE), "-o", str(again)]) == 0
    assert again.read_bytes() == compressed.read_bytes()


def test_compress_gate_passes_with_real_feeds(tmp_path, capsys):
    out = tmp_path / "gated.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE_FP16, "-o", out, "--feeds", FEEDS, "--require", "top1>=0.99",
                            "--require", "cosine>=0.999", "--metric", "top1")
    assert code == 0, err
    assert out.exists()
    assert "top1 1.0000" in stdout and "on 8 feeds" in stdout
    assert "gate       top1>=0.99: 1 ok" in stdout and "cosine>=0.999" in stdout


def test_compress_gate_fails_exit_3_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "failed.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out, "--feeds", FEEDS, "--require", "top1>=0.99,maxabs<=0")
    assert code == cli.EXIT_GATE_FAILED == 3
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert_one_line_error(err, "fidelity gate failed", "maxabs<=0", "was not written")
    assert "top1>=0.99 (got" not in err  # only what failed is named
    assert "FAILED" in stdout


def test_compress_json_report(tmp_path, capsys):
    out = tmp_path / "j.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out, "--json", "--feeds", FEEDS, "--require", "top1>=0.9")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["command"] == "compress" and report["written"] is True
    assert report["output_bytes"] == out.stat().st_size and report["input_bytes"] == SAMPLE.stat().st_size
    assert 0 < report["ratio"] < 1
    assert report["options"] == {"bits": 8, "granularity": "channel", "symmetric": True}
    assert report["report"]["tensors"] and report["report"]["bytes_after"] < report["report"]["bytes_before"]
    assert report["fidelity"]["n_feeds"] == 8 and report["fidelity"]["synthesized"] is False
    assert report["gate"]["passed"] is True and report["gate"]["checks"][0]["requirement"] == "top1>=0.9"


def test_compress_without_feeds_synthesises_and_says_so(tmp_path, capsys):
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "s.onnx", "--require", "cosine>=0.9")
    assert code == 0, err
    assert "synthesised" in stdout


def test_compress_failed_gate_json_still_reports(tmp_path, capsys):
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "x.onnx", "--json", "--feeds", FEEDS,
                            "--require", "snr>=200")
    assert code == 3
    report = json.loads(stdout)
    assert report["written"] is False and report["output_bytes"] is None and report["gate"]["passed"] is False


def test_compress_options_reach_the_pass(tmp_path, capsys):
    out = tmp_path / "t.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out, "--granularity", "tensor", "--asymmetric",
                            "--exclude", "conv1*", "--min-elements", "0", "--json", "-v")
    assert code == 0, err
    report = json.loads(stdout)
    schemes = {t["scheme"] for t in report["report"]["tensors"] if t["bytes_after"] != t["bytes_before"]}
    assert schemes and all("tensor" in s and "asym" in s for s in schemes), schemes
    assert all(not t["name"].startswith("conv1") or t["bytes_after"] == t["bytes_before"]
               for t in report["report"]["tensors"])


def test_compress_rdo_rounding_is_smaller_and_reported(tmp_path, capsys, compressed):
    out = tmp_path / "rdo.onnx"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", out, "--rounding", "rdo", "--rd-max-snr-loss", "0.5", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    schemes = {t["scheme"] for t in report["report"]["tensors"] if t["bytes_after"] != t["bytes_before"]}
    assert schemes and all(s.endswith("/rdo") or "rdo" not in s for s in schemes) and any("rdo" in s for s in schemes), schemes
    onnx.checker.check_model(str(out), full_check=True)
    # same graph, other integers: the pack of the rdo model is the smaller one
    sizes = [passes.pack(m, tmp_path / (m.stem + ".onnxz")).packed_bytes for m in (compressed, out)]
    assert sizes[1] < sizes[0], sizes


def test_compress_rd_option_without_rdo_is_refused(tmp_path, capsys):
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "x.onnx", "--rd-max-snr-loss", "1")
    assert code == 1
    assert_one_line_error(err, "--rd-max-snr-loss needs --rounding rdo")
    assert not (tmp_path / "x.onnx").exists()


def test_compress_pack_needs_an_onnxz_name(tmp_path, capsys):
    """--pack with -o X.onnx wrote a pack under that name: a file onnxruntime refuses."""
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "p.onnx", "--pack")
    assert code == 1
    assert_one_line_error(err, "--pack writes an .onnxz pack: name the output p.onnxz")
    assert not (tmp_path / "p.onnx").exists()
    code, _, _ = run(capsys, "compress", SAMPLE, "-o", tmp_path / "p.onnxz", "--pack")
    assert code == 0 and passes.open_packed(tmp_path / "p.onnxz").keys()


def test_the_metric_choices_are_the_librarys():
    """--metric's choices are spelled out so that --help does not import onnx: they must stay the library's."""
    import passes.fidelity

    assert cli.METRICS == passes.fidelity.METRICS


def test_the_defaults_the_help_names_are_the_librarys(capsys):
    """--help spells out defaults the library holds (it must not import onnx to read them)."""
    from passes.auto import AUTO_MIN_ELEMENTS
    from passes.onnxz.format import DEFAULT_MAX_OUTPUT_BYTES
    from passes.quantize import DEFAULT_MIN_ELEMENTS

    code, out, _ = run(capsys, "compress", "--help")
    assert code == 0 and f"default {DEFAULT_MIN_ELEMENTS}; {AUTO_MIN_ELEMENTS} with --target" in " ".join(out.split())
    code, out, _ = run(capsys, "unpack", "--help")
    assert code == 0 and DEFAULT_MAX_OUTPUT_BYTES == 1 << 40 and "default: 1 TiB" in " ".join(out.split())


def test_compress_verbose_prints_the_per_tensor_table(tmp_path, capsys):
    code, stdout, _ = run(capsys, "compress", SAMPLE, "-o", tmp_path / "v.onnx", "-v")
    assert code == 0
    assert "SNR dB" in stdout and "int8/channel(axis=0)/sym" in stdout


def test_compress_weights_in_if_subgraphs_gated_on_cosine(tmp_path, capsys):
    """silero_vad: every weight is a Constant node inside the If branches."""
    out = tmp_path / "vad.onnx"
    code, stdout, err = run(capsys, "compress", MODELS / "silero_vad_v6.onnx", "-o", out, "--feeds",
                            MODELS / "silero_vad_v6_feeds.npz", "--require", "cosine>=0.999", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    changed = [t for t in report["report"]["tensors"] if t["bytes_after"] < t["bytes_before"]]
    assert changed and all(t["location"].startswith("subgraph If_0/") for t in changed)
    assert report["output_bytes"] < 0.4 * report["input_bytes"]
    assert report["fidelity"]["metrics"]["cosine"] >= 0.999


# ------------------------------------------------------------------------------ error paths


def test_missing_input(tmp_path, capsys):
    code, out, err = run(capsys, "compress", tmp_path / "absent.onnx", "-o", tmp_path / "o.onnx")
    assert code == 1 and out == ""
    assert_one_line_error(err, "absent.onnx", "no such file")


def test_not_an_onnx_file(tmp_path, capsys):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\xffthis is not a protobuf\x12\x99" * 10)
    for argv in (["compress", junk, "-o", tmp_path / "o.onnx"], ["info", junk], ["fold", junk, "-o", tmp_path / "f.onnx"],
                 ["eval", junk, SAMPLE]):
        code, _, err = run(capsys, *argv)
        assert code == 1, argv
        assert_one_line_error(err, "junk.onnx")
    assert list(tmp_path.iterdir()) == [junk]


def test_output_exists_needs_force(tmp_path, capsys):
    out = tmp_path / "o.onnx"
    out.write_bytes(b"keep me")
    code, _, err = run(capsys, "compress", SAMPLE, "-o", out)
    assert code == 1
    assert_one_line_error(err, "exists", "--force")
    assert out.read_bytes() == b"keep me"
    code, _, err = run(capsys, "compress", SAMPLE, "-o", out, "--force")
    assert code == 0, err
    assert onnx.load(str(out)).graph.node


def test_unwritable_destination(tmp_path, capsys):
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "no" / "such" / "dir" / "o.onnx")
    assert code == 1
    assert_one_line_error(err, "does not exist")
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    code, _, err = run(capsys, "compress", SAMPLE, "-o", a_file / "o.onnx")
    assert code == 1
    assert_one_line_error(err)
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path)
    assert code == 1
    assert_one_line_error(err, "folder")


def test_destination_refusing_writes_even_to_root(capsys):
    """sysfs refuses new files to everyone, root included: the error comes from the write itself."""
    target = Path("/sys/surgeon-compress-test.onnx")
    if not Path("/sys").is_dir() or target.exists():
        pytest.skip("no sysfs here")
    code, _, err = run(capsys, "compress", SAMPLE, "-o", target)
    assert code == 1
    assert_one_line_error(err, "cannot write", str(target))
    assert not target.exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_destination(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = run(capsys, "compress", SAMPLE, "-o", ro / "o.onnx")
        assert code == 1
        assert_one_line_error(err, "not writable")
    finally:
        ro.chmod(0o755)


def test_output_must_not_be_the_input(tmp_path, capsys):
    copy = tmp_path / "m.onnx"
    shutil.copyfile(SAMPLE, copy)
    before = sha256(copy)
    code, _, err = run(capsys, "compress", copy, "-o", copy, "--force")
    assert code == 1
    assert_one_line_error(err, "is the input")
    assert sha256(copy) == before


def test_output_must_not_be_the_feeds_file(tmp_path, capsys):
    # the feeds file is an input too: -o naming it with --force replaced it with the model
    feeds = tmp_path / "f.npz"
    shutil.copyfile(FEEDS, feeds)
    before = sha256(feeds)
    (tmp_path / "link.npz").symlink_to(feeds)
    for out in (feeds, tmp_path / "link.npz"):
        code, _, err = run(capsys, "compress", SAMPLE, "-o", out, "--force", "--feeds", feeds, "--require", "top1>=0.9")
        assert code == 1
        assert_one_line_error(err, f"output {out} is the --feeds file", "choose another -o")
    assert sha256(feeds) == before


@pytest.mark.parametrize("expr", ["cosine", "cosine<=0.9", "accuracy>=0.5", "top1>=2", "maxabs>=1",
                                  "top1>=0.9,", ",top1>=0.9", "top1>=0.9,,cosine>=0.9", ""])
@pytest.mark.parametrize("option", ["--require", "--target"])
def test_bad_require_is_a_usage_error(tmp_path, capsys, expr, option):
    code, out, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", option, expr)
    assert code == 2
    assert_one_line_error(err, option)
    assert not (tmp_path / "o.onnx").exists()


def test_stray_comma_in_require_is_named(tmp_path, capsys):
    # a trailing comma was skipped, so 'top1>=0.9,' gated on top1 alone without a word
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", "--require", "top1>=0.9,")
    assert code == 2
    assert_one_line_error(err, "empty requirement", "'top1>=0.9,'", "stray comma")


def test_usage_errors_exit_2(capsys):
    assert run(capsys, "compress", SAMPLE)[0] == 2  # -o missing
    assert run(capsys, "nosuchcommand")[0] == 2
    assert run(capsys)[0] == 2
    assert run(capsys, "compress", SAMPLE, "-o", "x.onnx", "--granularity", "row")[0] == 2
    assert run(capsys, "compress", SAMPLE, "-o", "x.onnx", "--block-size", "0")[0] == 2
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "compress" in out and "exit codes" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and passes.__version__ in out


def test_bad_feeds(tmp_path, capsys):
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, **{"0/image": np.zeros((1, 3, 48, 192), np.float32)})
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", "--feeds", wrong, "--require", "top1>=0.9")
    assert code == 1
    assert_one_line_error(err, "missing input(s) 'x'", "'image'")
    code, _, err = run(capsys, "eval", SAMPLE, SAMPLE, "--feeds", tmp_path / "absent.npz")
    assert code == 1
    assert_one_line_error(err, "absent.npz")
    assert not (tmp_path / "o.onnx").exists()


def test_unavailable_provider(capsys):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA is available here")
    code, _, err = run(capsys, "eval", SAMPLE, SAMPLE, "--feeds", FEEDS, "--provider", "cuda")
    assert code == 1
    assert_one_line_error(err, "provider cuda is not available", "onnxruntime-gpu")


def test_pass_errors_become_one_line(tmp_path, capsys):
    # a block of 1 passes the command's own check (at least 1) and is refused by quantize_weights
    # (--bits 9, used here before, is now refused by the argument parser: exit 2)
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", "--block-size", "1")
    assert code == 1
    assert_one_line_error(err, "block_size", "1")
    assert not (tmp_path / "o.onnx").exists()


def test_interrupt_exits_130_without_output(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(passes, "quantize_weights", interrupted)
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx")
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["build_parser", "parse_args"])
def test_interrupt_before_the_command_starts_is_one_line(tmp_path, capsys, monkeypatch, where):
    """Ctrl-C in the first second (the parser's imports: numpy, onnx) printed a 20-line traceback
    and ended by the signal (exit -2) instead of the one line and 130 of an interrupted command."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "build_parser":
        monkeypatch.setattr(cli, "build_parser", interrupted)
    else:
        monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", interrupted)
    code, out, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx")
    assert code == 130 and err.strip() == "surgeon-compress: interrupted" and out == ""
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_writing_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    import passes._fileio as fileio

    real_replace = os.replace

    def interrupted_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "replace", interrupted_replace)
    code, _, _ = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx")
    monkeypatch.setattr(fileio.os, "replace", real_replace)
    assert code == 130
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


def test_internal_error_is_one_line(tmp_path, capsys, monkeypatch):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(passes, "quantize_weights", bug)
    monkeypatch.delenv("SURGEON_DEBUG", raising=False)
    code, _, err = run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx")
    assert code == cli.EXIT_INTERNAL
    assert "internal error: ZeroDivisionError" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ fold / info / eval


def test_fold_restores_float_weights(tmp_path, capsys, compressed):
    out = tmp_path / "f.onnx"
    code, stdout, err = run(capsys, "fold", compressed, "-o", out, "--dtype", "float32")
    assert code == 0, err
    model = onnx.load(str(out))
    assert not any(n.op_type == "DequantizeLinear" for n in model.graph.node)
    assert "folded" in stdout
    code, stdout, err = run(capsys, "eval", SAMPLE, out, "--feeds", FEEDS, "--require", "top1>=0.99", "--json")
    assert code == 0, err
    assert json.loads(stdout)["fidelity"]["metrics"]["top1"] == 1.0
    code, stdout, _ = run(capsys, "fold", compressed, "-o", tmp_path / "j.onnx", "--json")
    assert code == 0 and json.loads(stdout)["report"]["tensors"]
    assert run(capsys, "fold", compressed, "-o", tmp_path / "x.onnx", "--dtype", "int8")[0] == 2


def test_info_tables_and_json(capsys, compressed):
    code, stdout, err = run(capsys, "info", compressed)
    assert code == 0, err
    assert "by dtype" in stdout and "by scheme" in stdout and "int8/channel(axis=0)/sym" in stdout
    assert "--all lists every one" in stdout
    code, stdout, _ = run(capsys, "info", compressed, "--json")
    info = json.loads(stdout)
    assert info["file_bytes"] == compressed.stat().st_size
    assert info["by_dtype"]["int8"]["count"] >= 1 and info["packed"] is None
    names = {t["name"] for t in info["tensors"]}
    code, stdout, _ = run(capsys, "info", compressed, "--all")
    assert all(n in stdout for n in list(names)[:20])


def test_info_counts_external_data(tmp_path, capsys):
    model = onnx.load(str(SAMPLE))
    big = onnx.helper.make_tensor("big", onnx.TensorProto.FLOAT, [256, 16], np.ones(4096, np.float32).tobytes(), raw=True)
    model.graph.initializer.append(big)
    onnx.save_model(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=1024)
    code, stdout, err = run(capsys, "info", tmp_path / "ext.onnx", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["external_files"] == ["weights.bin"]
    assert info["file_bytes"] == (tmp_path / "ext.onnx").stat().st_size + (tmp_path / "weights.bin").stat().st_size


def test_eval_names_the_model_that_fails(tmp_path, capsys):
    broken = onnx.load(str(SAMPLE))
    broken.graph.node[-1].op_type = "NoSuchOp"
    path = tmp_path / "broken.onnx"
    path.write_bytes(broken.SerializeToString())
    code, _, err = run(capsys, "eval", SAMPLE, path, "--feeds", FEEDS)
    assert code == 1
    assert_one_line_error(err, "candidate model", "onnxruntime cannot load")
    code, _, err = run(capsys, "eval", path, SAMPLE, "--feeds", FEEDS)
    assert code == 1
    assert_one_line_error(err, "original model")


def test_eval_gate_and_metrics(tmp_path, capsys, compressed):
    code, stdout, err = run(capsys, "eval", SAMPLE, compressed, "--feeds", FEEDS, "--metric", "top1")
    assert code == 0, err
    assert "top1 1.0000" in stdout and "on 8 feeds" in stdout
    code, stdout, err = run(capsys, "eval", SAMPLE, compressed, "--feeds", FEEDS, "--require", "maxabs<=0")
    assert code == 3
    assert_one_line_error(err, "fidelity gate failed", "maxabs")
    code, stdout, err = run(capsys, "eval", SAMPLE, compressed, "--metric", "ctc")
    assert code == 1
    assert_one_line_error(err, "time_axis")
    code, stdout, err = run(capsys, "eval", SAMPLE, SAMPLE, "--metric", "ctc", "--metric-arg", "time_axis=0",
                            "--metric-arg", "class_axis=1", "--require", "ctc>=1", "--json")
    assert code == 0, err
    assert json.loads(stdout)["fidelity"]["metrics"]["ctc"] == 1.0
    code, _, err = run(capsys, "eval", SAMPLE, SAMPLE, "--metric-arg", "time_axis")
    assert code == 2
    assert_one_line_error(err, "--metric-arg", "KEY=INTEGER")


@pytest.mark.parametrize("argv, words", [
    (["eval", SAMPLE, SAMPLE, "--metric-arg", "time_axes=0"], ["--metric-arg", "time_axis, class_axis, blank"]),
    (["eval", SAMPLE, SAMPLE, "--metric-arg", "blank=x"], ["--metric-arg", "must be an integer"]),
    (["compress", SAMPLE, "-o", "o.onnx", "--metric-arg", "nope"], ["--metric-arg"]),
    (["compress", SAMPLE, "-o", "o.onnx", "--rounding", "rdo", "--rd-max-snr-loss", "nan"], ["--rd-max-snr-loss", "finite"]),
    (["compress", SAMPLE, "-o", "o.onnx", "--rounding", "rdo", "--rd-max-snr-loss", "-1"], ["--rd-max-snr-loss", "0 or more"]),
    (["pack", SAMPLE, "-o", "o.onnxz", "--threads", "0"], ["--threads", "at least 1"]),
    (["unpack", "x.onnxz", "--threads", "-1"], ["--threads", "at least 1"]),
    (["compress", SAMPLE, "-o", "o.onnx", "--target", "top1"], ["--target", "METRIC>=NUMBER"]),
    (["compress", SAMPLE], ["-o/--output", "surgeon-compress compress --help"]),
    ([], ["COMMAND"]),
    # an empty path (a shell variable left unset): '-o ""' was reported as the folder '.', and
    # '--feeds ""' was taken for no feeds at all, so the gate ran on random inputs
    (["compress", SAMPLE, "-o", ""], ["-o/--output", "empty path"]),
    (["compress", SAMPLE, "-o", "o.onnx", "--feeds", "", "--require", "top1>=0.9"], ["--feeds", "empty path"]),
    (["compress", "", "-o", "o.onnx"], ["IN", "empty path"]),
    (["eval", SAMPLE, ""], ["CANDIDATE", "empty path"]),
    (["info", ""], ["FILE", "empty path"]),
    (["verify", "x.onnxz", "--against", ""], ["--against", "empty path"]),
    (["unpack", "", "-o", "o.onnx"], ["IN.onnxz", "empty path"]),
])
def test_usage_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, words):
    # argparse printed its usage block first: the error was the last of 4 to 15 lines.
    # --metric-arg was checked only when a metric ran (ignored without --feeds/--require; a
    # misspelt key always), --rd-max-snr-loss nan/-1 exited 1 naming the library's parameter
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_line_error(err, *words)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ pack / unpack / verify


def _needs_pack_stage():
    try:
        passes.pack  # noqa: B018 - resolves the lazy import
    except (ImportError, AttributeError) as exc:
        skip_or_fail(f"pack stage not available: {exc}")


def test_pack_unpack_verify_round_trip(tmp_path, capsys, compressed):
    _needs_pack_stage()
    packed = tmp_path / "m.onnxz"
    code, stdout, err = run(capsys, "pack", compressed, "-o", packed)
    assert code == 0, err
    assert packed.exists() and "packed" in stdout
    code, stdout, err = run(capsys, "verify", packed, "--against", compressed)
    assert code == 0, err
    assert "byte for byte" in stdout
    code, stdout, err = run(capsys, "verify", packed, "--against", SAMPLE)  # a different original
    assert code == cli.EXIT_CORRUPT
    assert_one_line_error(err, "verification failed")
    assert "FAILED" in stdout
    restored = tmp_path / "back.onnx"
    code, _, err = run(capsys, "unpack", packed, "-o", restored)
    assert code == 0, err
    assert restored.read_bytes() == compressed.read_bytes()
    code, stdout, err = run(capsys, "info", packed)
    assert code == 0, err
    assert "packed file" in stdout
    code, stdout, err = run(capsys, "info", packed, "--json")
    assert json.loads(stdout)["packed"] is not None
    assert run(capsys, "unpack", packed, "-o", restored)[0] == 1  # exists, no --force
    cached = tmp_path / "cached.onnx"
    code, _, err = run(capsys, "unpack", packed, "-o", cached, "--page-cache", "--sha256")
    assert code == 0, err
    assert cached.read_bytes() == compressed.read_bytes()


def test_compress_pack_in_one_step(tmp_path, capsys):
    _needs_pack_stage()
    packed = tmp_path / "m.onnxz"
    code, stdout, err = run(capsys, "compress", SAMPLE, "-o", packed, "--feeds", FEEDS, "--require", "top1>=0.99")
    assert code == 0, err
    assert "(packed)" in stdout
    code, stdout, err = run(capsys, "eval", SAMPLE, packed, "--feeds", FEEDS, "--metric", "top1")
    assert code == 0, err
    assert "top1 1.0000" in stdout


def test_damaged_pack_exit_4(tmp_path, capsys, compressed):
    _needs_pack_stage()
    packed = tmp_path / "m.onnxz"
    assert main(["pack", str(compressed), "-o", str(packed)]) == 0
    data = bytearray(packed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    packed.write_bytes(bytes(data))
    code, _, err = run(capsys, "verify", packed)
    assert code == cli.EXIT_CORRUPT
    assert_one_line_error(err)
    code, _, err = run(capsys, "unpack", packed, "-o", tmp_path / "x.onnx")
    assert code == cli.EXIT_CORRUPT
    assert not (tmp_path / "x.onnx").exists()
    foreign = tmp_path / "foreign.onnxz"
    foreign.write_bytes(b"PK\x03\x04 not a pack")
    for argv in (["verify", foreign], ["unpack", foreign, "-o", tmp_path / "y.onnx"]):
        code, _, err = run(capsys, *argv)
        assert code == cli.EXIT_CORRUPT
        assert_one_line_error(err, str(foreign), "not an .onnxz file")  # the file named (was: 'bad magic' alone)


def test_a_model_or_pack_in_the_wrong_place_is_named(tmp_path, capsys, compressed):
    # before: unpack/verify of an .onnx exited 4, 'not an .onnxz file (bad magic)'; verify
    # --against a pack exited 4, 'compare m.onnx: differs from m.onnxz'
    _needs_pack_stage()
    packed = tmp_path / "m.onnxz"
    assert main(["pack", str(compressed), "-o", str(packed)]) == 0
    for argv in (["unpack", compressed, "-o", tmp_path / "u.onnx"], ["verify", compressed]):
        code, _, err = run(capsys, *argv)
        assert code == 1
        assert_one_line_error(err, f"{compressed} is an .onnx file, not an .onnxz pack", "surgeon-compress pack")
    code, _, err = run(capsys, "verify", packed, "--against", packed)
    assert code == 1
    assert_one_line_error(err, f"--against {packed} is an .onnxz pack", "original ONNX model")
    assert not (tmp_path / "u.onnx").exists()
    # a pack given to pack: was 'not an ONNX model (Error parsing message ...: Wire format was corrupt)'
    code, _, err = run(capsys, "pack", packed, "-o", tmp_path / "again.onnxz")
    assert code == 1
    assert_one_line_error(err, f"{packed} is an .onnxz pack already", "unpack restores")
    assert not (tmp_path / "again.onnxz").exists()


# ------------------------------------------------------------------------------ progress bar


def test_progress_bar_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = ProgressBar("work", stream=tty)
    bar(1, 4)
    bar(4, 4)
    bar.close()
    text = tty.getvalue()
    assert "work [" in text and "100% (4/4)" in text and text.endswith("\r\x1b[K")
    pipe = io.StringIO()
    quiet = ProgressBar("work", stream=pipe)
    quiet(1, 2)
    quiet.close()
    assert pipe.getvalue() == ""


# ------------------------------------------------------------------------------ installed command


def _console_script() -> str | None:
    """The installed script of this interpreter (pip puts it in its scripts folder), else PATH's."""
    import sysconfig

    beside = Path(sysconfig.get_path("scripts")) / "surgeon-compress"
    return str(beside) if beside.exists() else shutil.which("surgeon-compress")


def test_installed_console_script(tmp_path):
    exe = _console_script()
    if exe is None:
        skip_or_fail("surgeon-compress is not installed (python3 -m pip install -e .)")
    env = {**os.environ, "PYTHONPATH": ""}
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and passes.__version__ in version.stdout
    out = tmp_path / "o.onnx"
    ok = subprocess.run([exe, "compress", str(SAMPLE), "-o", str(out), "--feeds", str(FEEDS), "--require", "top1>=0.99"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert out.exists() and "gate" in ok.stdout
    assert ok.stderr == ""  # no progress bar when stderr is not a terminal, no warnings
    failed = subprocess.run([exe, "compress", str(SAMPLE), "-o", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 1
    assert failed.stderr.startswith("surgeon-compress: error: ") and "Traceback" not in failed.stderr


def test_module_entry_point(tmp_path):
    """`python -m tools.surgeon_compress` behaves as the console script (used before installation)."""
    result = subprocess.run([sys.executable, "-m", "tools.surgeon_compress", "info", str(SAMPLE)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "float32" in result.stdout


def test_pack_effort_max_round_trips(tmp_path):
    from tools.surgeon_compress import main

    src = Path(__file__).resolve().parents[2] / "models" / "rapidocr_cls.onnx"
    out = tmp_path / "m.onnxz"
    assert main(["pack", str(src), "-o", str(out), "--effort", "max"]) == 0
    assert main(["unpack", str(out), "-o", str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").read_bytes() == src.read_bytes()


def test_compress_run_as_fold_is_reported(tmp_path, capsys):
    from tools.surgeon_compress import main

    src = Path(__file__).resolve().parents[2] / "models" / "rapidocr_cls.onnx"
    feeds = Path(__file__).resolve().parents[2] / "models" / "rapidocr_cls_feeds.npz"
    out = tmp_path / "q.onnx"
    assert main(["compress", str(src), "-o", str(out), "--feeds", str(feeds), "--require", "top1>=0.99",
                 "--run-as", "fold", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "weights folded to float" in json.dumps(report)  # the report says how it was measured


def test_compress_and_fold_unseen_patterns(capsys, tmp_path):
    """The command on patterns real models use (test_unseen_patterns.py): an IR 3 model, bfloat16
    weights, an LSTM, Scan/Loop bodies. compress --verify passes the checker, the fidelity check
    without feeds runs, fold --dtype float16 gives a loadable model."""
    import onnxruntime as ort

    import test_unseen_patterns as up

    for name in ("init_input_ir3", "bfloat16", "lstm", "scan_loop"):
        m, feeds = up.PATTERNS[name]()
        src = tmp_path / f"{name}.onnx"
        src.write_bytes(m.SerializeToString())
        out = tmp_path / f"{name}.q.onnx"
        code, stdout, err = run(capsys, "compress", str(src), "-o", str(out), "--verify", "--require", "snr>=25",
                                "--json")
        assert code == 0, err
        report = json.loads(stdout)
        assert report["gate"]["passed"] and report["verified"]
        if name == "init_input_ir3":
            assert any("IR version raised from 3 to 4" in n for n in report["report"]["notes"])
        folded = tmp_path / f"{name}.f.onnx"
        code, _, err = run(capsys, "fold", str(out), "-o", str(folded), "--dtype", "float16")
        assert code == 0, err
        onnx.checker.check_model(str(folded), full_check=True)
        ort.InferenceSession(str(folded), providers=["CPUExecutionProvider"]).run(None, feeds[0])


def test_a_pack_larger_than_its_input_says_why(tmp_path, capsys):
    # a 4-float model: the container outweighs what coding saves; the command printed '521.1%' alone
    _needs_pack_stage()
    w = onnx.numpy_helper.from_array(np.ones(4, np.float32), "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])], [w])
    tiny = tmp_path / "tiny.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), str(tiny))
    for command in ("pack", "compress"):
        out = tmp_path / f"{command}.onnxz"
        code, stdout, err = run(capsys, command, tiny, "-o", out)
        assert code == 0, err
        notes = [line for line in stdout.splitlines() if line.strip().startswith("note") and "larger than its input" in line]
        assert len(notes) == 1 and "restores the input byte for byte" in notes[0], stdout
        assert out.stat().st_size > tiny.stat().st_size
    code, stdout, _ = run(capsys, "pack", tiny, "-o", tmp_path / "j.onnxz", "--json")
    assert code == 0 and json.loads(stdout)["stats"]["larger_than_input"] is True
    code, stdout, _ = run(capsys, "pack", SAMPLE, "-o", tmp_path / "sample.onnxz")
    assert code == 0 and "larger than its input" not in stdout


def test_packs_and_models_told_apart_by_their_bytes_not_their_names(tmp_path, capsys, compressed):
    # before: compress/eval of a foreign X.onnxz said 'X is not an ONNX model' (exit 1), info
    # 'not an .onnxz file (bad magic)'; info of an .onnx named .onnxz failed although load and eval
    # read it; eval of a pack renamed .onnx: 'onnxruntime cannot load'
    _needs_pack_stage()
    foreign = tmp_path / "foreign.onnxz"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    for argv in (["compress", foreign, "-o", tmp_path / "o.onnx"], ["info", foreign], ["eval", SAMPLE, foreign]):
        code, _, err = run(capsys, *argv)
        assert code == cli.EXIT_CORRUPT, (argv, err)
        assert_one_line_error(err, f"{foreign}: not an .onnxz file", "nor an ONNX model")
    assert not (tmp_path / "o.onnx").exists()
    model_named_as_pack = tmp_path / "model.onnxz"
    shutil.copyfile(compressed, model_named_as_pack)
    code, stdout, err = run(capsys, "info", model_named_as_pack)
    assert code == 0 and "int8/channel" in stdout and "packed file" not in stdout, err
    pack_named_as_model = tmp_path / "pack.onnx"
    assert main(["pack", str(compressed), "-o", str(tmp_path / "p.onnxz")]) == 0
    shutil.copyfile(tmp_path / "p.onnxz", pack_named_as_model)
    capsys.readouterr()
    code, stdout, err = run(capsys, "eval", compressed, pack_named_as_model, "--feeds", FEEDS, "--require", "maxabs<=0")
    assert code == 0, err
    code, stdout, err = run(capsys, "info", pack_named_as_model)
    assert code == 0 and "packed file" in stdout, err


def test_gate_on_feeds_with_nothing_to_measure_fails_in_one_line(capsys, tmp_path):
    """--require on feeds whose reference outputs are all NaN: refused (non-zero, one line), never 'ok'."""
    import onnx as _onnx

    model = _onnx.load(str(SAMPLE))
    name = next(i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    with np.load(FEEDS) as z:
        shape = z[z.files[0]].shape
    feeds = tmp_path / "nan.npz"
    np.savez(feeds, **{f"0/{name}": np.full(shape, np.nan, np.float32)})
    out = tmp_path / "o.onnx"
    code, _, err = run(capsys, "compress", SAMPLE, "-o", out, "--feeds", feeds, "--require", "snr>=20")
    assert code != 0
    assert_one_line_error(err, "NaN or infinite", "nothing to measure")
    assert not out.exists()
