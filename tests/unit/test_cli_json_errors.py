"""--json: a failure prints one JSON object on stdout too: a CI step that writes the report
to a file (`--json > report.json`) and parses it reads why, instead of an empty file."""
from __future__ import annotations

import json

from conftest import MODELS
from tools.surgeon_compress import main

SAMPLE = MODELS / "rapidocr_cls.onnx"
FEEDS = MODELS / "rapidocr_cls_feeds.npz"


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_missing_input_reports_its_error_as_json(capsys, tmp_path):
    code, out, err = _run(capsys, "compress", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx", "--json")
    assert code == 1
    report = json.loads(out)
    assert report == {"command": "compress", "error": report["error"], "exit_code": 1}
    assert "missing.onnx" in report["error"] and err.startswith("surgeon-compress: error: ")


def test_a_usage_error_reports_json_and_keeps_argparse_message(capsys, tmp_path):
    code, out, err = _run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", "--bits", "99", "--json")
    assert code == 2
    report = json.loads(out)
    assert report["command"] == "compress" and report["exit_code"] == 2
    assert report["error"].startswith("argument --bits") and "--bits" in err


def test_a_damaged_pack_reports_exit_4(capsys, tmp_path):
    bad = tmp_path / "bad.onnxz"
    bad.write_bytes(b"ONNXZ" + b"\0" * 64)
    code, out, _ = _run(capsys, "info", bad, "--json")
    assert code == 4 and json.loads(out)["exit_code"] == 4


def test_a_failed_gate_prints_its_report_once(capsys, tmp_path):
    """Exit 3 already printed the full report (checks, fidelity): no second object after it."""
    code, out, _ = _run(capsys, "compress", SAMPLE, "-o", tmp_path / "o.onnx", "--feeds", FEEDS, "--bits", "2",
                        "--require", "cosine>=0.99999", "--json")
    assert code == 3
    report = json.loads(out)  # one document: json.loads refuses trailing data
    assert report["written"] is False and report["gate"]["passed"] is False


def test_without_json_stdout_stays_empty_on_failure(capsys, tmp_path):
    code, out, _ = _run(capsys, "compress", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx")
    assert code == 1 and out == ""
