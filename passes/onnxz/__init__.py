"""The lossless stage: `.onnxz`, an entropy-coded pack of any ONNX file, restored byte for byte.

    stats = pack("model.onnx", "model.onnxz")     # the model and its external data files
    unpack("model.onnxz", "restored.onnx")        # byte for byte (whole-file XXH3-128 checked)
    model = load("model.onnxz")                   # ModelProto, in memory
    with open_packed("model.onnxz") as pm:        # lazy: decodes one tensor's chunks only
        w = pm.get_tensor(pm.keys()[0])
    verify("model.onnxz", against="model.onnx")
    model = load(downloaded_bytes)                # the pack already in memory: bytes, mmap, ndarray
    with PackedFile("model.onnxz") as pf:         # the file layer: raw payloads, whole files
        payload = pf.tensor_bytes("conv1.weight")  # uint8, exactly as in the original file
        onnx_bytes = pf.restore_file(0)            # the model file (whole-file digest checked)

The file format is FORMAT.md at the top of the repository. Damaged, truncated or foreign files
raise CorruptFileError (NewerFormatError for newer formats), declared sizes beyond the limits
LimitExceededError; nothing wrong is ever returned.
"""
from .reader import PackedFile, PackedModel, VerifyResult, load, open_packed, unpack, verify
from .writer import PackStats, pack

__all__ = ["pack", "unpack", "load", "open_packed", "verify", "PackStats", "PackedFile", "PackedModel", "VerifyResult"]
