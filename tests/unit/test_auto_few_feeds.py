"""passes.compress on few feeds: a search on one or two feeds fits them. Below auto.FEW_FEEDS feeds it
uses no error feedback (its fit to so few rows cannot be measured) and keeps a wider margin, and below
auto.FEW_FEEDS_NOTE the record and the command say how many feeds the target was met on."""
import numpy as np
import onnx
import pytest

import passes
from passes import auto
from passes.fidelity import parse_requirement
from tools.surgeon_compress import main

from modelgen import dense_model, feeds


def _notes(record, fragment):
    return [n for n in record["notes"] if fragment in n]


def test_one_feed_turns_error_feedback_off_and_says_so():
    m = dense_model()
    out, record = passes.compress(m, target="cosine>=0.999", feeds=feeds(m, n=1))
    assert record["met_on_feeds"]
    assert _notes(record, "only 1 feed(s): no error-feedback rounding")
    assert _notes(record, "only 1 feed(s): the search kept a wider margin")
    assert _notes(record, "target met on 1 feed(s) only")
    assert not any("gptq" in row["form"] for row in record["tensors"])


def test_many_feeds_keep_the_search_as_it_was():
    m = dense_model()
    out, record = passes.compress(m, target="cosine>=0.999", feeds=feeds(m, n=auto.FEW_FEEDS_NOTE))
    assert record["met_on_feeds"]
    assert not _notes(record, "feed(s): no error-feedback") and not _notes(record, "feed(s) only")


def test_between_the_two_bounds_only_the_note():
    m = dense_model()
    out, record = passes.compress(m, target="cosine>=0.999", feeds=feeds(m, n=auto.FEW_FEEDS))
    assert not _notes(record, "no error-feedback rounding") and not _notes(record, "wider margin")
    if not all(row["form"] == "float" for row in record["tensors"]):
        assert _notes(record, f"target met on {auto.FEW_FEEDS} feed(s) only")


def test_a_top1_target_on_few_feeds_gets_no_margin_note():
    """TieRisk already counts the feeds of a top-1 target: no wider margin there, only no error feedback."""
    from modelgen import conv_model

    m = conv_model()
    out, record = passes.compress(m, target="top1>=0.9", feeds=feeds(m, n=2))
    assert _notes(record, "only 2 feed(s): no error-feedback rounding")
    assert not _notes(record, "wider margin")


@pytest.mark.parametrize("text, share, expected", [
    ("cosine>=0.999", 1.0, 1 - 0.001 * auto.COSINE_MARGIN),
    ("cosine>=0.999", 0.5, 1 - 0.001 * auto.COSINE_MARGIN * 0.5),
    ("snr>=30", 0.5, 30 + 1 + 10 * np.log10(2)),
    ("maxabs<=0.01", 0.5, 0.01 * 0.8 * np.sqrt(0.5)),
    ("top1>=0.99", 0.5, 0.995),
])
def test_the_few_feeds_margin_halves_the_allowed_error(text, share, expected):
    assert auto._margin(parse_requirement(text), None, share).threshold == pytest.approx(expected)


def test_the_command_prints_the_few_feeds_note(tmp_path, capsys):
    m = dense_model()
    src, out, npz = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "f.npz"
    onnx.save(m, str(src))
    np.savez(npz, **{f"0/{k}": v for k, v in feeds(m, n=1)[0].items()})
    assert main([str(a) for a in ("compress", src, "-o", out, "--target", "cosine>=0.999", "--feeds", npz)]) == 0
    printed = capsys.readouterr().out
    assert "note       target met on 1 feed(s) only" in printed
    assert "pass 16 or more representative feeds" in printed


def test_a_high_top1_target_on_few_feeds_also_keeps_a_logit_snr_floor():
    """TieRisk judges held-out flips from the calibration decisions' margin errors: on one or two decisions
    that said little (open_nsfw, top1>=0.99 on one feed: 0.979 on all 48); the raised TOP1_SNR_DB floor holds too."""
    from modelgen import conv_model

    m = conv_model()
    out, record = passes.compress(m, target="top1>=0.99", feeds=feeds(m, n=2))
    floor = auto.TOP1_SNR_DB - 10 * np.log10(auto.FEW_FEEDS_ERROR_SHARE)
    tie = [n for n in record["notes"] if "top-1 agreement held by" in n]
    assert tie and f"on 2 feed(s), a {floor:.3g} dB floor on the centred logits" in tie[0]
    out8, record8 = passes.compress(m, target="top1>=0.99", feeds=feeds(m, n=auto.FEW_FEEDS_NOTE))
    assert not _notes(record8, "dB floor on the centred logits")
