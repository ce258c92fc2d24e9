"""Private copies of a caller's onnxruntime SessionOptions.

The runtime adds initializers and config entries to the options it creates a session with; doing
that on the caller's object would leave our buffers referenced from it (and break its next use),
so the caller's options are copied. onnxruntime offers no copy and no way to list config entries:
the public attributes are copied, and the config entries among the keys onnxruntime documents
(onnxruntime_session_options_config_keys.h) that are set. Custom-op libraries and
`add_provider_for_devices` registrations cannot be read back and are not carried over: the
libraries a model needs are named to the copy (`custom_op_libraries`, registered on it), and a
session that fails for an op of a domain onnxruntime does not build in is explained by
`custom_op_hint`.
"""
from __future__ import annotations

import os
import re

import onnxruntime as ort

_ATTRIBUTES = (
    "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "enable_profiling",
    "execution_mode", "execution_order", "graph_optimization_level", "inter_op_num_threads",
    "intra_op_num_threads", "log_severity_level", "log_verbosity_level", "logid",
    "optimized_model_filepath", "profile_file_prefix", "use_deterministic_compute",
)

KNOWN_CONFIG_KEYS = (
    "session.disable_prepacking", "session.use_env_allocators", "session.load_model_format",
    "session.save_model_format", "session.set_denormal_as_zero", "session.disable_quant_qdq",
    "session.disable_double_qdq_remover", "session.enable_quant_qdq_cleanup",
    "session.qdq_matmulnbits_accuracy_level", "session.disable_aot_function_inlining",
    "session.qdqisint8allowed", "session.x64quantprecision", "session.intra_op.allow_spinning",
    "session.inter_op.allow_spinning", "session.use_device_allocator_for_initializers",
    "session.intra_op_thread_affinities", "session.dynamic_block_base", "session.force_spinning_stop",
    "session.strict_shape_type_inference", "session.allow_released_opsets_only",
    "session.node_partition_config_file", "session.disable_cpu_ep_fallback",
    "session.graph_optimizations_loop_level", "session.disable_model_compile",
    "session.use_per_session_threads",
    "optimization.enable_gelu_approximation", "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination", "optimization.minimal_build_optimizations",
    "mlas.enable_gemm_fastmath_arm64_bfloat16", "mlas.use_kleidiai",
    "ep.context_enable", "ep.context_file_path", "ep.context_embed_mode", "ep.context_node_name_prefix",
    "ep.share_ep_contexts", "ep.stop_share_ep_contexts",
    "session.record_ep_graph_assignment_info",
)


# operator domains onnxruntime builds in; any other domain's ops come from a custom-op library
BUILT_IN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
                              "com.microsoft", "com.microsoft.nchwc", "com.microsoft.dml", "com.ms.internal.nhwc",
                              "com.microsoft.mlfeaturizers", "org.pytorch.aten", "com.microsoft.extensions"})


def custom_op_library_paths(libraries) -> tuple:
    """`libraries` (None, a path, or a list of paths to shared libraries with onnxruntime's
    RegisterCustomOps entry point, e.g. onnxruntime_extensions.get_library_path()) as a tuple of
    str; InvalidArgumentError for anything else or a file that does not exist."""
    from .errors import InvalidArgumentError

    if libraries is None:
        return ()
    if isinstance(libraries, (str, os.PathLike)):
        libraries = [libraries]
    try:
        paths = tuple(os.fspath(p) for p in libraries)
    except TypeError:
        raise InvalidArgumentError(f"custom_op_libraries must be a path or a list of paths to custom-op shared "
                                   f"libraries, got {libraries!r}") from None
    for path in paths:
        if not os.path.isfile(path):
            raise InvalidArgumentError(f"custom_op_libraries: {path} is not a file")
    return paths


def copy_session_options(source: ort.SessionOptions | None, custom_op_libraries=()) -> ort.SessionOptions:
    """A new SessionOptions carrying `source`'s settings, with `custom_op_libraries` (paths, see
    custom_op_library_paths) registered on it; `source` is not touched."""
    options = ort.SessionOptions()
    register_custom_op_libraries(options, custom_op_libraries)
    if source is None:
        return options
    if not isinstance(source, ort.SessionOptions):
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"sess_options must be an onnxruntime.SessionOptions, got {type(source).__name__}")
    for name in _ATTRIBUTES:
        try:
            setattr(options, name, getattr(source, name))
        except (AttributeError, TypeError, RuntimeError):
            pass  # attribute absent in this onnxruntime version
    for key in KNOWN_CONFIG_KEYS:
        value = config_entry(source, key)
        if value is not None:
            options.add_session_config_entry(key, value)
    return options


def register_custom_op_libraries(options: ort.SessionOptions, libraries) -> None:
    """Register `libraries` (see custom_op_library_paths) on `options` (our own copy)."""
    for path in custom_op_library_paths(libraries):
        try:
            options.register_custom_ops_library(path)
        except Exception as exc:  # onnxruntime: a bare RuntimeError / Fail naming the library
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"custom_op_libraries: onnxruntime cannot register {path}: "
                                       f"{str(exc).splitlines()[0]}") from None


class OptionsDraft:
    """The SessionOptions a load will create its session with, copied from the caller's only when
    the load adds something to them (`build`).

    Copying costs ~1.3 ms (a config look-up per known key, each unset one raising in
    onnxruntime's binding), on the main thread before onnxruntime can start; a load that adds no
    config entry, no thread count and no initializer (a float16 model folded here on a CPU: its
    weights travel inside the model bytes) gives onnxruntime the caller's options as they are, as
    onnxruntime's own class does (which copies them itself). Config entries added to the draft
    are kept in order and applied to the copy."""

    def __init__(self, source: ort.SessionOptions | None, threads: int | None = None, custom_op_libraries=()):
        if source is not None and not isinstance(source, ort.SessionOptions):
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"sess_options must be an onnxruntime.SessionOptions, got {type(source).__name__}")
        self.source = source
        self.threads = threads
        # (registered on the copy; the caller's own options are never given them: always a copy)
        self.libraries = custom_op_library_paths(custom_op_libraries)
        self.entries: dict = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self.entries[key] = value

    def build(self, private: bool = False) -> ort.SessionOptions:
        """The options to create the session with: a copy carrying the added settings, or (nothing
        added and not `private`: the caller adds no initializer to them) the caller's own."""
        if not (private or self.entries or self.threads or self.libraries):
            return self.source if self.source is not None else ort.SessionOptions()
        options = copy_session_options(self.source)
        register_custom_op_libraries(options, self.libraries)
        if self.threads:
            options.intra_op_num_threads = self.threads
        for key, value in self.entries.items():
            options.add_session_config_entry(key, value)
        return options


def config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except Exception:  # onnxruntime raises a bare RuntimeError/Fail for a key that is not set
        return None


# onnxruntime's message for a node whose op it does not know: "<domain>:<op>(<opset>) is not a
# registered function/op"
_UNKNOWN_OP = re.compile(r"([\w.\-]+):([\w.\-]+)\(-?\d+\) is not a registered function/op")


def custom_op_hint(error: str, libraries=()) -> str:
    """What to add to onnxruntime's message `error` when a session could not be created because a
    node's op is unknown to it and its domain is not one onnxruntime builds in (a custom op): how
    to give the library that implements it ("" for any other error). SessionOptions' own
    registrations cannot be read back (see the module docstring), so a private copy needs them named."""
    found = _UNKNOWN_OP.search(error)
    if found is None or found.group(1) in BUILT_IN_DOMAINS:
        return ""
    given = f"; the libraries given ({', '.join(libraries)}) do not provide it" if libraries else ""
    return (f" (custom op {found.group(2)} of domain {found.group(1)!r}{given}: pass custom_op_libraries=[path, ...] "
            f"to passes.InferenceSession, e.g. onnxruntime_extensions.get_library_path(); a library registered on "
            f"the caller's SessionOptions is not carried over to the private copy this load makes)")
