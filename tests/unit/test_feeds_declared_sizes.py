"""load_feeds checks the sizes the .npz's array headers declare before numpy allocates them: a crafted
header declaring 10^11 float32 values in a 256-byte entry gave a bare MemoryError (373 GiB)."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from passes import fidelity as F
from passes.errors import InvalidArgumentError
from tools.surgeon_compress import main


def _crafted(path, shape=(100_000_000_000,), held=256, version=(1, 0)):
    buf = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    if version == (1, 0):
        np.lib.format.write_array_header_1_0(buf, header)
    else:
        np.lib.format.write_array_header_2_0(buf, header)
    buf.write(b"\0" * held)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("0/x.npy", buf.getvalue())
    return path


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_a_header_declaring_more_than_its_entry_holds_is_refused(tmp_path, version):
    path = _crafted(tmp_path / "huge.npz", version=version)
    with pytest.raises(InvalidArgumentError, match=r"array '0/x' declares shape \[100000000000\] float32 "
                                                   r"\(400,000,000,000 bytes\) but its entry holds 256 bytes"):
        F.load_feeds(path)


def test_max_bytes_bounds_the_declared_total(tmp_path):
    path = tmp_path / "f.npz"
    np.savez(path, **{"0/x": np.zeros((4, 64), np.float32), "1/x": np.zeros((4, 64), np.float32)})
    assert len(F.load_feeds(path, max_bytes=2048)) == 2  # 2 x 1024 bytes: at the bound
    with pytest.raises(InvalidArgumentError, match=r"declare more than 2,047 bytes \(--max-bytes\)"):
        F.load_feeds(path, max_bytes=2047)


def test_arrays_that_do_not_fit_in_memory_are_an_invalid_argument(tmp_path, monkeypatch):
    path = tmp_path / "f.npz"
    np.savez(path, x=np.zeros(8, np.float32))

    def no_memory(self, key):
        raise MemoryError("Unable to allocate")

    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", no_memory)
    with pytest.raises(InvalidArgumentError, match=r"the feeds' arrays \(32 bytes\) do not fit in memory"):
        F.load_feeds(path)


def test_the_command_says_so_in_one_line(tmp_path, capsys):
    from onnx import TensorProto, helper, numpy_helper
    import onnx

    w = np.ones((64, 32), np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
                              [numpy_helper.from_array(w, "W")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    code = main(["eval", str(model), str(model), "--feeds", str(_crafted(tmp_path / "huge.npz"))])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "declares shape [100000000000]" in err
    np.savez(tmp_path / "ok.npz", **{"0/x": np.ones((1, 64), np.float32)})
    code = main(["compress", str(model), "-o", str(tmp_path / "o.onnx"), "--feeds", str(tmp_path / "ok.npz"),
                 "--max-bytes", "100"])
    assert code == 1 and "declare more than 100 bytes (--max-bytes)" in capsys.readouterr().err
