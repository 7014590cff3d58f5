"""Finite-difference checks, in float64, of every gradient rule in the engine's registry.

For each differentiable op (``_ortrain.op_table()``), one or more tiny ONNX models run through a
Session whose float inputs are bound, trainable weights. The analytic gradient of
``L = Σ_k <seed_k, output_k>`` (random seeds, one per float output) from the engine's backward
pass is compared with central differences of L computed by the engine's forward pass
(eps 1e-6, rtol 1e-5, atol 1e-7). A differentiable op without a case here fails
``test_every_differentiable_op_has_a_case``: a new gradient rule cannot skip this check.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

_ortrain = pytest.importorskip("ortrain._ortrain")

EPS, RTOL, ATOL = 1e-6, 1e-5, 1e-7
OPSET = 20
NP_OF = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32, "bool": np.bool_, "uint8": np.uint8, "int8": np.int8}


@dataclass
class W:
    """A float64 weight drawn uniformly from [lo, hi], with |x| >= away (keeps clear of kinks)."""

    shape: tuple
    lo: float = -1.0
    hi: float = 1.0
    away: float = 0.0
    distinct: bool = False  # values a grid step (hi - lo) / size apart: no ties (max pooling)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        x = rng.uniform(self.lo, self.hi, self.shape)
        if self.distinct:
            n = x.size
            x = (self.lo + (self.hi - self.lo) * (rng.permutation(n) + 0.5) / n).reshape(self.shape)
        if self.away:
            x = np.where(np.abs(x) < self.away, np.sign(x + 1e-30) * self.away + x, x)
        return x.astype(np.float64)


def C(value, dtype=None):
    """A constant input (an initializer the test does not bind)."""
    return np.array(value, dtype=dtype)


@dataclass
class Case:
    op: str
    inputs: list  # W (weight), np.ndarray (constant), or None (optional input left out)
    attrs: dict = field(default_factory=dict)
    n_out: int = 1
    label: str = ""
    extra_out: int = 0  # node outputs past the n_out graph outputs (not differentiated here)
    opset: int = OPSET

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}" if self.label else self.op


def cases() -> list[Case]:
    x234 = W((2, 3, 4))
    L: list[Case] = []
    add = L.append
    # elementwise binary, with broadcasting both ways
    for op in ("Add", "Sub", "Mul"):
        add(Case(op, [W((2, 3, 4)), W((3, 1))], label="bcast"))
        add(Case(op, [W((4,)), W((2, 3, 1))], label="bcast2"))
    add(Case("Div", [W((2, 3, 4)), W((3, 1), 0.5, 2.0)], label="bcast"))
    add(Case("Div", [W((1, 4)), W((3, 1), -2.0, -0.5)], label="bcast2"))
    add(Case("Pow", [W((2, 3), 0.5, 2.0), W((3,), -1.5, 1.5)], label="bcast"))
    add(Case("Pow", [W((2, 3), 0.5, 2.0), W((), 0.5, 2.0)], label="scalar-exp"))
    # elementwise unary
    add(Case("Identity", [x234]))
    add(Case("Neg", [x234]))
    add(Case("Abs", [W((2, 3, 4), away=0.1)]))
    add(Case("Exp", [x234]))
    add(Case("Log", [W((2, 3), 0.3, 2.0)]))
    add(Case("Sqrt", [W((2, 3), 0.3, 2.0)]))
    add(Case("Reciprocal", [W((2, 3), 0.3, 2.0)]))
    add(Case("Sin", [x234]))
    add(Case("Cos", [x234]))
    add(Case("Erf", [x234]))
    add(Case("Cast", [x234], {"to": TensorProto.DOUBLE}, label="to-double"))
    add(Case("CastLike", [x234, C([0.0], np.float64)], label="like-double"))
    # activations (inputs kept off their kinks)
    add(Case("Relu", [W((2, 3, 4), away=0.1)]))
    add(Case("LeakyRelu", [W((2, 3, 4), away=0.1)], {"alpha": 0.1}))
    add(Case("Tanh", [x234]))
    add(Case("Sigmoid", [W((2, 3, 4), -3, 3)]))
    add(Case("Softplus", [W((2, 3, 4), -3, 3)]))
    add(Case("Gelu", [W((2, 3, 4), -3, 3)], label="exact"))
    add(Case("Gelu", [W((2, 3, 4), -3, 3)], {"approximate": "tanh"}, label="tanh"))
    add(Case("HardSigmoid", [W((2, 3, 4), -2, 2)], {"alpha": 0.3, "beta": 0.4}))
    add(Case("HardSwish", [W((2, 3, 4), -2.5, 2.5)]))
    add(Case("Where", [C(np.array([[True], [False], [True]])), W((2, 3, 4)), W((4,))], label="bcast"))
    # softmax family
    add(Case("Softmax", [x234], {"axis": -1}))
    add(Case("Softmax", [x234], {"axis": 1}, label="axis1"))
    add(Case("LogSoftmax", [x234], {"axis": -1}))
    add(Case("LogSoftmax", [x234], {"axis": 0}, label="axis0"))
    # matmul
    add(Case("MatMul", [W((3, 4)), W((4, 2))], label="2d"))
    add(Case("MatMul", [W((2, 1, 3, 4)), W((3, 4, 2))], label="batched-bcast"))
    add(Case("MatMul", [W((4,)), W((2, 4, 3))], label="vec-mat"))
    add(Case("MatMul", [W((2, 3, 4)), W((4,))], label="mat-vec"))
    add(Case("MatMul", [W((4,)), W((4,))], label="vec-vec"))
    add(Case("Gemm", [W((3, 4)), W((4, 2)), W((2,))], {"alpha": 0.7, "beta": 1.3}, label="bias-row"))
    add(Case("Gemm", [W((4, 3)), W((2, 4)), W((3, 1))], {"transA": 1, "transB": 1}, label="trans-bias-col"))
    add(Case("Gemm", [W((3, 4)), W((4, 2)), None], label="no-bias"))
    # the internal FusedMatMul a forward pass folds transposes and scalings into
    # (passes/fold_matmul_transpose.rs): batched, broadcast batches summed back
    add(Case("FusedMatMul", [W((2, 3, 4)), W((2, 5, 4))], {"transB": 1, "alpha": 0.5}, label="batched-transB"))
    add(Case("FusedMatMul", [W((2, 1, 4, 3)), W((3, 4, 5))], {"transA": 1, "alpha": -1.5}, label="broadcast-transA"))
    add(Case("FusedMatMul", [W((4, 3)), W((5, 4))], {"transA": 1, "transB": 1}, label="2d-both"))
    # reductions
    add(Case("ReduceSum", [x234, C([1], np.int64)], {"keepdims": 1}, label="axis1-keep"))
    add(Case("ReduceSum", [x234, C([0, -1], np.int64)], {"keepdims": 0}, label="axes-drop"))
    add(Case("ReduceSum", [x234], label="all"))
    add(Case("ReduceMean", [x234, C([2], np.int64)], {"keepdims": 0}, label="axis2-drop"))
    add(Case("ReduceMean", [x234, C([0, 1], np.int64)], {"keepdims": 1}, label="axes-keep"))
    # movement
    add(Case("Reshape", [x234, C([4, 0, -1], np.int64)]))
    add(Case("Flatten", [x234], {"axis": 2}))
    add(Case("Squeeze", [W((2, 1, 3, 1)), C([1, -1], np.int64)]))
    add(Case("Unsqueeze", [W((2, 3)), C([0, -1], np.int64)]))
    add(Case("Transpose", [x234], {"perm": [2, 0, 1]}))
    add(Case("Expand", [W((3, 1)), C([2, 3, 4], np.int64)]))
    add(Case("Concat", [W((2, 1, 4)), W((2, 3, 4)), W((2, 2, 4))], {"axis": 1}))
    add(Case("Split", [W((2, 5)), C([2, 3], np.int64)], {"axis": 1}, n_out=2))
    add(Case("Split", [W((6, 2))], {"axis": 0, "num_outputs": 3}, n_out=3, label="equal"))
    add(Case("Slice", [W((4, 5)), C([1, 0], np.int64), C([3, 5], np.int64), C([0, 1], np.int64), C([1, 2], np.int64)], label="steps"))
    add(Case("Slice", [W((4, 5)), C([-1], np.int64), C([-10], np.int64), C([1], np.int64), C([-2], np.int64)], label="neg-step"))
    add(Case("Gather", [W((5, 3)), C([[0, 4], [2, 0]], np.int64)], {"axis": 0}, label="axis0-repeat"))
    add(Case("Gather", [W((2, 5, 3)), C([-1, 1], np.int64)], {"axis": 1}, label="axis1-neg"))
    add(Case("GatherElements", [W((3, 4)), C([[0, 3, 3], [1, 0, 2], [2, 2, 2]], np.int64)], {"axis": 1}))
    add(Case("Trilu", [W((2, 3, 4)), C(1, np.int64)], {"upper": 1}, label="upper-k1"))
    add(Case("Trilu", [W((4, 3))], {"upper": 0}, label="lower"))
    # norms, dropout, losses (class weights, labels: constants, no gradient by definition)
    add(Case("LayerNormalization", [W((2, 3, 4)), W((4,)), W((4,))], {"axis": -1, "epsilon": 1e-5}))
    add(Case("LayerNormalization", [W((2, 3, 4)), W((3, 4)), None], {"axis": 1}, label="axis1-no-bias"))
    add(Case("Dropout", [x234, C(0.5, np.float64), C(True)], n_out=2, label="train"))
    add(Case("Dropout", [x234], label="inference"))
    for red in ("mean", "sum", "none"):
        add(Case("SoftmaxCrossEntropyLoss", [W((3, 5)), C([1, 4, 0], np.int64)], {"reduction": red}, label=red))
    add(
        Case(
            "SoftmaxCrossEntropyLoss",
            [W((2, 4, 3)), C([[0, 3, 1], [2, -1, 1]], np.int64), C([0.3, 1.0, 0.5, 0.8], np.float64)],
            {"reduction": "mean", "ignore_index": -1},
            label="weights-ignore-nd",
        )
    )
    add(Case("SoftmaxCrossEntropyLoss", [W((3, 5)), C([1, 4, 0], np.int64)], n_out=2, label="log_prob"))
    for red in ("mean", "sum", "none"):
        add(Case("NegativeLogLikelihoodLoss", [W((3, 5)), C([1, 4, 0], np.int64)], {"reduction": red}, label=red))
    add(
        Case(
            "NegativeLogLikelihoodLoss",
            [W((2, 4, 3)), C([[0, 3, 1], [2, 1, 1]], np.int64), C([0.3, 1.0, 0.5, 0.8], np.float64)],
            {"reduction": "mean", "ignore_index": 1},
            label="weights-ignore-nd",
        )
    )
    # convolutions (1-D and 2-D; bias, strides, asymmetric pads, dilations, groups)
    add(Case("Conv", [W((1, 2, 5, 5)), W((3, 2, 2, 2)), W((3,))], {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, label="2d-bias-stride-pad-dil"))
    add(Case("Conv", [W((2, 4, 4, 4)), W((6, 2, 3, 3)), None], {"group": 2, "pads": [1, 1, 1, 1]}, label="2d-group2"))
    add(Case("Conv", [W((1, 3, 4, 3)), W((3, 1, 2, 2)), W((3,))], {"group": 3, "strides": [2, 2]}, label="2d-depthwise"))
    add(Case("Conv", [W((2, 3, 7)), W((4, 3, 3)), None], {"strides": [2], "pads": [1, 2], "dilations": [2]}, label="1d-stride-pad-dil"))
    add(Case("Conv", [W((1, 2, 6)), W((2, 2, 3)), W((2,))], {"auto_pad": "SAME_UPPER", "strides": [2]}, label="1d-same-upper"))
    # pools (max pooling over distinct values: no ties)
    add(Case("MaxPool", [W((1, 2, 5, 5), distinct=True)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, n_out=2, label="2d-indices"))
    add(Case("MaxPool", [W((2, 2, 4, 5), distinct=True)], {"kernel_shape": [2, 2], "strides": [1, 2], "dilations": [2, 1], "ceil_mode": 1}, label="2d-dil-ceil"))
    add(Case("MaxPool", [W((2, 3, 7), distinct=True)], {"kernel_shape": [3], "strides": [2], "pads": [1, 0]}, label="1d"))
    add(Case("AveragePool", [W((1, 2, 5, 5))], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, label="2d-pad-exclude"))
    add(Case("AveragePool", [W((1, 2, 5, 5))], {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "count_include_pad": 1}, label="2d-pad-include"))
    add(Case("AveragePool", [W((2, 3, 7))], {"kernel_shape": [2], "strides": [2], "ceil_mode": 1}, label="1d-ceil"))
    add(Case("GlobalAveragePool", [W((2, 3, 4, 3))], label="2d"))
    add(Case("GlobalAveragePool", [W((2, 3, 5))], label="1d"))
    # batch norm: batch statistics (training, w.r.t. X, scale, B) and running statistics (inference);
    # input_mean/input_var are buffers (no gradient)
    mean3, var3 = C([0.1, -0.2, 0.3], np.float64), C([0.5, 1.2, 0.8], np.float64)
    add(Case("BatchNormalization", [W((3, 2, 4)), W((2,)), W((2,)), C([0.1, -0.2], np.float64), C([0.5, 1.2], np.float64)], {"training_mode": 1, "epsilon": 1e-3}, label="train-1d"))
    add(Case("BatchNormalization", [W((2, 3, 2, 2)), W((3,)), W((3,)), mean3, var3], {"training_mode": 1, "momentum": 0.8}, label="train-2d"))
    add(Case("BatchNormalization", [W((2, 3, 2, 2)), W((3,)), W((3,)), mean3, var3], {"epsilon": 1e-2}, label="inference-2d"))
    # gather/scan
    add(Case("GatherND", [W((3, 4, 2)), C([[0, 1], [2, 3], [0, 1]], np.int64)], label="repeat"))
    add(Case("GatherND", [W((2, 3, 4)), C([[[1], [1]], [[2], [0]]], np.int64)], {"batch_dims": 1}, label="batch-dims1"))
    add(Case("GatherND", [W((2, 3)), C([[1, 2], [0, 0]], np.int64)], label="scalars"))
    add(Case("CumSum", [W((3, 4)), C(1, np.int64)], label="axis1"))
    add(Case("CumSum", [W((3, 4)), C(0, np.int64)], {"exclusive": 1}, label="exclusive"))
    add(Case("CumSum", [W((2, 3, 4)), C(-1, np.int64)], {"reverse": 1}, label="reverse"))
    add(Case("CumSum", [W((3, 4)), C(0, np.int64)], {"exclusive": 1, "reverse": 1}, label="exclusive-reverse"))
    # Max/Min of two inputs, with broadcasting (continuous draws: no ties)
    for op in ("Max", "Min"):
        add(Case(op, [W((2, 3, 4)), W((3, 1))], label="bcast"))
        add(Case(op, [W((4,)), W((2, 3, 4))], label="bcast2"))
    # the variadic forms the importer rewrites into chains (onnx/variadic.rs): three inputs
    # broadcast together, and one input
    for op in ("Sum", "Mean", "Max", "Min"):
        add(Case(op, [W((2, 3, 4)), W((3, 1)), W((4,))], label="three-bcast"))
        add(Case(op, [W((2, 3))], label="one"))
    # Pad, rewritten by the importer into Slices, Expands and Concats (onnx/pad.rs): each mode,
    # a crop (negative pad) with a pad, and axes
    add(Case("Pad", [x234, C([0, 1, 2, 1, 0, 1], np.int64), C(0.5, np.float64)], label="constant"))
    add(Case("Pad", [x234, C([0, -1, 2, 0, 2, -1], np.int64)], label="crop-and-pad"))
    add(Case("Pad", [x234, C([1, 2, 0, 1, 1, 1], np.int64)], {"mode": "edge"}, label="edge"))
    add(Case("Pad", [x234, C([0, 2, 3, 0, 1, 2], np.int64)], {"mode": "reflect"}, label="reflect"))
    add(Case("Pad", [x234, C([1, 0, 2, 1, 2, 1], np.int64)], {"mode": "wrap"}, label="wrap"))
    add(Case("Pad", [x234, C([1, 3], np.int64), None, C([-1], np.int64)], label="axes"))
    # ortrain-internal ops with their own gradient rules (gradients of gradients)
    add(Case("Affine", [x234], {"alpha": 0.7, "beta": -0.2}))
    add(Case("ReduceSumTo", [x234, C([3, 1], np.int64)]))
    # a residual branch's dropout and its add (passes/fuse_dropout_add.rs); output 1 the mask
    add(Case("DropoutAdd", [x234, W((2, 3, 4)), C(0.5, np.float64), C(True)], n_out=2, label="train"))
    add(Case("DropoutAdd", [x234, W((2, 3, 4))], n_out=2, label="inference"))
    # Linear (made by the fuse_linear pass): X[..., K] · op(W) + b
    add(Case("Linear", [W((2, 3, 4)), W((5, 4)), W((5,))], {"transB": 1}, label="3d-bias-transB"))
    add(Case("Linear", [W((3, 4)), W((4, 5))], {"transB": 0}, label="2d-nobias"))
    add(Case("Linear", [W((4,)), W((5, 4)), W((5,))], {"transB": 1}, label="1d-bias"))
    # the GELU fused by passes/fuse_linear_gelu.rs: output 1 is its input, which its gradient reads
    add(Case("Linear", [W((2, 3, 4), -2, 2), W((5, 4)), W((5,))], {"transB": 1, "activation": "gelu_tanh"}, extra_out=1, label="gelu"))
    # the LM head fused with its loss: outputs 1-4 are its unit-seed gradients and scratch
    add(Case("LinearCrossEntropy", [W((2, 3, 4)), W((5, 4)), W((5,)), C([1, 4, 0, 2, -1, 3], np.int64)],
             {"transB": 1, "reduction": "mean", "ignore_index": -1}, extra_out=4, label="3d-bias-mean-ignore"))
    add(Case("LinearCrossEntropy", [W((3, 4)), W((4, 5)), None, C([1, 4, 0], np.int64), C([0.3, 1.0, 0.5, 0.8, 2.0])],
             {"transB": 0, "reduction": "sum"}, extra_out=4, label="2d-weights-sum"))
    # the fused attention (made by the fuse_attention pass): O = softmax(scale·Q·Kt + M)·V;
    # output 1 (the rows' log-sum-exp) is kept for the gradient, not differentiated
    causal = np.where(np.arange(5)[None, :] > np.arange(3)[:, None] + 2, -np.inf, 0.0)
    add(Case("Attention", [W((2, 3, 4)), W((2, 4, 5)), W((2, 5, 3)), C(causal, np.float64)],
             {"scale": 0.7, "nan_guard": 1}, extra_out=1, label="causal-mask"))
    # K and V shared by the heads (broadcast batch: their gradients are summed), no mask
    add(Case("Attention", [W((2, 2, 3, 4)), W((2, 1, 4, 5)), W((2, 1, 5, 2))], {"scale": 1.0},
             extra_out=1, label="shared-kv"))
    # dropout on the probabilities: the stream key a constant, so the kept
    # elements and the function are fixed; the gradient regenerates the same factors from it
    add(Case("Attention", [W((2, 3, 4)), W((2, 4, 5)), W((2, 5, 3)), C(causal, np.float64), None, C([987654321], np.int64)],
             {"scale": 0.7, "nan_guard": 1, "dropout": 0.4}, extra_out=1, label="dropout"))
    # Llama's RMS normalisation (made by passes/fuse_rms_norm.rs): output 1 (1/rms per row) is
    # kept for the gradient, not differentiated
    add(Case("RmsNorm", [W((2, 3, 4)), W((4,))], {"epsilon": 1e-5}, extra_out=1, label="scaled"))
    add(Case("RmsNorm", [W((3, 5))], {"epsilon": 1e-6}, extra_out=1, label="unscaled"))
    return L


CASES = cases()


def _model(case: Case, weights: list[np.ndarray]) -> tuple[bytes, list[str]]:
    names, inits, wnames = [], [], []
    wi = iter(weights)
    for k, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{k}"
        names.append(name)
        if isinstance(spec, W):
            inits.append(numpy_helper.from_array(next(wi), name))
            wnames.append(name)
        else:
            inits.append(numpy_helper.from_array(spec, name))
    while names and names[-1] == "":
        names.pop()
    outs = [f"out{k}" for k in range(case.n_out)]
    node = helper.make_node(case.op, names, outs + [f"extra{k}" for k in range(case.extra_out)], **case.attrs)
    graph = helper.make_graph([node], "g", [], [onnx.ValueInfoProto(name=o) for o in outs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    return model.SerializeToString(), wnames


def _outputs(pending, n: int) -> list[np.ndarray]:
    outs = []
    for k in range(n):
        _, dt, shape = pending.output(k)
        a = np.empty(shape, dtype=NP_OF[dt])
        if a.size:
            pending.copy_output(k, a.ctypes.data)
        outs.append(a)
    return outs


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradcheck(case: Case, monkeypatch):
    # each op's own rule: no pass may rewrite the one-node model (MatMul into Linear, say)
    monkeypatch.setenv("ORTRAIN_DISABLE_PASSES", "all")
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    weights = [spec.draw(rng) for spec in case.inputs if isinstance(spec, W)]
    onnx_bytes, wnames = _model(case, weights)
    s = _ortrain.Session(onnx_bytes, wnames, [True] * len(wnames))
    assert all(s.has_grad), f"{case.op}: no gradient for {[n for n, h in zip(wnames, s.has_grad) if not h]}"
    addrs = [w.ctypes.data for w in weights]
    seed = 1234  # the same dropout mask in every pass

    p = s.forward([], addrs, True, seed)
    outs = _outputs(p, case.n_out)
    seeds = [rng.standard_normal(o.shape) if o.dtype == np.float64 else None for o in outs]
    assert any(sd is not None for sd in seeds), "the op has no float64 output"
    grads = [np.zeros_like(w) for w in weights]
    seed_addrs = [sd.ctypes.data if sd is not None else 0 for sd in seeds]
    s.backward(p, addrs, seed_addrs, [g.ctypes.data for g in grads])

    def loss() -> float:
        q = s.forward([], addrs, False, seed)
        try:
            return sum(float(np.sum(sd * o)) for sd, o in zip(seeds, _outputs(q, case.n_out)) if sd is not None)
        finally:
            q.release()

    for name, w, g in zip(wnames, weights, grads):
        num = np.zeros_like(w)
        flat, nflat = w.reshape(-1), num.reshape(-1)  # views: perturb the bound memory in place
        for j in range(flat.size):
            x0 = flat[j]
            flat[j] = x0 + EPS
            up = loss()
            flat[j] = x0 - EPS
            down = loss()
            flat[j] = x0
            nflat[j] = (up - down) / (2 * EPS)
        np.testing.assert_allclose(g, num, rtol=RTOL, atol=ATOL, err_msg=f"{case.id}: d/d{name}")


def test_every_differentiable_op_has_a_case():
    covered = {c.op for c in CASES}
    missing = [op for op, has_grad, _cpu, _internal, _cuda in _ortrain.op_table() if has_grad and op not in covered]
    assert not missing, "no gradcheck case for " + ", ".join(missing)


def test_cases_name_registered_differentiable_ops():
    table = {op: has_grad for op, has_grad, _cpu, _internal, _cuda in _ortrain.op_table()}
    stale = sorted({c.op for c in CASES if not table.get(c.op)})
    assert not stale, f"gradcheck cases for ops without a gradient rule: {stale}"
