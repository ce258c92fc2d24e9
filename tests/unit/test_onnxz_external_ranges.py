"""passes.load of a pack checks its external tensors' ranges as the .onnx path does: many
tensors naming one range, a malformed offset / length and a negative offset are refused
with InvalidModelError, not given a copy each, a bare ValueError or an empty tensor."""
from __future__ import annotations

import pytest

import passes
import passes.onnxz
from onnxz_helpers import external_ranges_model, external_ranges_packed
from passes.errors import InvalidModelError


def test_many_tensors_naming_one_range_are_refused_from_the_pack_as_from_the_onnx(tmp_path):
    size = 2 << 20
    src, packed = external_ranges_packed(tmp_path, [("0", str(size))] * 40, size)  # 80 MiB read from a 2 MiB file
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match="external data ranges overlap"):
            passes.load(path)


def test_a_few_tensors_sharing_a_range_still_load(tmp_path):
    size = 64 << 10
    src, packed = external_ranges_packed(tmp_path, [("0", str(size))] * 3, size)
    a, b = passes.load(src), passes.load(packed)
    assert [t.raw_data for t in a.graph.initializer] == [t.raw_data for t in b.graph.initializer]
    assert len(b.graph.initializer[2].raw_data) == size


@pytest.mark.parametrize("offset,length,match", [
    ("abc", "4096", "'W1' has a malformed external data offset or length"),
    ("0", "x1", "'W1' has a malformed external data offset or length"),
    ("-8", "4096", r"declares external data bytes -8\.\.4088"),
    ("4096", "4096", r"declares external data bytes 4096\.\.8192 but 'w.bin' holds 4096"),
])
def test_a_bad_range_is_an_invalid_model_from_the_pack_as_from_the_onnx(tmp_path, monkeypatch, offset, length, match):
    src, packed = external_ranges_packed(tmp_path, [("0", "4096"), (offset, length)], 4096, monkeypatch)
    for path in (src, packed):
        with pytest.raises(InvalidModelError, match=match):
            passes.load(path)


@pytest.mark.parametrize("offset,length", [("abc", "4096"), ("0", "x1")])
def test_pack_refuses_a_malformed_range(tmp_path, offset, length):
    """It skipped the tensor, and with it the data file only that tensor named: the pack then
    restored the model without its data."""
    src = external_ranges_model(tmp_path, [(offset, length)], 4096)
    with pytest.raises(InvalidModelError, match="'W0' has a malformed external data offset or length"):
        passes.onnxz.pack(src, tmp_path / "p.onnxz")
    assert not (tmp_path / "p.onnxz").exists()
