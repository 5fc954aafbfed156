"""Build functions for the derived graph variants: optimized, int8, fp16.

Each takes (path of the fp32 graph, path to write, config) and writes one ONNX file; the exporter
validates it against PyTorch with the variant's tolerance (export/graphs.py holds the registry).

optimized: two passes.
  1. `fuse_attention` rewrites our masked attention pattern (model/attention.py) into ONNX
     Runtime's contrib `Attention` op: one packed Q|K|V GEMM and a fused QKᵀ-softmax-PV kernel.
     ORT's own BERT fusion does not recognise it (its masks are additive [B, T] paddings; ours is a
     boolean [B, T, T] `allowed` matrix with where() before and after the softmax).
  1b. `masks_as_arithmetic` rewrites the masked softmax blocks pass 1 left (rotary q/k, decoders, DeBERTa,
     cosine scaling...): Where(allowed, scores, lowest) -> Softmax -> Where(allowed, p, 0) becomes
     Add(scores, bias) -> Softmax -> Mul(p, row_any), with bias = Where(allowed, 0, lowest) [B, 1, T, T] and
     row_any = any(allowed, -1) [B, 1, T, 1] made once per mask. Bit for bit the same answers (below);
     ONNX Runtime's CPU Where over [B, heads, T, T] was 18 % of an LLM reranker's run, and the rewrite made
     the run 1.08-1.23x faster (docs/performance.md "LLM rerankers").
  1c. `fuse_gelu` rewrites each GELU as torch's exporter writes it (x · ((1 + erf(x/√2)) · 0.5), and the tanh
     form) into ONNX Runtime's contrib Gelu / FastGelu, which ONNX Runtime's own GeluFusion does not match;
     pass 2 then fuses the bias Add before it (BiasGelu). Six elementwise passes over each FFN's
     [tokens, d_ff] become one: a 12-layer BERT of width 384 ran 5 % faster (docs/performance.md).
  2. ONNX Runtime's graph optimiser at ORT_ENABLE_EXTENDED, saved offline (Gelu/BiasGelu,
     FusedMatMul, constant folding, ...). Not ORT_ENABLE_ALL: that level adds layout transforms
     (NCHWc) chosen for the CPU the file is written on, so the saved file would be tied to it.
  Bias + residual + LayerNorm are left unfused: ORT's CPU SkipLayerNormalization measured slower
  than the Add, Add, LayerNormalization it replaces (2.29 vs 1.87 ms at [8, 256, 256]; the whole
  graph 12 % faster at (8, 256) without it, int8 19 %), so that fusion was removed.
int8: dynamic quantisation (int8 weights per channel, activations quantised per call) of the
  graph after passes 1 and 1b, for CPU. Weights are quantised to 7 bits (`reduce_range=True`, values in
  [-64, 64]). Why: on x86 CPUs without VNNI (AVX2, or AVX-512 without VNNI) ONNX Runtime's
  uint8 x int8 GEMM multiplies with vpmaddubsw, which adds each pair of u8*s8 products into a
  saturating int16; with full 8-bit weights, 2 * 255 * 127 overflows it. On an AMD EPYC with AVX2
  and no AVX-512/VNNI that took the pooled min_cosine to 0.98 (limit 0.999) for both the tests'
  small encoders and the default model. With 7-bit weights the pair sum fits in int16, so the
  integer products no longer saturate, the result is the same on either kind of CPU, and the graph
  still runs the u8 x s8 kernels (vpdpbusd where VNNI exists). Measured on that EPYC (default model): min_cosine 0.99991; uint8 weights (U8U8) were
  also within tolerance (0.99995) but 19 % slower at (8, 256) and cannot use VNNI's u8 x s8
  instruction, so they were not chosen (docs/performance.md, "int8").
fp16: float16 weights and arithmetic with float32 inputs and outputs, for CUDA.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.contract import MAX_IR_VERSION
from model import onnx_files
from model.config import EncoderConfig

MS_DOMAIN = "com.microsoft"


# --------------------------------------------------------------------------- attention fusion


class _Graph:
    """Producer / consumer maps and constant lookup over one onnx GraphProto."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.graph_outputs = {o.name for o in graph.output}

    def const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def scalar(self, name: str) -> float | None:
        """The value of a one-element constant; None for anything else."""
        c = self.const(name)
        return float(c.reshape(())) if c is not None and c.size == 1 else None

    def op(self, name: str, op_type: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def only_consumer(self, name: str, op_type: str):
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and name not in self.graph_outputs:
            return users[0]
        return None

    def attr(self, node, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default


@dataclass
class _Projection:
    x: str
    weight: np.ndarray  # (D_in, D_out)
    bias: np.ndarray  # (D_out,)
    nodes: list


def _projection_heads(g: _Graph, name: str, perm: list[int]) -> _Projection | None:
    """name = Transpose(perm)(Reshape(Add(MatMul(x, W), b))): a head-split linear projection."""
    transpose = g.op(name, "Transpose")
    if transpose is None or list(g.attr(transpose, "perm", [])) != perm:
        return None
    reshape = g.op(transpose.input[0], "Reshape")
    add = g.op(reshape.input[0], "Add") if reshape is not None else None
    if add is None:
        return None
    matmul, bias = None, None
    for i in (0, 1):
        candidate = g.op(add.input[i], "MatMul")
        b = g.const(add.input[1 - i])
        if candidate is not None and b is not None:
            matmul, bias = candidate, b
    weight = g.const(matmul.input[1]) if matmul is not None else None
    if weight is None or weight.ndim != 2 or bias.shape != (weight.shape[1],):
        return None
    for node in (matmul, add, reshape):
        if len(g.consumers[node.output[0]]) != 1:
            return None
    return _Projection(matmul.input[0], weight, bias, [matmul, add, reshape, transpose])


def _masked_softmaxes(g: _Graph) -> list[tuple]:
    """Every masked softmax block (model/attention_math.py masked_softmax), as (pre, softmax, post, lowest):
    pre = Where(allowed, scores, lowest < -1e30) feeding only a last-axis Softmax, whose only consumer is
    post = Where(allowed, softmax, 0) on the same `allowed`."""
    blocks = []
    for softmax in [n for n in g.graph.node if n.op_type == "Softmax"]:
        if g.attr(softmax, "axis", -1) not in (-1, 3):
            continue
        pre = g.op(softmax.input[0], "Where")
        if pre is None or len(g.consumers[pre.output[0]]) != 1:
            continue
        low = g.scalar(pre.input[2])
        if low is None or low > -1e30:
            continue
        post = g.only_consumer(softmax.output[0], "Where")
        if post is None or post.input[0] != pre.input[0] or post.input[1] != softmax.output[0]:
            continue
        if g.scalar(post.input[2]) != 0.0:
            continue
        blocks.append((pre, softmax, post, low))
    return blocks


def fuse_attention(model: onnx.ModelProto, config: EncoderConfig) -> tuple[onnx.ModelProto, int]:
    """Rewrite every softmax attention block that matches our exported pattern into contrib
    `Attention`; returns (model, number of blocks fused). Blocks that do not match (cosine or
    length scaling, additive or linear attention) are left as they are.

    Matched, per layer (model/attention.py):
        scores = MatMul(q_heads, k_headsᵀ) [· scale]
        p = Where(allowed, Softmax(Where(allowed, scores, lowest)), 0)
        y = Reshape(Transpose(MatMul(p, v_heads)))            # (B, T, D)
    Written as:
        y = Attention(x, [Wq|Wk|Wv], [bq|bk|bv], mask=int32(allowed), scale, mask_filter_value=lowest)
            * any(allowed, axis=-1)                             # (B, T, 1)
    The last factor keeps the contract that a query with no allowed key gives zeros: the fused
    kernel adds `lowest` to every score of such a row, so its softmax is uniform, not zero.
    """
    g = _Graph(model.graph)
    heads = config.n_heads
    fused, remove, shared = 0, set(), {}
    new_nodes: dict[int, list] = {}  # index of the node they replace -> nodes
    index = {id(n): i for i, n in enumerate(model.graph.node)}
    for pre, softmax, post, low in _masked_softmaxes(g):
        cond, scores, _ = pre.input
        scale, mul = 1.0, g.op(scores, "Mul")
        qk = g.op(scores, "MatMul")
        if mul is not None:
            for i in (0, 1):
                s, m = g.scalar(mul.input[1 - i]), g.op(mul.input[i], "MatMul")
                if s is not None and m is not None:
                    scale, qk = s, m
            if qk is None or len(g.consumers[mul.output[0]]) != 1:
                continue
        if qk is None or len(g.consumers[qk.output[0]]) != 1:
            continue
        pv = g.only_consumer(post.output[0], "MatMul")
        if pv is None or pv.input[0] != post.output[0]:
            continue
        merge = g.only_consumer(pv.output[0], "Transpose")
        if merge is None or list(g.attr(merge, "perm", [])) != [0, 2, 1, 3]:
            continue
        flat = g.only_consumer(merge.output[0], "Reshape")
        unsqueeze = g.op(cond, "Unsqueeze")  # allowed[:, None]: (B, 1, T, T)
        if flat is None or unsqueeze is None or len(unsqueeze.input) < 2:
            continue
        axes = g.const(unsqueeze.input[1])
        if axes is None or list(np.atleast_1d(axes)) != [1]:
            continue
        q = _projection_heads(g, qk.input[0], [0, 2, 1, 3])
        k = _projection_heads(g, qk.input[1], [0, 2, 3, 1])
        v = _projection_heads(g, pv.input[1], [0, 2, 1, 3])
        if q is None or k is None or v is None or not (q.x == k.x == v.x):
            continue
        if q.weight.shape[1] != config.d_model or k.weight.shape != q.weight.shape or v.weight.shape != q.weight.shape:
            continue
        if len(g.consumers[k.nodes[-1].output[0]]) != 1 or len(g.consumers[q.nodes[-1].output[0]]) != 1:
            continue

        allowed = unsqueeze.input[0]  # (B, T, T) bool
        prefix = f"fused_attention_{fused}"
        nodes = []
        if allowed not in shared:
            mask_i32, row_any, axes_name = f"{allowed}_int32", f"{allowed}_row_any", f"{allowed}_last_axis"
            model.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes_name))
            nodes += [
                helper.make_node("Cast", [allowed], [mask_i32], to=TensorProto.INT32, name=f"{mask_i32}_cast"),
                helper.make_node("Cast", [allowed], [f"{allowed}_float"], to=TensorProto.FLOAT,
                                 name=f"{allowed}_float_cast"),
                helper.make_node("ReduceMax", [f"{allowed}_float", axes_name], [row_any], keepdims=1,
                                 name=f"{row_any}_reduce"),  # (B, T, 1): 1 where the query sees a key
            ]
            shared[allowed] = (mask_i32, row_any)
        mask_i32, row_any = shared[allowed]
        weight = np.concatenate([q.weight, k.weight, v.weight], axis=1).astype(np.float32)  # (D, 3D)
        bias = np.concatenate([q.bias, k.bias, v.bias]).astype(np.float32)  # (3D,)
        model.graph.initializer.extend([
            numpy_helper.from_array(weight, f"{prefix}.qkv_weight"),
            numpy_helper.from_array(bias, f"{prefix}.qkv_bias"),
        ])
        nodes += [
            helper.make_node(
                "Attention", [q.x, f"{prefix}.qkv_weight", f"{prefix}.qkv_bias", mask_i32],
                [f"{prefix}.out"], domain=MS_DOMAIN, name=prefix,
                num_heads=heads, scale=scale, mask_filter_value=float(low),
            ),  # (B, T, D)
            helper.make_node("Mul", [f"{prefix}.out", row_any], [flat.output[0]], name=f"{prefix}.zero_empty_rows"),
        ]
        new_nodes[index[id(flat)]] = nodes
        for node in (*q.nodes, *k.nodes, *v.nodes, qk, pre, softmax, post, pv, merge, flat):
            remove.add(id(node))
        if mul is not None:
            remove.add(id(mul))
        fused += 1
    if not fused:
        return model, 0
    # Rebuild the node list in order: new nodes take the place of the Reshape they replace, which
    # comes after all their inputs (x, the allowed matrix) and before every use of its output.
    ordered = []
    for i, node in enumerate(model.graph.node):
        if i in new_nodes:
            ordered.extend(new_nodes[i])
        if id(node) not in remove:
            ordered.append(node)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    _drop_unused_initializers(model)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    # Stale intermediate shapes would name tensors that no longer exist.
    del model.graph.value_info[:]
    return model, fused


def masks_as_arithmetic(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Rewrite every masked softmax block left unfused (module docstring, pass 1b); returns (model, blocks).

        Where(allowed, s, lowest) -> Softmax -> Where(allowed, p, 0)     (model/attention_math.py)
    becomes
        Add(s, Where(allowed, 0, lowest)) -> Softmax -> Mul(p, ReduceMax(float(allowed), -1))

    The same numbers: an allowed score gains +0.0 (unchanged); a masked one becomes s + lowest, which rounds to
    lowest for any |s| < 1e31, so exp(. - max) is exactly 0 in a row with an allowed key, as before, and such a
    row is multiplied by 1. A row with no allowed key has finite scores (no -inf, so no NaN) and is multiplied
    by 0: exactly zero, as the second Where gave. What differs: a masked score that is itself inf or NaN (only
    from inputs that already overflow) now reaches its row's softmax; the server refuses a non-finite answer
    either way. float32 graphs only (the optimized and int8 builds; fp16 is built from the fp32 graph)."""
    g = _Graph(model.graph)
    plans: dict[int, tuple[str, object]] = {}  # id(Where) -> ("pre" | "post", the block's pre Where)
    for pre, _softmax, post, _low in _masked_softmaxes(g):
        plans[id(pre)], plans[id(post)] = ("pre", pre), ("post", pre)
    if not plans:
        return model, 0
    shared: dict[tuple[str, str], tuple[str, str]] = {}  # (mask, lowest) -> (bias, row_any)
    nodes = []
    for node in model.graph.node:
        plan = plans.get(id(node))
        if plan is None:
            nodes.append(node)
            continue
        role, pre = plan
        mask, lowest = pre.input[0], pre.input[2]
        if (mask, lowest) not in shared:
            stem = f"{mask}_as_arithmetic_{len(shared)}"
            model.graph.initializer.extend([numpy_helper.from_array(np.array(0.0, np.float32), f"{stem}_zero"),
                                            numpy_helper.from_array(np.array([-1], np.int64), f"{stem}_last_axis")])
            nodes += [  # before the first block's Where: after the mask and the lowest constant it reads
                helper.make_node("Where", [mask, f"{stem}_zero", lowest], [f"{stem}_bias"], name=f"{stem}_bias"),
                helper.make_node("Cast", [mask], [f"{stem}_float"], to=TensorProto.FLOAT, name=f"{stem}_float"),
                helper.make_node("ReduceMax", [f"{stem}_float", f"{stem}_last_axis"], [f"{stem}_row_any"],
                                 keepdims=1, name=f"{stem}_row_any"),
            ]
            shared[mask, lowest] = (f"{stem}_bias", f"{stem}_row_any")
        bias, row_any = shared[mask, lowest]
        if role == "pre":
            nodes.append(helper.make_node("Add", [node.input[1], bias], [node.output[0]], name=f"{node.name}_add"))
        else:
            nodes.append(helper.make_node("Mul", [node.input[1], row_any], [node.output[0]], name=f"{node.name}_mul"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]
    return model, len(plans) // 2


def _is_scalar(g: _Graph, name: str, value: float) -> bool:
    c = g.scalar(name)
    return c is not None and bool(np.isclose(c, value, rtol=1e-6, atol=0.0))


def _other(node, name: str) -> str | None:
    """The other input of a two-input node that reads `name`."""
    if len(node.input) != 2 or name not in node.input:
        return None
    return node.input[1] if node.input[0] == name else node.input[0]


def _by_constant(g: _Graph, name: str, op_type: str, value: float):
    """(the node, its non-constant input) when `name` = op_type(input, value) (either order)."""
    node = g.op(name, op_type)
    if node is None or len(node.input) != 2:
        return None, None
    for i in (0, 1):
        if _is_scalar(g, node.input[1 - i], value) and (op_type != "Div" or i == 0):
            return node, node.input[i]
    return None, None


def _gelu_inner(g: _Graph, inner: str, x: str) -> tuple[str, list] | None:
    """("Gelu", nodes) when inner = Erf(x / √2) (or x · 1/√2); ("FastGelu", nodes) when
    inner = Tanh(√(2/π) · (x + 0.044715 · x³)); None otherwise."""
    erf = g.op(inner, "Erf")
    if erf is not None:
        for op_type, value in (("Div", 2 ** 0.5), ("Mul", 0.5 ** 0.5)):
            scale, source = _by_constant(g, erf.input[0], op_type, value)
            if scale is not None and source == x:
                return "Gelu", [scale, erf]
        return None
    tanh = g.op(inner, "Tanh")
    if tanh is None:
        return None
    scale, summed = _by_constant(g, tanh.input[0], "Mul", (2 / np.pi) ** 0.5)
    add = g.op(summed, "Add") if scale is not None else None
    cube_term = _other(add, x) if add is not None else None
    coefficient, cubed = _by_constant(g, cube_term, "Mul", 0.044715) if cube_term else (None, None)
    power, base = _by_constant(g, cubed, "Pow", 3.0) if cubed else (None, None)
    if power is None or base != x:
        return None
    return "FastGelu", [power, coefficient, add, scale, tanh]


def fuse_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Rewrite each decomposed GELU into ONNX Runtime's contrib op (module docstring, pass 1c); returns
    (model, count).

        x · ((1 + erf(x / √2)) · 0.5)                         -> Gelu(x)        (activation "gelu")
        x · ((1 + tanh(√(2/π) · (x + 0.044715 · x³))) · 0.5)  -> FastGelu(x)    (activation "gelu_tanh")

    That is the order torch's ONNX exporter writes F.gelu in, which ONNX Runtime's own GeluFusion does not
    match (it knows 0.5 · x first or last), so the optimizer left six elementwise passes over every FFN's
    [tokens, d_ff] activation. Rewritten, ONNX Runtime fuses the bias Add before it (BiasGelu), as it does for
    BERT graphs it exports itself. The same function: each op computes that formula (ONNX Runtime's
    own erf / tanh), within float32 rounding; every graph built from this is validated against PyTorch."""
    g = _Graph(model.graph)
    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for out in model.graph.node:
        if out.op_type != "Mul" or len(out.input) != 2:
            continue
        for x, h in (out.input, out.input[::-1]):
            half, plus = _by_constant(g, h, "Mul", 0.5)
            one, inner = _by_constant(g, plus, "Add", 1.0) if half is not None else (None, None)
            found = _gelu_inner(g, inner, x) if one is not None else None
            if found is None:
                continue
            op_type, nodes = found
            chain = [*nodes, one, half]
            # every intermediate feeds only the next step (x aside): nothing else reads what is removed
            inside = {n.output[0] for n in chain} | {out.output[0]}
            if any(n.output[0] in g.graph_outputs or any(c is not out and c.output[0] not in inside
                                                         for c in g.consumers[n.output[0]]) for n in chain):
                continue
            if any(id(n) in drop for n in chain):
                continue
            drop.update(id(n) for n in chain)
            replace[id(out)] = helper.make_node(op_type, [x], [out.output[0]], name=f"{out.name}_{op_type}",
                                                domain=MS_DOMAIN)
            break
    if not replace:
        return model, 0
    nodes = [replace.get(id(n), n) for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    _drop_unused_initializers(model)
    return model, len(replace)


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)


# --------------------------------------------------------------------------- ORT offline passes


def ort_optimize(src: str, dst: str, level: str = "extended") -> None:
    """Run ONNX Runtime's graph optimiser on `src` and save the result (CPU provider) to `dst`, with
    its weights as external data when `src` has them (model/onnx_files.py)."""
    import onnxruntime as ort

    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.optimized_model_filepath = dst
    if onnx_files.is_external(src):
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         onnx_files.data_file_name(dst))
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         "1024")
    ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])
    _cap_ir_version(dst)


def _cap_ir_version(path: str) -> None:
    onnx_files.cap_ir_version(path, MAX_IR_VERSION)


# --------------------------------------------------------------------------- build functions


def build_optimized(fp32_path: str, out_path: str, config: EncoderConfig) -> None:
    """Fused attention (contrib Attention), the other masked softmax blocks as arithmetic, GELU as one op,
    then ORT_ENABLE_EXTENDED fusions, saved offline."""
    external = onnx_files.is_external(fp32_path)
    model, _fused = fuse_attention(onnx.load(fp32_path), config)
    model, _rewritten = masks_as_arithmetic(model)
    model, _gelus = fuse_gelu(model)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_path) or ".") as tmp:
        fused_path = os.path.join(tmp, "fused.onnx")
        onnx_files.save(model, fused_path, external=external)
        ort_optimize(fused_path, out_path, "extended")


def build_int8(fp32_path: str, out_path: str, config: EncoderConfig) -> None:
    """Dynamic int8 quantisation of the attention-fused graph: int8 weights per output channel for
    every MatMul and the packed Q|K|V of every Attention (-> QAttention); activations are
    quantised to uint8 per call. Per channel measured faster here than per tensor, and closer.
    reduce_range=True (7-bit weights): no int16 saturation on CPUs without VNNI (module docstring)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    external = onnx_files.is_external(fp32_path)
    model, _fused = fuse_attention(onnx.load(fp32_path), config)
    model, _rewritten = masks_as_arithmetic(model)
    model, _gelus = fuse_gelu(model)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_path) or ".") as tmp:
        fused_path = os.path.join(tmp, "fused.onnx")
        onnx_files.save(model, fused_path, external=external)
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # quantize_dynamic logs a "consider pre-processing" warning
        try:
            quantize_dynamic(fused_path, out_path, weight_type=QuantType.QInt8, per_channel=True,
                             reduce_range=True,  # 7-bit weights: see the module docstring
                             op_types_to_quantize=["MatMul", "Attention"], use_external_data_format=external,
                             extra_options={"DefaultTensorType": TensorProto.FLOAT})
        finally:
            root.setLevel(level)
    _cap_ir_version(out_path)


def build_fp16(fp32_path: str, out_path: str, config: EncoderConfig) -> None:
    """float16 weights and arithmetic, float32 inputs and outputs (ONNX Runtime's float16
    converter; onnxconverter-common 1.16 mistypes a graph output that is also used inside the
    graph, as last_hidden_state is by the pooling)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    external = onnx_files.is_external(fp32_path)
    model = convert_float_to_float16(onnx.load(fp32_path), keep_io_types=True)
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    onnx_files.save(model, out_path, external=external)
