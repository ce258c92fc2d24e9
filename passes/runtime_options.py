"""Private copies of a caller's onnxruntime SessionOptions.

The runtime adds initializers and config entries to the options it creates a session with; doing
that on the caller's object would leave our buffers referenced from it (and break its next use),
so the caller's options are copied. onnxruntime offers no copy and no way to list config entries:
the public attributes are copied, and the config entries among the keys onnxruntime documents
(onnxruntime_session_options_config_keys.h) that are set. Custom-op libraries and
`add_provider_for_devices` registrations cannot be read back and are not carried over.
"""
from __future__ import annotations

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


def copy_session_options(source: ort.SessionOptions | None) -> ort.SessionOptions:
    """A new SessionOptions carrying `source`'s settings; `source` is not touched."""
    options = ort.SessionOptions()
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


class OptionsDraft:
    """The SessionOptions a load will create its session with, copied from the caller's only when
    the load adds something to them (`build`).

    Copying costs ~1.3 ms (a config look-up per known key, each unset one raising in
    onnxruntime's binding), on the main thread before onnxruntime can start; a load that adds no
    config entry, no thread count and no initializer (a float16 model folded here on a CPU: its
    weights travel inside the model bytes) gives onnxruntime the caller's options as they are, as
    onnxruntime's own class does (which copies them itself). Config entries added to the draft
    are kept in order and applied to the copy."""

    def __init__(self, source: ort.SessionOptions | None, threads: int | None = None):
        if source is not None and not isinstance(source, ort.SessionOptions):
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(f"sess_options must be an onnxruntime.SessionOptions, got {type(source).__name__}")
        self.source = source
        self.threads = threads
        self.entries: dict = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self.entries[key] = value

    def build(self, private: bool = False) -> ort.SessionOptions:
        """The options to create the session with: a copy carrying the added settings, or (nothing
        added and not `private`: the caller adds no initializer to them) the caller's own."""
        if not (private or self.entries or self.threads):
            return self.source if self.source is not None else ort.SessionOptions()
        options = copy_session_options(self.source)
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
