"""Small generated ONNX models for unit tests (importable by any test module).

Every builder takes the weight dtype ("float32", "float16", "bfloat16") and an opset, uses a
fixed seed, and returns a checked ModelProto whose graph input "x" (or "ids") is float32 /
int64 and whose output "y" has the weight dtype. `feeds(model)` gives matching inputs.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

DTYPES = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
    "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
}


def _rng(seed=0):
    return np.random.default_rng(seed)


def weight(shape, dtype="float32", seed=0, scale=None):
    """Weights with per-channel spread (like trained layers): rows of different magnitude."""
    rng = _rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    w *= scale if scale is not None else 1.0 / np.sqrt(fan_in)
    if len(shape) > 1:
        w *= rng.uniform(0.3, 2.0, size=(shape[0],) + (1,) * (len(shape) - 1)).astype(np.float32)
    return w.astype(DTYPES[dtype][0])


def tensor(name, arr):
    if arr.dtype == ml_dtypes.bfloat16:
        t = TensorProto()
        t.name, t.data_type = name, TensorProto.BFLOAT16
        t.dims.extend(arr.shape)
        t.raw_data = arr.tobytes()
        return t
    return onnx.numpy_helper.from_array(arr, name)


def _model(nodes, inputs, outputs, inits, opset, ir=None):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="modelgen")
    m.ir_version = ir or max(7, helper.find_min_ir_version_for(list(m.opset_import), True))
    m.doc_string = "test model"
    helper.set_model_props(m, {"origin": "modelgen"})
    onnx.checker.check_model(m, full_check=True)
    return m


def _io_cast(dtype, x_name="x", to_name="xc"):
    """Cast of the float32 input to the weight dtype (so runs feed float32 everywhere)."""
    return helper.make_node("Cast", [x_name], [to_name], to=DTYPES[dtype][1])


def conv_model(dtype="float32", opset=13, in_constant=False):
    """x[1,8,10,10] -> Conv(W[16,8,3,3], B) -> ConvTranspose(W2[16,4,3,3]) -> y."""
    t = DTYPES[dtype][1]
    w = weight((16, 8, 3, 3), dtype, 1)
    b = weight((16,), dtype, 2, 0.1)
    w2 = weight((16, 4, 3, 3), dtype, 3)
    nodes = [_io_cast(dtype)]
    inits = []
    if in_constant:
        nodes += [helper.make_node("Constant", [], ["W"], value=tensor("W", w)),
                  helper.make_node("Constant", [], ["B"], value=tensor("B", b)),
                  helper.make_node("Constant", [], ["W2"], value=tensor("W2", w2))]
    else:
        inits = [tensor("W", w), tensor("B", b), tensor("W2", w2)]
    nodes += [helper.make_node("Conv", ["xc", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
              helper.make_node("ConvTranspose", ["c", "W2"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10, 10])],
                  [helper.make_tensor_value_info("y", t, [1, 4, 12, 12])], inits, opset)


def dense_model(dtype="float32", opset=13):
    """x[4,64] -> MatMul(W1[64,48]) -> Gemm(W2[48,32], transB=0) -> Gemm(W3[40,32], transB=1) -> y.

    W1 is also read by a second MatMul (shared weight)."""
    t = DTYPES[dtype][1]
    inits = [tensor("W1", weight((64, 48), dtype, 1)), tensor("W2", weight((48, 32), dtype, 2)),
             tensor("W3", weight((40, 32), dtype, 3)), tensor("C3", weight((40,), dtype, 4, 0.1))]
    nodes = [_io_cast(dtype),
             helper.make_node("MatMul", ["xc", "W1"], ["h1"]),
             helper.make_node("MatMul", ["xc", "W1"], ["h1b"]),
             helper.make_node("Add", ["h1", "h1b"], ["h1s"]),
             helper.make_node("Gemm", ["h1s", "W2"], ["h2"]),
             helper.make_node("Gemm", ["h2", "W3", "C3"], ["y"], transB=1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                  [helper.make_tensor_value_info("y", t, [4, 40])], inits, opset)


def gather_model(dtype="float32", opset=13):
    """ids[2,5] int64 -> Gather(E[100,40]) -> y (embedding rows)."""
    t = DTYPES[dtype][1]
    inits = [tensor("E", weight((100, 40), dtype, 5, 1.0))]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["y"], axis=0)]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
                  [helper.make_tensor_value_info("y", t, [2, 5, 40])], inits, opset)


def transpose_model(dtype="float32", opset=13):
    """x[4,32] -> MatMul(Transpose(W[24,32])) -> y: the axis must follow the Transpose."""
    t = DTYPES[dtype][1]
    inits = [tensor("W", weight((24, 32), dtype, 6))]
    nodes = [_io_cast(dtype), helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xc", "Wt"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                  [helper.make_tensor_value_info("y", t, [4, 24])], inits, opset)


def subgraph_model(dtype="float32", opset=13):
    """If(cond): then-branch MatMul with a Constant-node weight, else-branch with an initializer of
    the subgraph; a Loop (2 iterations) whose body multiplies by a Constant weight; the outer
    initializer W_OUT is read inside the then-branch (outer scope)."""
    t = DTYPES[dtype][1]
    w_then = weight((32, 32), dtype, 7)
    w_else = weight((32, 32), dtype, 8)
    w_loop = weight((32, 32), dtype, 9)
    w_out = weight((32, 32), dtype, 10)
    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["Wt"], value=tensor("Wt", w_then)),
         helper.make_node("MatMul", ["xc", "Wt"], ["t1"]),
         helper.make_node("MatMul", ["t1", "W_OUT"], ["then_out"])],
        "then", [], [helper.make_tensor_value_info("then_out", t, [4, 32])])
    else_g = helper.make_graph(
        [helper.make_node("MatMul", ["xc", "We"], ["else_out"])],
        "else", [], [helper.make_tensor_value_info("else_out", t, [4, 32])], [tensor("We", w_else)])
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["Wl"], value=tensor("Wl", w_loop)),
         helper.make_node("MatMul", ["v_in", "Wl"], ["v_mm"]),
         helper.make_node("Tanh", ["v_mm"], ["v_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", t, [4, 32])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", t, [4, 32])])
    nodes = [_io_cast(dtype),
             helper.make_node("If", ["cond"], ["branch"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Constant", [], ["trips"], value=helper.make_tensor("trips", TensorProto.INT64, [], [2])),
             helper.make_node("Constant", [], ["true"], value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
             helper.make_node("Loop", ["trips", "true", "branch"], ["y"], body=body)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32]),
                          helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                  [helper.make_tensor_value_info("y", t, [4, 32])], [tensor("W_OUT", w_out)], opset)


BUILDERS = {"conv": conv_model, "dense": dense_model, "gather": gather_model,
            "transpose": transpose_model, "subgraph": subgraph_model}


def listed_weights_model(ir_version: int = 6) -> onnx.ModelProto:
    """x[2, 64] -> MatMul W1[64, 256] + b1 -> Relu -> MatMul W2[256, 10] (opset 11), every
    initializer also a graph input (torch's keep_initializers_as_inputs=True)."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(64, 256)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(size=(256,)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(size=(256, 10)).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["hr"]), helper.make_node("MatMul", ["hr", "W2"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])] + [
        helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "listed", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = ir_version
    return m


def feeds(model, seed=0, n=2):
    """n input dicts for `model` (float32 normal values, int64 ids in range, both If branches)."""
    rng = _rng(seed)
    out = []
    for i in range(n):
        f = {}
        for v in model.graph.input:
            shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
            et = v.type.tensor_type.elem_type
            if et == TensorProto.INT64:
                f[v.name] = rng.integers(0, 100, size=shape).astype(np.int64)
            elif et == TensorProto.BOOL:
                f[v.name] = np.array(i % 2 == 0)
            else:
                f[v.name] = rng.standard_normal(shape).astype(np.float32)
        out.append(f)
    return out


def run(model, feed_list, optimize=True, matmulnbits_accuracy=None):
    """Output 0 per feed. matmulnbits_accuracy: onnxruntime's session.qdq_matmulnbits_accuracy_level
    for the DequantizeLinear+MatMul -> MatMulNBits fusion ("0": float compute; default 4: int8)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if matmulnbits_accuracy is not None:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(matmulnbits_accuracy))
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [sess.run(None, f)[0] for f in feed_list]


def cosine(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def initializer_array(model, name):
    """The value of main-graph initializer `name`."""
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def onnxruntime_value(model, name, shape, elem):
    """The value onnxruntime computes for tensor `name` of a one-input model (made a graph output,
    the input fed zeros): what a folded weight must equal bit for bit."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info(name, elem, list(shape)))
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    inp = m.graph.input[0]
    x = np.zeros([d.dim_value for d in inp.type.tensor_type.shape.dim],
                 dtype=helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type))
    return s.run([name], {inp.name: x})[0]


def correlated_inputs(n, k, seed=0):
    """n activation rows of width k with correlated components (a Hessian x'x far from diagonal,
    where error feedback has something to exploit)."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    return rng.standard_normal((n, k)) @ mix
