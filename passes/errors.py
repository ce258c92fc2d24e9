"""The exceptions of surgeon-compress.

Every problem the library detects in its inputs (a file, a model, an option) is raised as a
`SurgeonError` subclass with a one-line message that names the problem; the command prints that
line and exits non-zero. Anything else escaping the library is a bug.
"""


class SurgeonError(Exception):
    """Base class of every error surgeon-compress raises on bad input."""


class InvalidModelError(SurgeonError):
    """The input is not a valid ONNX model, or is one the passes cannot rewrite safely."""


class UnsupportedFormError(SurgeonError):
    """The requested weight form (bits, granularity, dtype, opset) cannot be produced for this model."""


class InvalidArgumentError(SurgeonError, ValueError):
    """An option or expression given by the caller is malformed or out of range."""


class FileAccessError(SurgeonError, OSError):
    """A file cannot be read or written: missing, exists without force, unwritable, disk full."""


class CorruptFileError(SurgeonError):
    """A packed file is damaged, truncated or not a packed file at all; nothing wrong is returned."""


class NewerFormatError(CorruptFileError):
    """A packed file was written by a newer format version than this reader understands."""


class LimitExceededError(SurgeonError):
    """A file declares sizes or counts beyond the limits set for this reader."""


class FidelityError(SurgeonError):
    """A compressed model does not meet the fidelity required of it (the CI gate failed).

    `result`: the passes.FidelityResult measured (None where the raiser had none); `failed`: the
    (Requirement, measured value) pairs that were not met, for a CI script to report without
    parsing the message."""

    def __init__(self, message: str, *, result=None, failed=()):
        super().__init__(message)
        self.result = result
        self.failed = list(failed)
