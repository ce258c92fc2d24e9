"""The GPU path of mode="fold" (CUDAExecutionProvider, onnxruntime-gpu: extra `[gpu]`).

Two ways to get float weights into device memory:
- gpu_fold="host" (default): fold on the CPU (`runtime_fold`), onnxruntime uploads each float
  weight at session creation; host memory holds each float weight briefly.
- gpu_fold="device": the int8 weights are uploaded and the constant DequantizeLinear nodes run
  once on the device, in a small session of their own whose outputs are bound to device memory;
  the resulting device OrtValues become the main session's initializers (`add_initializer`, no
  copy). Host memory never holds the float weights; the host->device transfer is 4x smaller.

NOT RUN ON A GPU: this machine has none. The code follows onnxruntime's documented io_binding
and add_initializer APIs; the tests that exercise it skip where CUDAExecutionProvider is absent.
"""
from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from .runtime_feed import PLACEHOLDER_LOCATION, SplitModel

log = logging.getLogger("passes.runtime")


_ELEM_TYPES = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
               "tensor(bfloat16)": TensorProto.BFLOAT16}


def _device_placeholder(name: str, elem_type: int, shape) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type = name, elem_type
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    for key, value in (("location", PLACEHOLDER_LOCATION), ("offset", "0"), ("length", str(size))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def fold_on_device(split: SplitModel, providers, provider_options=None) -> dict:
    """Run the constant DequantizeLinear nodes on the device; returns {name: device OrtValue} and
    rewrites `split` (nodes removed, placeholders declared, integer arrays dropped)."""
    from .runtime_fold import _consumer_counts

    inits = split.initializer_names()
    nodes = [n for n in split.skeleton.graph.node
             if n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx")
             and all((not i) or i in inits for i in n.input) and n.input[0] in split.weights]
    if not nodes:
        return {}
    opset = [o for o in split.skeleton.opset_import if o.domain in ("", "ai.onnx")]
    outputs, used = [], []
    for n in nodes:
        scale = split.array(n.input[1])
        outputs.append(helper.make_tensor_value_info(n.output[0], helper.np_dtype_to_tensor_dtype(scale.dtype), None))
        used.extend(i for i in n.input if i)
    needed = sorted(set(used))
    graph_inits = [t for t in split.skeleton.graph.initializer if t.name in needed]
    graph = helper.make_graph(list(nodes), "fold_on_device", [], outputs)
    for t in graph_inits:
        graph.initializer.append(t)
    model = helper.make_model(graph, opset_imports=opset or [helper.make_opsetid("", 21)])
    model.ir_version = split.skeleton.ir_version
    options = ort.SessionOptions()
    fed = [n for n in needed if n in split.weights]
    options.add_external_initializers(fed, [ort.OrtValue.ortvalue_from_numpy(split.weights[n]) for n in fed])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers,
                                   provider_options=provider_options)
    binding = session.io_binding()
    for o in outputs:
        binding.bind_output(o.name, "cuda")
    session.run_with_iobinding(binding)
    values = dict(zip([o.name for o in outputs], binding.get_outputs()))
    del session
    # the main graph: DequantizeLinear nodes gone, their outputs declared as device initializers
    done = {n.output[0] for n in nodes}
    keep = [n for n in split.skeleton.graph.node if not (n.output and n.output[0] in done)]
    del split.skeleton.graph.node[:]
    split.skeleton.graph.node.extend(keep)
    for name, value in values.items():
        elem = _ELEM_TYPES[value.data_type()]
        split.skeleton.graph.initializer.append(_device_placeholder(name, elem, value.shape()))
    counts = _consumer_counts(split.skeleton.graph)
    for name in needed:
        if counts.get(name, 0) == 0:
            split.remove_initializer(name)
    log.info("passes.InferenceSession: %d weights dequantized on the device", len(values))
    return values
