"""Models shaped like what users ship now, which no wheel in bench/unseen.py is (built here).

Each is made with onnx.helper from real trained weights (the corpus's MiniLM export, rows and
layers picked out of it), not random draws, so that the quantizers see realistic distributions:

- dec_fp32: a two-layer decoder-only transformer as optimum / torch.onnx export it: input_ids,
  attention_mask over past + new tokens, position_ids, past_key_values.{i}.key/value inputs and
  present.{i}.* outputs (Concat on the sequence axis), rotary cos/sin tables as initializers
  gathered by position, RMSNorm from primitives, SwiGLU MLP, a causal mask initializer holding
  -inf plus the padding mask at finfo.min, and the output projection tied to the embedding
  (Gather + Transpose -> MatMul on one initializer).
- dec_fp16: the same in float16 with float32 islands (the norms, the softmax and the rotary tables
  run in float32 between Casts, as mixed-precision exports keep them).
- dec_bf16: the weights stored bfloat16 behind Casts to float (onnxruntime's CPU kernels have no
  bfloat16 MatMul, so exports for it keep the master weights that way).
- dec_extdata: dec_fp32 with its weights in several external files: every large tensor in a file
  of its own, the small ones packed at offsets into a shared file in a subfolder.
- dec_qdq: dec_fp32 through onnxruntime's static QDQ quantizer (int8 weights per channel, int8
  activations): compress must not quantize again what is quantized, fold must leave the
  activations' QuantizeLinear/DequantizeLinear pairs alone.
- dec_nbits: dec_fp32 with its MatMuls replaced by com.microsoft MatMulNBits (4 bits, blocks of
  32 along K, uint8 zero points), as onnxruntime-genai ships int4 LLMs.
- minilm_ortopt / minilm_ortopt16: the corpus's MiniLM through onnxruntime's transformer optimizer
  (com.microsoft SkipLayerNormalization / BiasGelu), and that converted to float16 with float32
  inputs and outputs, as HF repositories ship model_optimized.onnx / model_O4.onnx.
- legacy_op11 / legacy_op13: a small conv net whose weights sit in Constant nodes (no
  initializers), already partly quantized per tensor by DequantizeLinear at opset 11 (scalar scale
  and zero point, no axis attribute) and per channel at opset 13 (axis attribute), as
  2019-2021 exporters and quantizers left them.
- dec_qdq16 / dec_qdq_w4: dec_fp32 through the same quantizer with int16 activations (raised to
  opset 21) and with int4 weights (com.microsoft QuantizeLinear / DequantizeLinear at opset 18).
- dec_gqa / dec_mha: the decoder as onnxruntime-genai's builder writes it on contrib ops
  (SkipSimplifiedLayerNormalization; GroupQueryAttention with rotary inside and 2 key/value heads,
  or RotaryEmbedding + MultiHeadAttention); dec_mha_pertensor: dec_mha saved by onnx with every
  tensor over 64 bytes in a file of its own (size_threshold, names sanitised to uuids by onnx);
  dec_gqa16: dec_gqa through onnxruntime's float16 converter (float32 inputs / outputs; its Casts
  leave the graph unsorted); dec_gqa_nbits: dec_gqa with MatMulNBits (genai's int4 CPU models);
  dec_gqa_packed: dec_gqa with one packed q|k|v MatMul per layer (GroupQueryAttention's key and
  value inputs empty); dec_mha16: dec_mha through the float16 converter (float32 inputs / outputs).
- bert_fused: a BERT as onnxruntime's optimizer fuses it when attention fusion works
  (EmbedLayerNormalization, Attention with packed QKV weights, SkipLayerNormalization, BiasGelu).
- opset23 (int4 blocks, float8 e4m3fn, bfloat16 weights), loops (weights inside Scan / Loop
  bodies and read from the outer graph by a body), shared_output / shared_output_ir3 (one weight
  read by a MatMul and a Gemm and also a graph output; at IR 3 listed as an input too): small
  shapes with random weights.

    python bench/unseen_shapes.py OUT_FOLDER   # writes OUT_FOLDER/NAME/NAME.onnx (+ data files)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CORPUS = Path(os.environ.get("SURGEON_CORPUS", "/work/shared/corpus"))

HIDDEN, HEADS, LAYERS, VOCAB, FFN, MAX_POS = 384, 6, 2, 2048, 1536, 256
HEAD_DIM = HIDDEN // HEADS
F, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


def _minilm() -> dict[str, np.ndarray]:
    """The corpus's MiniLM weights by name (the source of every real weight here)."""
    m = onnx.load(str(CORPUS / "minilm_fp32" / "minilm_fp32.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _real_weights():
    """Weights for the decoder, cut from MiniLM's: 2048 embedding rows (ids 2000-4047), its
    attention and FFN matrices (gate and up from two different layers), its LayerNorm scales."""
    w = _minilm()
    square = [a for n, a in w.items() if a.shape == (HIDDEN, HIDDEN)]
    up = [a for n, a in w.items() if a.shape == (HIDDEN, FFN)]
    down = [a for n, a in w.items() if a.shape == (FFN, HIDDEN)]
    norms = [a for n, a in w.items() if n.endswith("LayerNorm.weight")]
    out = {"embed": w["m.embeddings.word_embeddings.weight"][2000:2000 + VOCAB].copy(),
           "final_norm": norms[-1].copy()}
    for i in range(LAYERS):
        q, k, v, o = square[4 * i:4 * i + 4]
        out.update({f"l{i}.q": q, f"l{i}.k": k, f"l{i}.v": v, f"l{i}.o": o,
                    f"l{i}.gate": up[i], f"l{i}.up": up[(i + 3) % len(up)], f"l{i}.down": down[i],
                    f"l{i}.norm1": norms[2 * i], f"l{i}.norm2": norms[2 * i + 1]})
    return out


def random_weights(hidden=64, ffn=128, vocab=256, layers=1, seed=0) -> dict[str, np.ndarray]:
    """Decoder weights drawn at random (unit tests: no corpus), in _real_weights' layout."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    out = {"embed": w(vocab, hidden) * np.sqrt(vocab / hidden), "final_norm": 1 + 0.1 * w(hidden)}
    for i in range(layers):
        out.update({f"l{i}.{k}": w(hidden, hidden) for k in "qkvo"})
        out.update({f"l{i}.gate": w(hidden, ffn), f"l{i}.up": w(hidden, ffn), f"l{i}.down": w(ffn, hidden),
                    f"l{i}.norm1": 1 + 0.1 * w(hidden), f"l{i}.norm2": 1 + 0.1 * w(hidden)})
    return out


def _rotary_tables(head_dim, max_pos):
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class _Builder:
    def __init__(self, dtype):
        self.dtype = dtype  # TensorProto elem type of the activations (FLOAT or FLOAT16)
        self.np = np.float16 if dtype == F16 else np.float32
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, hint):
        self.n += 1
        return f"/{hint}_{self.n}"

    def op(self, op_type, inputs, hint=None, outputs=None, **attrs):
        outs = outputs or [self.name(hint or op_type)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type + "_node"), **attrs))
        return outs[0] if len(outs) == 1 else outs

    def init(self, name, arr):
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def const_i64(self, values):
        return self.init(self.name("const"), np.asarray(values, np.int64))

    def cast(self, x, to):
        return self.op("Cast", [x], "cast", to=to)


def _rms_norm(b: _Builder, x, weight_name, weight, island):
    """RMSNorm from primitives; in a float16 model it runs in float32 (an island) and casts back."""
    if island:
        x = b.cast(x, F)
        b.init(weight_name, weight.astype(np.float32))
        eps = b.init(b.name("eps"), np.array(1e-6, np.float32))
        two = b.init(b.name("two"), np.array(2.0, np.float32))
    else:
        b.init(weight_name, weight.astype(b.np))
        eps = b.init(b.name("eps"), np.array(1e-6, b.np))
        two = b.init(b.name("two"), np.array(2.0, b.np))
    sq = b.op("Pow", [x, two])
    mean = b.op("ReduceMean", [sq, b.const_i64([-1])], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [mean, eps])])
    y = b.op("Mul", [b.op("Div", [x, rms]), weight_name])
    return b.cast(y, b.dtype) if island else y


def _rotate(b: _Builder, x, cos, sin, head_dim):
    """x * cos + rotate_half(x) * sin on [B, H, S, D] (cos/sin [B, 1, S, D])."""
    half = head_dim // 2
    x1 = b.op("Slice", [x, b.const_i64([0]), b.const_i64([half]), b.const_i64([3])])
    x2 = b.op("Slice", [x, b.const_i64([half]), b.const_i64([head_dim]), b.const_i64([3])])
    rot = b.op("Concat", [b.op("Neg", [x2]), x1], axis=3)
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rot, sin])])


def decoder(dtype=F, weights=None, heads=HEADS, max_pos=MAX_POS) -> onnx.ModelProto:
    """The optimum-style decoder (see the module docstring) with activations of `dtype`; sizes
    follow the weights (_real_weights or random_weights)."""
    w = weights or _real_weights()
    vocab, hidden = w["embed"].shape
    layers = sum(1 for k in w if k.endswith(".q"))
    head_dim = hidden // heads
    b = _Builder(dtype)
    island = dtype == F16
    cos, sin = _rotary_tables(head_dim, max_pos)
    b.init("model.rotary.cos_cached", cos if island else cos.astype(b.np))
    b.init("model.rotary.sin_cached", sin if island else sin.astype(b.np))
    neg = np.float32(-np.inf)
    causal = np.triu(np.full((max_pos, max_pos), neg, np.float32), 1)
    b.init("model.causal_mask", causal.astype(b.np))
    b.init("model.embed_tokens.weight", w["embed"].astype(b.np))

    h = b.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embed")
    # rotary tables gathered by position, [B, 1, S, D]; float32 in the float16 model's island
    cos_g = b.op("Unsqueeze", [b.op("Gather", ["model.rotary.cos_cached", "position_ids"]), b.const_i64([1])])
    sin_g = b.op("Unsqueeze", [b.op("Gather", ["model.rotary.sin_cached", "position_ids"]), b.const_i64([1])])
    if island:
        cos_g, sin_g = b.cast(cos_g, F16), b.cast(sin_g, F16)
    # masks: causal rows [past, past + S) of the -inf table, columns [0, past + S), plus the padding
    # mask (1 - attention_mask) * finfo.min, as transformers builds it
    ids_shape = b.op("Shape", ["input_ids"])
    seq = b.op("Gather", [ids_shape, b.const_i64([1])], axis=0)
    total = b.op("Gather", [b.op("Shape", ["attention_mask"]), b.const_i64([1])], axis=0)
    past = b.op("Sub", [total, seq])
    causal_rows = b.op("Slice", ["model.causal_mask", past, total, b.const_i64([0])])
    causal_cut = b.op("Slice", [causal_rows, b.const_i64([0]), total, b.const_i64([1])])
    pad = b.op("Sub", [b.init(b.name("one"), np.array(1.0, b.np)), b.cast("attention_mask", dtype)])
    pad = b.op("Mul", [pad, b.init(b.name("finfo_min"), np.array(np.finfo(b.np).min, b.np))])
    pad = b.op("Unsqueeze", [pad, b.const_i64([1, 2])])  # [B, 1, 1, T]
    mask = b.op("Add", [pad, causal_cut])  # [B, 1, S, T]
    scale = b.init(b.name("scale"), np.array(1 / np.sqrt(head_dim), b.np))
    split_shape = b.const_i64([0, 0, heads, head_dim])
    merge_shape = b.const_i64([0, 0, hidden])
    outputs = []
    for i in range(layers):
        x = _rms_norm(b, h, f"model.layers.{i}.input_layernorm.weight", w[f"l{i}.norm1"], island)
        qkv = {}
        for part in ("q", "k", "v"):
            name = b.init(f"model.layers.{i}.self_attn.{part}_proj.weight.T", w[f"l{i}.{part}"].astype(b.np))
            y = b.op("Reshape", [b.op("MatMul", [x, name]), split_shape])
            qkv[part] = b.op("Transpose", [y], perm=[0, 2, 1, 3])
        q = _rotate(b, qkv["q"], cos_g, sin_g, head_dim)
        k = _rotate(b, qkv["k"], cos_g, sin_g, head_dim)
        k = b.op("Concat", [f"past_key_values.{i}.key", k], outputs=[f"present.{i}.key"], axis=2)
        v = b.op("Concat", [f"past_key_values.{i}.value", qkv["v"]], outputs=[f"present.{i}.value"], axis=2)
        outputs += [f"present.{i}.key", f"present.{i}.value"]
        scores = b.op("Add", [b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale]), mask])
        if island:  # softmax in float32
            probs = b.cast(b.op("Softmax", [b.cast(scores, F)], axis=-1), F16)
        else:
            probs = b.op("Softmax", [scores], axis=-1)
        ctx = b.op("Reshape", [b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), merge_shape])
        o = b.init(f"model.layers.{i}.self_attn.o_proj.weight.T", w[f"l{i}.o"].astype(b.np))
        h = b.op("Add", [h, b.op("MatMul", [ctx, o])])
        x = _rms_norm(b, h, f"model.layers.{i}.post_attention_layernorm.weight", w[f"l{i}.norm2"], island)
        gate = b.init(f"model.layers.{i}.mlp.gate_proj.weight.T", w[f"l{i}.gate"].astype(b.np))
        up = b.init(f"model.layers.{i}.mlp.up_proj.weight.T", w[f"l{i}.up"].astype(b.np))
        down = b.init(f"model.layers.{i}.mlp.down_proj.weight.T", (w[f"l{i}.down"] * 0.5).astype(b.np))
        g = b.op("MatMul", [x, gate])
        silu = b.op("Mul", [g, b.op("Sigmoid", [g])])
        h = b.op("Add", [h, b.op("MatMul", [b.op("Mul", [silu, b.op("MatMul", [x, up])]), down])])
    x = _rms_norm(b, h, "model.norm.weight", w["final_norm"], island)
    # tied output projection: the embedding read again through a Transpose
    tied = b.op("Transpose", ["model.embed_tokens.weight"], "lm_head_weight", perm=[1, 0])
    b.op("MatMul", [x, tied], outputs=["logits"])

    # optimum's names for the dynamic axes (the attention mask's and present's is a sum of two)
    batch, seq, past, total = "batch_size", "sequence_length", "past_sequence_length", \
        "past_sequence_length + sequence_length"
    kv = [helper.make_tensor_value_info(f"past_key_values.{i}.{p}", dtype, [batch, heads, past, head_dim])
          for i in range(layers) for p in ("key", "value")]
    inputs = [helper.make_tensor_value_info("input_ids", I64, [batch, seq]),
              helper.make_tensor_value_info("attention_mask", I64, [batch, total]),
              helper.make_tensor_value_info("position_ids", I64, [batch, seq])] + kv
    outs = [helper.make_tensor_value_info("logits", dtype, [batch, seq, vocab])] + [
        helper.make_tensor_value_info(n, dtype, [batch, heads, total, head_dim]) for n in outputs]
    g = helper.make_graph(b.nodes, "main_graph", inputs, outs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], producer_name="pytorch",
                          producer_version="2.5.0")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def decoder_feeds(rng, dtype=np.float32, n=4, vocab=VOCAB, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM) -> list[dict]:
    """Two sequences of 5 new tokens after 3 cached ones; the second left-padded by 2 (its padded
    positions' rows see only finfo.min and -inf, the way a batched generate() feeds them)."""
    out = []
    past, seq = 3, 5
    for _ in range(n):
        mask = np.ones((2, past + seq), np.int64)
        mask[1, :2] = 0
        pos = np.broadcast_to(np.arange(past, past + seq), (2, seq)).copy()
        f = {"input_ids": rng.integers(0, vocab, (2, seq)).astype(np.int64), "attention_mask": mask,
             "position_ids": pos}
        for i in range(layers):
            for p in ("key", "value"):
                f[f"past_key_values.{i}.{p}"] = rng.standard_normal((2, heads, past, head_dim)).astype(dtype)
        out.append(f)
    return out


def bfloat16_weights(m: onnx.ModelProto) -> onnx.ModelProto:
    """Every 2-D float weight stored bfloat16 behind a Cast to float."""
    import ml_dtypes
    m = onnx.ModelProto.FromString(m.SerializeToString())
    casts = []
    for t in list(m.graph.initializer):
        if t.data_type != F or len(t.dims) != 2 or "causal" in t.name:
            continue
        a = numpy_helper.to_array(t).astype(ml_dtypes.bfloat16)
        bf = TensorProto(name=t.name + ".bf16", data_type=TensorProto.BFLOAT16, dims=t.dims, raw_data=a.tobytes())
        m.graph.initializer.remove(t)
        m.graph.initializer.append(bf)
        casts.append(helper.make_node("Cast", [bf.name], [t.name], to=F, name="/cast_" + t.name))
    nodes = casts + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.checker.check_model(m, full_check=True)
    return m


def save_external_several(m: onnx.ModelProto, dst: Path, large: int = 65536) -> None:
    """Large tensors (>= `large` bytes) one file each (onnx's per-tensor layout, named after the tensor);
    the smaller float ones (norm scales, ...) at 64-byte-aligned offsets in data/small.bin (a
    subfolder); scalars and integer constants inline."""
    from onnx.external_data_helper import set_external_data
    m = onnx.ModelProto.FromString(m.SerializeToString())
    (dst.parent / "data").mkdir(parents=True, exist_ok=True)
    small = bytearray()
    for t in m.graph.initializer:
        raw = numpy_helper.to_array(t).tobytes()
        if len(raw) >= large:
            fname = t.name.replace("/", "_") + ".bin"
            (dst.parent / fname).write_bytes(raw)
            set_external_data(t, location=fname)
        elif t.data_type in (F, F16) and len(raw) >= 64:  # the norms' scales and other small ones
            small.extend(b"\0" * (-len(small) % 64))
            set_external_data(t, location="data/small.bin", offset=len(small), length=len(raw))
            small.extend(raw)
        else:
            continue
        t.ClearField("raw_data")
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
    (dst.parent / "data" / "small.bin").write_bytes(bytes(small))
    dst.write_bytes(m.SerializeToString())
    onnx.checker.check_model(str(dst), full_check=True)


def qdq(src: Path, dst: Path, feeds: list[dict], activations: str = "QInt8", weights: str = "QInt8") -> None:
    """onnxruntime's static quantizer, QDQ form, per-channel weights; int8 activations and weights
    unless told (QuantType names). 16-bit activations raise the model to opset 21 (onnx's int16
    QuantizeLinear); 4-bit weights below opset 21 get com.microsoft QuantizeLinear /
    DequantizeLinear nodes (int4 initializers), as the quantizer writes them."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType[activations], weight_type=QuantType[weights],
                    extra_options={"ActivationSymmetric": activations == "QInt8"})
    onnx.checker.check_model(str(dst), full_check=True)


def matmul_nbits(m: onnx.ModelProto, bits=4, block=32) -> onnx.ModelProto:
    """Every MatMul whose B is a 2-D float initializer -> com.microsoft MatMulNBits (asymmetric
    4-bit blocks along K with packed uint8 zero points, as onnxruntime's quantizer writes them)."""
    m = onnx.ModelProto.FromString(m.SerializeToString())
    inits = {t.name: t for t in m.graph.initializer}
    readers = {}
    for n in m.graph.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    new_nodes = []
    for n in m.graph.node:
        t = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if t is None or len(t.dims) != 2 or t.data_type != F or readers[t.name] != 1:
            new_nodes.append(n)
            continue
        w = numpy_helper.to_array(t).astype(np.float32)  # [K, N]
        k, nn = w.shape
        blocks = -(-k // block)
        wp = np.zeros((blocks * block, nn), np.float32)
        wp[:k] = w
        wb = wp.T.reshape(nn, blocks, block)
        lo, hi = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1.0).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
        q = np.clip(np.round(wb / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # [N, blocks, block/2]
        zflat = zp.reshape(nn, blocks)
        if blocks % 2:
            zflat = np.concatenate([zflat, np.zeros((nn, 1), np.uint8)], 1)
        zpacked = (zflat[:, 0::2] | (zflat[:, 1::2] << 4)).astype(np.uint8).ravel()
        base = t.name
        m.graph.initializer.remove(t)
        m.graph.initializer.extend([numpy_helper.from_array(packed, base + "_Q4"),
                                    numpy_helper.from_array(scale.ravel(), base + "_scales"),
                                    numpy_helper.from_array(zpacked, base + "_zp")])
        new_nodes.append(helper.make_node("MatMulNBits", [n.input[0], base + "_Q4", base + "_scales", base + "_zp"],
                                          list(n.output), name=n.name + "_Q4", domain="com.microsoft",
                                          K=k, N=nn, bits=bits, block_size=block))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


def legacy(opset: int, square=None, bias=None) -> onnx.ModelProto:
    """A conv net with every weight in a Constant node. Opset 11: conv2 quantized per tensor
    (DequantizeLinear, scalar scale / zero point, no axis: the only form before 13). Opset 13:
    conv2 and the classifier quantized per channel (axis attribute), uint8 with zero points."""
    if square is None:  # MiniLM's attention matrices and a bias (random ones in the unit tests)
        w = _minilm()
        square = [a for n, a in w.items() if a.shape == (HIDDEN, HIDDEN)]
        bias = w["m.encoder.layer.0.attention.self.query.bias"]
    sq = square
    k1 = sq[0][:48, :27].reshape(48, 3, 3, 3) * 0.8  # 1296 values: past the quantizers' 1024 minimum
    k2 = sq[1].ravel()[:64 * 48 * 9].reshape(64, 48, 3, 3) * 0.5
    fc = sq[2][:64, :100].T.copy()  # [100, 64]
    bias1 = bias[:48]
    nodes = []

    def const(name, arr):
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr), name + "_v")))
        return name

    const("k1", k1.astype(np.float32))
    const("b1", bias1.astype(np.float32))
    if opset == 11:
        s = np.float32(np.abs(k2).max() / 127)
        const("k2_q", np.clip(np.round(k2 / s), -127, 127).astype(np.int8))
        const("k2_s", np.array(s, np.float32))
        const("k2_z", np.array(0, np.int8))
        nodes.append(helper.make_node("DequantizeLinear", ["k2_q", "k2_s", "k2_z"], ["k2"]))
        const("fc", fc.astype(np.float32))
    else:
        for name, arr in (("k2", k2), ("fc", fc)):
            lo = np.minimum(arr.reshape(arr.shape[0], -1).min(1), 0)
            hi = np.maximum(arr.reshape(arr.shape[0], -1).max(1), 0)
            s = ((hi - lo) / 255).astype(np.float32)
            z = np.clip(np.round(-lo / s), 0, 255).astype(np.uint8)
            bshape = (-1,) + (1,) * (arr.ndim - 1)
            q = np.clip(np.round(arr / s.reshape(bshape)) + z.reshape(bshape), 0, 255).astype(np.uint8)
            const(name + "_q", q)
            const(name + "_s", s)
            const(name + "_z", z)
            nodes.append(helper.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_z"], [name], axis=0))
    const("fc_b", np.linspace(-0.1, 0.1, 100, dtype=np.float32))
    nodes += [
        helper.make_node("Conv", ["image", "k1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "k2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fc_b"], ["logits"], transB=1),
    ]
    g = helper.make_graph(nodes, "torch-jit-export", [helper.make_tensor_value_info("image", F, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("logits", F, [1, 100])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="pytorch",
                          producer_version="1.8")
    m.ir_version = 6 if opset == 11 else 7
    onnx.checker.check_model(m, full_check=True)
    return m


def legacy_feeds(rng, n=4) -> list[dict]:
    return [{"image": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(n)]


def ort_optimized(dst: Path, float16: bool) -> None:
    """The corpus's MiniLM through onnxruntime.transformers' optimizer, as HF repos ship
    'model_optimized.onnx' / 'model_O3.onnx': com.microsoft SkipLayerNormalization and BiasGelu
    (their gamma / beta / bias are weights read by contrib ops); float16 converted with float32
    inputs and outputs (keep_io_types), as optimum's O4 level does."""
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(CORPUS / "minilm_fp32" / "minilm_fp32.onnx"), model_type="bert", num_heads=12,
                         hidden_size=384, opt_level=0)  # (its Python fusions only: opt_level >= 1 imports torch)
    if float16:
        opt.convert_float_to_float16(keep_io_types=True)
    opt.save_model_to_file(str(dst))


def corpus_text_feeds(n=4) -> list[dict]:
    """MiniLM's real feeds from the corpus (tokenised sentences), the first n."""
    d = np.load(CORPUS / "minilm_fp32" / "feeds.npz")
    return [{k.split("/", 1)[1]: d[k] for k in d.files if k.split("/")[0] == str(i)} for i in range(n)]


I32 = TensorProto.INT32


def contrib_decoder(w=None, heads=HEADS, kv_heads=2, attention="gqa", max_pos=MAX_POS,
                    packed_qkv=False) -> onnx.ModelProto:
    """A decoder as onnxruntime-genai's model builder writes it, on com.microsoft contrib ops:
    SkipSimplifiedLayerNormalization (RMSNorm with the residual add; the first layer's norm from
    primitives), attention="gqa": GroupQueryAttention with rotary inside (do_rotary, cos/sin caches
    [max_pos, head_dim / 2]), fewer key/value heads than query heads, seqlens_k = ReduceSum(mask) - 1
    and total_sequence_length = Shape(mask)[1] computed in the graph as the builder does;
    attention="mha": RotaryEmbedding on q and k, then MultiHeadAttention (unidirectional, past
    key/value in, present out; kv_heads must equal heads) fed position_ids. Opset 21, IR 10.
    packed_qkv (GroupQueryAttention only): one MatMul to q|k|v ([hidden, hidden + 2 kv_dim], rows
    of three projections in one weight) feeding the packed query input, key and value empty, as
    the builder writes it for Phi-3 / Llama exports with fused qkv_proj."""
    w = {k: np.asarray(v, np.float32) for k, v in (w or _real_weights()).items()}
    vocab, hidden = w["embed"].shape
    layers = sum(1 for k in w if k.endswith(".q"))
    head_dim = hidden // heads
    b = _Builder(F)
    cos, sin = _rotary_tables(head_dim, max_pos)
    b.init("cos_cache", cos[:, :head_dim // 2].copy())
    b.init("sin_cache", sin[:, :head_dim // 2].copy())
    b.init("model.embed_tokens.weight", w["embed"])
    h = b.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embed")
    summed = b.op("ReduceSum", [b.cast("attention_mask", I32), b.const_i64([1])], keepdims=0)
    seqlens_k = b.op("Sub", [summed, b.init(b.name("one"), np.array(1, np.int32))])
    total = b.cast(b.op("Gather", [b.op("Shape", ["attention_mask"]), b.init(b.name("i1"), np.array(1, np.int64))],
                        axis=0), I32)
    kv_dim = kv_heads * head_dim
    outputs, residual = [], None

    def skip_norm(x, skip, gamma_name, gamma):
        out = b.op("SkipSimplifiedLayerNormalization", [x, skip, b.init(gamma_name, gamma)],
                   outputs=[b.name("norm"), "", "", b.name("residual")], domain="com.microsoft", epsilon=1e-6)
        return out[0], out[3]

    for i in range(layers):
        if i == 0:
            x, residual = _rms_norm(b, h, f"model.layers.{i}.input_layernorm.weight", w[f"l{i}.norm1"], False), h
        else:
            x, residual = skip_norm(h, residual, f"model.layers.{i}.input_layernorm.weight", w[f"l{i}.norm1"])
        if packed_qkv:
            qkv = np.concatenate([w[f"l{i}.q"], w[f"l{i}.k"][:, :kv_dim], w[f"l{i}.v"][:, :kv_dim]], axis=1)
            q = b.op("MatMul", [x, b.init(f"model.layers.{i}.attn.qkv_proj.weight.T", qkv)])
            k = v = ""
        else:
            q = b.op("MatMul", [x, b.init(f"model.layers.{i}.attn.q_proj.weight.T", w[f"l{i}.q"])])
            k = b.op("MatMul", [x, b.init(f"model.layers.{i}.attn.k_proj.weight.T", w[f"l{i}.k"][:, :kv_dim].copy())])
            v = b.op("MatMul", [x, b.init(f"model.layers.{i}.attn.v_proj.weight.T", w[f"l{i}.v"][:, :kv_dim].copy())])
        past = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        present = [f"present.{i}.key", f"present.{i}.value"]
        if attention == "gqa":
            ctx = b.op("GroupQueryAttention", [q, k, v, *past, seqlens_k, total, "cos_cache", "sin_cache"],
                       outputs=[b.name("attn"), *present], domain="com.microsoft", num_heads=heads,
                       kv_num_heads=kv_heads, do_rotary=1)[0]
        else:
            q = b.op("RotaryEmbedding", [q, "position_ids", "cos_cache", "sin_cache"], domain="com.microsoft",
                     num_heads=heads)
            k = b.op("RotaryEmbedding", [k, "position_ids", "cos_cache", "sin_cache"], domain="com.microsoft",
                     num_heads=kv_heads)
            ctx = b.op("MultiHeadAttention", [q, k, v, "", "", "", *past], outputs=[b.name("attn"), *present],
                       domain="com.microsoft", num_heads=heads, unidirectional=1)[0]
        outputs += present
        o = b.op("MatMul", [ctx, b.init(f"model.layers.{i}.attn.o_proj.weight.T", w[f"l{i}.o"])])
        x, residual = skip_norm(o, residual, f"model.layers.{i}.post_attention_layernorm.weight", w[f"l{i}.norm2"])
        g = b.op("MatMul", [x, b.init(f"model.layers.{i}.mlp.gate_proj.weight.T", w[f"l{i}.gate"])])
        u = b.op("MatMul", [x, b.init(f"model.layers.{i}.mlp.up_proj.weight.T", w[f"l{i}.up"])])
        act = b.op("Mul", [b.op("Mul", [g, b.op("Sigmoid", [g])]), u])
        h = b.op("MatMul", [act, b.init(f"model.layers.{i}.mlp.down_proj.weight.T", w[f"l{i}.down"] * 0.5)])
    x, _ = skip_norm(h, residual, "model.norm.weight", w["final_norm"])
    b.op("MatMul", [x, b.init("lm_head.weight.T", w["embed"].T.copy())], outputs=["logits"])
    # genai's names: the mask's axis is total_sequence_length, not written as a sum
    batch, seq, past_len, total_len = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    inputs = [helper.make_tensor_value_info("input_ids", I64, [batch, seq]),
              helper.make_tensor_value_info("attention_mask", I64, [batch, total_len])]
    if attention != "gqa":
        inputs.append(helper.make_tensor_value_info("position_ids", I64, [batch, seq]))
    inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{p}", F, [batch, kv_heads, past_len, head_dim])
               for i in range(layers) for p in ("key", "value")]
    outs = [helper.make_tensor_value_info("logits", F, [batch, seq, vocab])] + [
        helper.make_tensor_value_info(n, F, [batch, kv_heads, total_len, head_dim]) for n in outputs]
    g = helper.make_graph(b.nodes, "main_graph", inputs, outs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                          producer_name="onnxruntime-genai")
    m.ir_version = 10
    return m


def contrib_feeds(rng, attention="gqa", n=4, vocab=VOCAB, layers=LAYERS, kv_heads=2, head_dim=HEAD_DIM) -> list[dict]:
    """5 new tokens after 3 cached ones; one sequence for GroupQueryAttention (its CPU kernel takes
    batch 1 when new tokens meet a past), two for MultiHeadAttention (with position_ids)."""
    past, seq = 3, 5
    batch = 1 if attention == "gqa" else 2
    out = []
    for _ in range(n):
        f = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64)}
        if attention != "gqa":
            f["position_ids"] = np.broadcast_to(np.arange(past, past + seq), (batch, seq)).copy()
        for i in range(layers):
            for p in ("key", "value"):
                f[f"past_key_values.{i}.{p}"] = rng.standard_normal((batch, kv_heads, past, head_dim)).astype(np.float32)
        out.append(f)
    return out


def float16_keep_io(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m` through onnxruntime.transformers' float16 converter with float32 inputs / outputs
    (keep_io_types), as optimum's O4 level writes it. On a model whose float inputs feed contrib
    ops (GroupQueryAttention's past key / value) it appends the inputs' Casts after their readers:
    the graph is not topologically sorted, which onnxruntime runs and onnx.checker refuses."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    return convert_float_to_float16(onnx.ModelProto.FromString(m.SerializeToString()), keep_io_types=True)


def bert_fused(w=None, heads=HEADS, max_pos=512) -> onnx.ModelProto:
    """A BERT encoder as onnxruntime.transformers' optimizer fuses it when attention fusion works:
    EmbedLayerNormalization (int32 ids through Casts, its mask_index output), com.microsoft
    Attention (q, k, v weights packed into one [H, 3H] initializer and bias [3H]),
    SkipLayerNormalization with a bias, BiasGelu. Opset 14."""
    w = {k: np.asarray(v, np.float32) for k, v in (w or _real_weights()).items()}
    vocab, hidden = w["embed"].shape
    layers = sum(1 for k in w if k.endswith(".q"))
    rng = np.random.default_rng(5)
    b = _Builder(F)

    def small(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    b.init("word_embeddings", w["embed"])
    b.init("position_embeddings", small(max_pos, hidden))
    b.init("token_type_embeddings", small(2, hidden))
    b.init("embeddings.LayerNorm.weight", w["final_norm"])
    b.init("embeddings.LayerNorm.bias", small(hidden))
    ids, segments, mask = (b.cast(n, I32) for n in ("input_ids", "token_type_ids", "attention_mask"))
    h, mask_index = b.op("EmbedLayerNormalization", [ids, segments, "word_embeddings", "position_embeddings",
                         "token_type_embeddings", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", mask],
                         outputs=[b.name("embedded"), b.name("mask_index")], domain="com.microsoft", epsilon=1e-12)
    for i in range(layers):
        p = f"encoder.layer.{i}."
        b.init(p + "attention.qkv.weight", np.concatenate([w[f"l{i}.q"], w[f"l{i}.k"], w[f"l{i}.v"]], axis=1))
        b.init(p + "attention.qkv.bias", small(3 * hidden))
        ctx = b.op("Attention", [h, p + "attention.qkv.weight", p + "attention.qkv.bias", mask_index],
                   domain="com.microsoft", num_heads=heads)
        o = b.op("MatMul", [ctx, b.init(p + "attention.output.dense.weight", w[f"l{i}.o"])])
        h = b.op("SkipLayerNormalization", [o, h, b.init(p + "attention.output.LayerNorm.weight", w[f"l{i}.norm1"]),
                 b.init(p + "attention.output.LayerNorm.bias", small(hidden)),
                 b.init(p + "attention.output.dense.bias", small(hidden))], domain="com.microsoft", epsilon=1e-12)
        up = b.op("MatMul", [h, b.init(p + "intermediate.dense.weight", w[f"l{i}.up"])])
        act = b.op("BiasGelu", [up, b.init(p + "intermediate.dense.bias", small(w[f"l{i}.up"].shape[1]))],
                   domain="com.microsoft")
        down = b.op("MatMul", [act, b.init(p + "output.dense.weight", w[f"l{i}.down"] * 0.5)])
        h = b.op("SkipLayerNormalization", [down, h, b.init(p + "output.LayerNorm.weight", w[f"l{i}.norm2"]),
                 b.init(p + "output.LayerNorm.bias", small(hidden))], domain="com.microsoft", epsilon=1e-12)
    b.op("Identity", [h], outputs=["last_hidden_state"])
    inputs = [helper.make_tensor_value_info(n, I64, ["batch_size", "sequence_length"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    outs = [helper.make_tensor_value_info("last_hidden_state", F, ["batch_size", "sequence_length", hidden])]
    g = helper.make_graph(b.nodes, "torch_jit", inputs, outs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)],
                          producer_name="onnxruntime.transformers")
    m.ir_version = 7
    return m


def bert_feeds(rng, n=4, vocab=VOCAB) -> list[dict]:
    """Two sentences of 7 tokens, the second padded after 5."""
    out = []
    for _ in range(n):
        mask = np.ones((2, 7), np.int64)
        mask[1, 5:] = 0
        out.append({"input_ids": rng.integers(0, vocab, (2, 7)).astype(np.int64), "attention_mask": mask,
                    "token_type_ids": np.zeros((2, 7), np.int64)})
    return out


def _scaled(rng, *shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def opset23(seed=0, bfloat16_io=False) -> onnx.ModelProto:
    """Opset 23 storage forms: an int4 weight quantized in blocks of 32 along K (DequantizeLinear
    block_size, scales [2, N]), a float8 e4m3fn weight with a per-tensor scale, a bfloat16 weight
    behind a Cast, a plain float32 one (random weights). bfloat16_io: a bfloat16 input added to x
    and a bfloat16 copy of the output (onnxruntime's numpy API can feed and return neither)."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    w1 = _scaled(rng, 64, 128)
    s1 = (np.abs(w1).reshape(2, 32, 128).max(1) / 7).astype(np.float32)
    q1 = np.clip(np.round(w1 / np.repeat(s1, 32, 0)), -8, 7).astype(np.int8)
    w2 = _scaled(rng, 128, 64)
    s2 = np.float32(np.abs(w2).max() / 448)
    q2 = (w2 / s2).astype(ml_dtypes.float8_e4m3fn)
    w3 = _scaled(rng, 64, 64).astype(ml_dtypes.bfloat16)
    inits = [helper.make_tensor("w1_q", TensorProto.INT4, [64, 128], q1.ravel().tolist()),
             numpy_helper.from_array(s1, "w1_s"),
             TensorProto(name="w2_q", data_type=TensorProto.FLOAT8E4M3FN, dims=[128, 64], raw_data=q2.tobytes()),
             numpy_helper.from_array(np.array(s2, np.float32), "w2_s"),
             TensorProto(name="w3_bf16", data_type=TensorProto.BFLOAT16, dims=[64, 64], raw_data=w3.tobytes()),
             numpy_helper.from_array(_scaled(rng, 64, 32), "w4")]
    first = [helper.make_node("Cast", ["xb"], ["xb_f"], to=F), helper.make_node("Add", ["x", "xb_f"], ["x0"])] \
        if bfloat16_io else [helper.make_node("Identity", ["x"], ["x0"])]
    nodes = [helper.make_node("DequantizeLinear", ["w1_q", "w1_s"], ["w1"], axis=0, block_size=32),
             helper.make_node("DequantizeLinear", ["w2_q", "w2_s"], ["w2"]),
             helper.make_node("Cast", ["w3_bf16"], ["w3"], to=F), *first,
             helper.make_node("MatMul", ["x0", "w1"], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"]), helper.make_node("MatMul", ["h2", "w3"], ["h3"]),
             helper.make_node("MatMul", ["h3", "w4"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", F, ["batch", 64])]
    outputs = [helper.make_tensor_value_info("y", F, ["batch", 32])]
    if bfloat16_io:
        nodes.append(helper.make_node("Cast", ["y"], ["y_bf16"], to=TensorProto.BFLOAT16))
        inputs.append(helper.make_tensor_value_info("xb", TensorProto.BFLOAT16, ["batch", 64]))
        outputs.append(helper.make_tensor_value_info("y_bf16", TensorProto.BFLOAT16, ["batch", 32]))
    m = helper.make_model(helper.make_graph(nodes, "op23", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 11
    onnx.checker.check_model(m, full_check=True)
    return m


def opset23_feeds(rng, n=4, bfloat16_io=False) -> list[dict]:
    import ml_dtypes
    return [{"x": rng.standard_normal((3, 64)).astype(np.float32),
             **({"xb": rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16)} if bfloat16_io else {})}
            for _ in range(n)]


def loops(seed=0) -> onnx.ModelProto:
    """A Scan whose body holds its own weight and reads one from the outer graph, then a Loop whose
    body holds a weight (opset 17, random weights). The Loop's weight reaches only the second
    output."""
    rng = np.random.default_rng(seed)
    scan_body = helper.make_graph(
        [helper.make_node("MatMul", ["s_in", "scan_inner_w"], ["a"]),
         helper.make_node("MatMul", ["x_t", "scan_outer_w"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Tanh", ["c"], ["s_out"]),
         helper.make_node("Identity", ["s_out"], ["y_t"])],
        "scan_body", [helper.make_tensor_value_info("s_in", F, [1, 32]), helper.make_tensor_value_info("x_t", F, [1, 32])],
        [helper.make_tensor_value_info("s_out", F, [1, 32]), helper.make_tensor_value_info("y_t", F, [1, 32])],
        [numpy_helper.from_array(_scaled(rng, 32, 32), "scan_inner_w")])
    outer_w = numpy_helper.from_array(_scaled(rng, 32, 32), "scan_outer_w")
    loop_body = helper.make_graph(
        [helper.make_node("MatMul", ["l_in", "loop_w"], ["l_mm"]), helper.make_node("Tanh", ["l_mm"], ["l_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "loop_body", [helper.make_tensor_value_info("iter", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                      helper.make_tensor_value_info("l_in", F, [1, 32])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("l_out", F, [1, 32])],
        [numpy_helper.from_array(_scaled(rng, 32, 32), "loop_w")])
    nodes = [helper.make_node("Scan", ["h0", "xs"], ["h_last", "ys"], num_scan_inputs=1, body=scan_body),
             helper.make_node("Loop", ["trips", "", "h_last"], ["z"], body=loop_body)]
    g = helper.make_graph(nodes, "loops", [helper.make_tensor_value_info("h0", F, [1, 32]),
                                           helper.make_tensor_value_info("xs", F, ["steps", 1, 32])],
                          [helper.make_tensor_value_info("ys", F, ["steps", 1, 32]), helper.make_tensor_value_info("z", F, [1, 32])],
                          [outer_w, numpy_helper.from_array(np.array(3, np.int64), "trips")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def loops_feeds(rng, n=4) -> list[dict]:
    return [{"h0": rng.standard_normal((1, 32)).astype(np.float32),
             "xs": rng.standard_normal((6, 1, 32)).astype(np.float32)} for _ in range(n)]


def shared_output(ir3=False, seed=0) -> onnx.ModelProto:
    """One weight read by a MatMul and by a Gemm (transB) and also a graph output; ir3: IR 3 /
    opset 9, every initializer listed as a graph input too (a default value a feed could replace)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_scaled(rng, 64, 64), "shared_w"),
             numpy_helper.from_array((rng.standard_normal(64) * 0.1).astype(np.float32), "bias")]
    nodes = [helper.make_node("MatMul", ["x", "shared_w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "shared_w", "bias"], ["y"], transB=1)]
    inputs = [helper.make_tensor_value_info("x", F, [4, 64])]
    if ir3:
        inputs += [helper.make_tensor_value_info("shared_w", F, [64, 64]), helper.make_tensor_value_info("bias", F, [64])]
    g = helper.make_graph(nodes, "shared", inputs, [helper.make_tensor_value_info("y", F, [4, 64]),
                                                     helper.make_tensor_value_info("shared_w", F, [64, 64])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9 if ir3 else 17)])
    m.ir_version = 3 if ir3 else 8
    onnx.checker.check_model(m, full_check=True)
    return m


def shared_feeds(rng, n=4) -> list[dict]:
    return [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(n)]


NAMES = ("dec_fp32", "dec_fp16", "dec_bf16", "dec_extdata", "dec_qdq", "dec_nbits", "legacy_op11", "legacy_op13",
         "minilm_ortopt", "minilm_ortopt16", "dec_qdq16", "dec_qdq_w4", "dec_gqa", "dec_mha", "bert_fused",
         "dec_mha_pertensor", "dec_gqa16", "dec_gqa_nbits", "opset23", "loops", "shared_output", "shared_output_ir3", "dec_gqa_packed", "dec_mha16")


def feeds_for(name: str, rng, n=4) -> list[dict]:
    if name.startswith("dec_gqa"):
        return contrib_feeds(rng, "gqa", n)
    if name.startswith("dec_mha"):
        return contrib_feeds(rng, "mha", n, kv_heads=HEADS)
    if name == "bert_fused":
        return bert_feeds(rng, n)
    if name == "opset23":
        return opset23_feeds(rng, n)
    if name == "loops":
        return loops_feeds(rng, n)
    if name.startswith("shared_output"):
        return shared_feeds(rng, n)
    if name.startswith("minilm_ortopt"):
        return corpus_text_feeds(n)
    if name.startswith("legacy"):
        return legacy_feeds(rng, n)
    return decoder_feeds(rng, np.float16 if name == "dec_fp16" else np.float32, n)


def build(out: Path) -> dict[str, Path]:
    """Make every model under out/NAME/ that is not there yet; name -> model path."""
    paths = {n: out / n / f"{n}.onnx" for n in NAMES}
    missing = {n for n, p in paths.items() if not p.exists()}
    if not missing:
        return paths
    for n in missing:
        paths[n].parent.mkdir(parents=True, exist_ok=True)
    w = _real_weights()

    def want(*names):
        return bool(missing & set(names))

    fp32 = decoder(F, w)
    if want("dec_fp32", "dec_qdq", "dec_qdq16", "dec_qdq_w4") and not paths["dec_fp32"].exists():
        onnx.save(fp32, str(paths["dec_fp32"]))
    if want("dec_fp16"):
        onnx.save(decoder(F16, w), str(paths["dec_fp16"]))
    if want("dec_bf16"):
        onnx.save(bfloat16_weights(fp32), str(paths["dec_bf16"]))
    if want("dec_extdata"):
        save_external_several(fp32, paths["dec_extdata"])
    if want("dec_qdq"):
        qdq(paths["dec_fp32"], paths["dec_qdq"], feeds_for("dec_qdq", np.random.default_rng(1), 8))
    if want("dec_nbits"):
        onnx.save(matmul_nbits(fp32), str(paths["dec_nbits"]))
    for opset in (11, 13):
        if want(f"legacy_op{opset}"):
            onnx.save(legacy(opset), str(paths[f"legacy_op{opset}"]))
    if want("minilm_ortopt"):
        ort_optimized(paths["minilm_ortopt"], float16=False)
    if want("minilm_ortopt16"):
        ort_optimized(paths["minilm_ortopt16"], float16=True)
    calibration = feeds_for("dec_qdq", np.random.default_rng(1), 8)
    if want("dec_qdq16"):
        qdq(paths["dec_fp32"], paths["dec_qdq16"], calibration, activations="QInt16")
    if want("dec_qdq_w4"):
        qdq(paths["dec_fp32"], paths["dec_qdq_w4"], calibration, activations="QUInt8", weights="QInt4")
    gqa = contrib_decoder(w, attention="gqa")
    mha = contrib_decoder(w, kv_heads=HEADS, attention="mha")
    writers = {
        "dec_gqa": lambda p: onnx.save(gqa, str(p)),
        "dec_gqa16": lambda p: onnx.save(float16_keep_io(gqa), str(p)),
        "dec_gqa_nbits": lambda p: onnx.save(matmul_nbits(gqa), str(p)),  # onnxruntime-genai's int4 CPU shape
        "dec_gqa_packed": lambda p: onnx.save(contrib_decoder(w, attention="gqa", packed_qkv=True), str(p)),
        "dec_mha": lambda p: onnx.save(mha, str(p)),
        # onnx's own per-tensor layout: every tensor over 64 bytes in a file named after it (or a uuid
        # where the name is no file name: '/const_3'), as size_threshold writes models past 2 GB
        # (a copy: onnx.save_model moves the saved model's tensors out to those files in place)
        "dec_mha_pertensor": lambda p: onnx.save_model(onnx.ModelProto.FromString(mha.SerializeToString()), str(p),
                                                       save_as_external_data=True, all_tensors_to_one_file=False,
                                                       size_threshold=64),
        "dec_mha16": lambda p: onnx.save(float16_keep_io(mha), str(p)),
        "bert_fused": lambda p: onnx.save(bert_fused(w), str(p)),
        "opset23": lambda p: onnx.save(opset23(), str(p)),
        "loops": lambda p: onnx.save(loops(), str(p)),
        "shared_output": lambda p: onnx.save(shared_output(), str(p)),
        "shared_output_ir3": lambda p: onnx.save(shared_output(ir3=True), str(p)),
    }
    for name, write in writers.items():
        if name in missing:
            write(paths[name])
    return paths


if __name__ == "__main__":
    for name, path in build(Path(sys.argv[1])).items():
        print(name, path)
