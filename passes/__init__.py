"""surgeon-compress: lossy and lossless compression of ONNX models as ONNX graph passes.

The library API. Each pass is a function from model to model that never modifies its input,
returns a model that passes `onnx.checker.check_model(full_check=True)`, and, when given a
`Report`, says what it changed.

    import passes
    q = passes.quantize_weights(model, bits=8)          # float weights -> int8 + DequantizeLinear
    d = passes.dedupe_initializers(model)               # byte-identical weights stored once (lossless)
    f = passes.fold_dequantize(q, dtype="float16")      # back to float weights, at load time
    passes.pack(q, "model.onnxz")                       # lossless entropy-coded file
    m = passes.load("model.onnxz")                      # the .onnx back, byte for byte

Names are imported lazily so that `import passes` (and the command's start) stays fast.
"""
from __future__ import annotations

import importlib

from .errors import (
    CorruptFileError,
    FidelityError,
    FileAccessError,
    InvalidArgumentError,
    InvalidModelError,
    LimitExceededError,
    NewerFormatError,
    SurgeonError,
    UnsupportedFormError,
)
from .report import Report, TensorChange

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "quantize_weights": "quantize",
    "fold_dequantize": "fold",
    "quantize_with_feedback": "gptq",
    "correct_bias": "bias_correction",
    "load_feeds": "fidelity",
    "evaluate": "fidelity",
    "enforce": "fidelity",
    "parse_requirement": "fidelity",
    "parse_requirements": "fidelity",
    "run_outputs": "fidelity",
    "FidelityResult": "fidelity",
    "Requirement": "fidelity",
    "synthesize_feeds": "fidelity",
    "runnable_feeds": "fidelity",
    "describe_model": "inspect",
    "pack": "onnxz",
    "unpack": "onnxz",
    "load": "onnxz",
    "open_packed": "onnxz",
    "verify": "onnxz",
    "InferenceSession": "runtime",
    "compress": "auto",
    "palettize": "palette",
    "fold_palettes": "palette",
    "dedupe_initializers": "dedupe",
    "encode_array": "tensorcodec",
    "decode_array": "tensorcodec",
    "load_model": "_fileio",
    "save_model": "_fileio",
}

# a list literal added to the lazy names, so that linters see the eagerly imported names exported
__all__ = list(_LAZY) + [
    "CorruptFileError", "FidelityError", "FileAccessError", "InvalidArgumentError",
    "InvalidModelError", "LimitExceededError", "NewerFormatError", "SurgeonError",
    "UnsupportedFormError", "Report", "TensorChange",
]
__all__.sort()


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'passes' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
