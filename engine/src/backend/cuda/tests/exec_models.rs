//! The small models the CUDA executor tests run on both backends (tests/exec.rs): each a graph
//! with one input and named f32 weights, built here and exported to ONNX by the tests, so the
//! graph passes and autodiff run as for a user's model.
//!
//! `mlp` (Linear, MatMul, activations, broadcasting arithmetic, Transpose), `movement` (Expand,
//! Slice, Concat, Split, Trilu and their gradients), `masks` (Max/Min, Cast to f64 and bool,
//! Erf, Mod, IsNaN/IsInf, Where and their gradients), `embedding` (int64 ids: Gather,
//! GatherElements and their gradients, Cast of integers), `attention_bits`, `self_attention`
//! (both exporters' attention), `lm_head` (the LM head and its loss), `reductions`
//! (ReduceSum/Mean/Max/Min over several axis sets and ReduceGrad), `conv_net` (Conv, BatchNorm,
//! the pools and their gradients), `conv1d_scan_gather` (a grouped dilated 1-D Conv, CumSum,
//! GatherND and their gradients), `pow_mixed` (Pow with int and f64 exponents); from
//! exec_models_products.rs `qkv_select` and `folded_scores`, and from exec_models_norms.rs
//! `pre_norm_residual` and `rms_pre_norm`. `dropout_mlp` (a training-mode Dropout: its masks
//! differ between backends by design) and `random_draws_mlp` (the random-draw ops, likewise) are for
//! tests comparing GPU runs with each other.

use std::sync::Arc;

pub(super) use super::exec_models_norms::*;
pub(super) use super::exec_models_products::*;
use super::support::*;
use crate::ir::{Attr, Attrs, Dim, Graph, ValueId, ValueKind};
use crate::session::Sig;
use crate::tensor::{DType, Data, Tensor};

/// A test model: a graph with one input (f32, or int64 indices), named f32 weights (with data)
/// and its f32 outputs.
pub(super) struct Model {
    pub(super) graph: Graph,
    pub(super) input: Vec<usize>,
    /// The input's type; for int64 inputs, indices are drawn in [-`index_bound`, `index_bound`)
    /// (valid for a dimension of that size, negative ones included).
    pub(super) input_dtype: DType,
    pub(super) index_bound: i64,
    pub(super) weights: Vec<(String, Vec<usize>)>,
}

impl Model {
    pub(super) fn sig(&self) -> Sig {
        (self.input_dtype, self.input.clone())
    }
    /// Random input bytes of the model's input type.
    pub(super) fn input_bytes(&self, rng: &mut Rng) -> Vec<u8> {
        let n: usize = self.input.iter().product();
        match self.input_dtype {
            DType::I64 => (0..n).flat_map(|_| rng.int(-self.index_bound, self.index_bound).to_le_bytes()).collect(),
            _ => bytes_of(&rng.f32s(n, -1.0, 1.0)).to_vec(),
        }
    }
}

pub(super) fn new_model(input: &[usize]) -> (Graph, ValueId) {
    new_model_of(input, DType::F32)
}

pub(super) fn new_model_of(input: &[usize], dtype: DType) -> (Graph, ValueId) {
    let mut g = Graph::default();
    let x = g.add_value("x", ValueKind::Input, Some(dtype), Some(input.iter().map(|&d| Dim::Known(d)).collect()));
    g.inputs.push(x);
    (g, x)
}

pub(super) fn ints(g: &mut Graph, name: &str, v: &[i64]) -> ValueId {
    g.add_const(name, Tensor::from_i64(vec![v.len()], v.to_vec()))
}

pub(super) fn weight(g: &mut Graph, ws: &mut Vec<(String, Vec<usize>)>, name: &str, shape: &[usize], rng: &mut Rng) -> ValueId {
    let v = g.add_value(name, ValueKind::Weight, Some(DType::F32), Some(shape.iter().map(|&d| Dim::Known(d)).collect()));
    let n = shape.iter().product();
    g.weights.push((v, Some(Arc::new(Tensor::from_f32(shape.to_vec(), rng.f32s(n, -0.5, 0.5))))));
    ws.push((name.to_string(), shape.to_vec()));
    v
}

pub(super) fn op(g: &mut Graph, name: &str, op: &str, ins: &[ValueId], attrs: Attrs) -> ValueId {
    g.add_node(name, op, ins.iter().map(|&v| Some(v)).collect(), attrs, 1)[0]
}

/// Linear layers with bias and activations over a 3-D input (batch folded into rows), a
/// batched MatMul against a weight, broadcasting arithmetic and a Transpose.
pub(super) fn mlp(rng: &mut Rng) -> Model {
    let input = vec![2, 3, 5];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w1 = weight(&mut g, &mut ws, "w1", &[8, 5], rng);
    let b1 = weight(&mut g, &mut ws, "b1", &[8], rng);
    let w2 = weight(&mut g, &mut ws, "w2", &[8, 4], rng);
    let s = weight(&mut g, &mut ws, "s", &[4], rng);
    let t = op(&mut g, "t1", "Transpose", &[w1], Attrs::default().with("perm", Attr::Ints(vec![1, 0])));
    let h = op(&mut g, "mm1", "MatMul", &[x, t], Attrs::default());
    let h = op(&mut g, "add1", "Add", &[h, b1], Attrs::default());
    let h = op(&mut g, "relu", "Relu", &[h], Attrs::default());
    let h = op(&mut g, "mm2", "MatMul", &[h, w2], Attrs::default());
    let h = op(&mut g, "tanh", "Tanh", &[h], Attrs::default());
    let h2 = op(&mut g, "mul", "Mul", &[h, s], Attrs::default());
    let h3 = op(&mut g, "sig", "Sigmoid", &[h2], Attrs::default());
    let y = op(&mut g, "sub", "Sub", &[h3, h], Attrs::default());
    let yt = op(&mut g, "t2", "Transpose", &[y], Attrs::default().with("perm", Attr::Ints(vec![2, 0, 1])));
    g.outputs.push(yt);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// A transformer MLP: MatMul, GELU (tanh) and LeakyReLU outputs read through a Reshape by the
/// next MatMul, whose weight gradient reads them again in the backward pass: the CUDA train
/// graph recomputes both there (passes/recompute.rs), and the GELU's gradient, with the first
/// layer's bias gradient, comes out of the projection's dX product (passes/matmul_gelu_grad.rs:
/// cuBLASLt's DGELU_BGRAD epilogue at a `hidden` width that is a multiple of 8, else the
/// product, the gradient kernel and a column sum).
pub(super) fn gelu_mlp(rng: &mut Rng, hidden: usize) -> Model {
    let input = vec![2, 3, 6];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w1 = weight(&mut g, &mut ws, "w1", &[6, hidden], rng);
    let w2 = weight(&mut g, &mut ws, "w2", &[hidden, 8], rng);
    let w3 = weight(&mut g, &mut ws, "w3", &[8, 4], rng);
    let b1 = weight(&mut g, &mut ws, "b1", &[hidden], rng);
    let h = op(&mut g, "fc", "MatMul", &[x, w1], Attrs::default());
    let h = op(&mut g, "fc_bias", "Add", &[h, b1], Attrs::default());
    let a = op(&mut g, "gelu", "Gelu", &[h], Attrs::default().with("approximate", Attr::String("tanh".into())));
    let rows = ints(&mut g, "rows", &[6, hidden as i64]);
    let a = op(&mut g, "view", "Reshape", &[a, rows], Attrs::default());
    let h2 = op(&mut g, "proj", "MatMul", &[a, w2], Attrs::default());
    let l = op(&mut g, "leaky", "LeakyRelu", &[h2], Attrs::default().with("alpha", Attr::Float(0.1)));
    let y = op(&mut g, "out", "MatMul", &[l, w3], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// A Linear, a training-mode Dropout (ratio 0.3) and a Tanh: the masks come from the step's
/// seed, so two GPU runs of one step agree only if they drew from the same seed.
pub(super) fn dropout_mlp(rng: &mut Rng) -> Model {
    let input = vec![4, 64];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[64, 48], rng);
    let h = op(&mut g, "mm", "MatMul", &[x, w], Attrs::default());
    let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.3]));
    let training = g.add_const("training", Tensor::new(vec![], crate::tensor::Data::Bool(vec![1])).expect("bool"));
    let d = g.add_node("drop", "Dropout", vec![Some(h), Some(ratio), Some(training)], Attrs::default(), 1)[0];
    let y = op(&mut g, "tanh", "Tanh", &[d], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// The random draws in a training step: a DropPath-like mask (RandomUniformLike < 0.7), noise
/// (RandomNormalLike), Bernoulli of a sigmoid and a RandomUniform of a fixed shape; gradients
/// flow around them (none through them). Their numbers differ between backends, like Dropout's.
pub(super) fn random_draws_mlp(rng: &mut Rng) -> Model {
    let input = vec![4, 64];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[64, 48], rng);
    let h = op(&mut g, "mm", "MatMul", &[x, w], Attrs::default());
    let u = op(&mut g, "uniform", "RandomUniformLike", &[h], Attrs::default().with("dtype", Attr::Int(1)));
    let keep_p = g.add_const("keep_p", Tensor::from_f32(vec![], vec![0.7]));
    let keep = op(&mut g, "keep", "Less", &[u, keep_p], Attrs::default());
    let keep = op(&mut g, "keep_f", "Cast", &[keep], Attrs::default().with("to", Attr::Int(1)));
    let kept = op(&mut g, "kept", "Mul", &[h, keep], Attrs::default());
    let noise = op(&mut g, "noise", "RandomNormalLike", &[h], Attrs::default().with("scale", Attr::Float(0.1)));
    let noisy = op(&mut g, "noisy", "Add", &[kept, noise], Attrs::default());
    let p = op(&mut g, "p", "Sigmoid", &[h], Attrs::default());
    let b = op(&mut g, "coin", "Bernoulli", &[p], Attrs::default());
    let y = op(&mut g, "gated", "Mul", &[noisy, b], Attrs::default());
    let shaped = Attrs::default().with("shape", Attr::Ints(vec![48])).with("low", Attr::Float(-0.5)).with("high", Attr::Float(0.5));
    let r = op(&mut g, "offset", "RandomUniform", &[], shaped);
    let y = op(&mut g, "shifted", "Add", &[y, r], Attrs::default());
    let y = op(&mut g, "tanh", "Tanh", &[y], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Data movement: Expand of a weight (ReduceSumTo back), Slice with a negative step and
/// negative axes (SliceGrad), Concat on axis -1 (ConcatGrad of each part), Split with an unused
/// output (its gradient: Concat with an Affine zero part), Trilu with a constant k (Trilu of dy).
pub(super) fn movement(rng: &mut Rng) -> Model {
    let input = vec![2, 3, 6];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[6, 8], rng);
    let e = weight(&mut g, &mut ws, "e", &[1, 8], rng);
    let u = weight(&mut g, &mut ws, "u", &[2, 2, 3], rng);
    let h = op(&mut g, "mm", "MatMul", &[x, w], Attrs::default());
    let shape = ints(&mut g, "expand_shape", &[3, 8]);
    let e8 = op(&mut g, "expand", "Expand", &[e, shape], Attrs::default());
    let h = op(&mut g, "add", "Add", &[h, e8], Attrs::default());
    // axis -1: 7, 5, 3, 1; axis 1: 1..3
    let (st, en, ax, sp) = (
        ints(&mut g, "starts", &[-1, 1]),
        ints(&mut g, "ends", &[-100, 3]),
        ints(&mut g, "axes", &[-1, 1]),
        ints(&mut g, "steps", &[-2, 1]),
    );
    let s1 = g.add_node("slice", "Slice", vec![Some(h), Some(st), Some(en), Some(ax), Some(sp)], Attrs::default(), 1)[0];
    let c = op(&mut g, "concat", "Concat", &[s1, u], Attrs::default().with("axis", Attr::Int(-1)));
    let sizes = ints(&mut g, "split_sizes", &[3, 2, 2]);
    let parts = g.add_node("split", "Split", vec![Some(c), Some(sizes)], Attrs::default().with("axis", Attr::Int(2)), 3);
    let y = op(&mut g, "concat2", "Concat", &[parts[1], parts[0]], Attrs::default().with("axis", Attr::Int(-1)));
    let k = g.add_const("trilu_k", Tensor::from_i64(vec![], vec![1]));
    let z = op(&mut g, "trilu", "Trilu", &[y, k], Attrs::default().with("upper", Attr::Int(0)));
    g.outputs.push(z);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Element-wise: Max and Min against broadcast weights (MinMaxGrad), Cast to f64 and back
/// (CastLike both ways in the backward), Erf in f64 (ErfGrad), Mod and fmod, a Cast to bool
/// and IsNaN/IsInf/Or as Where conditions (MaskSelect both ways), a bool Cast back to f32.
pub(super) fn masks(rng: &mut Rng) -> Model {
    let input = vec![3, 5];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let a = weight(&mut g, &mut ws, "a", &[3, 5], rng);
    let b = weight(&mut g, &mut ws, "b", &[5], rng);
    let c = weight(&mut g, &mut ws, "c", &[5], rng);
    let none = Attrs::default;
    let to = |code: i64| Attrs::default().with("to", Attr::Int(code));
    let h = op(&mut g, "mul", "Mul", &[x, a], none());
    let m = op(&mut g, "max", "Max", &[h, b], none());
    let m64 = op(&mut g, "to_f64", "Cast", &[m], to(11));
    let e = op(&mut g, "erf", "Erf", &[m64], none());
    let e32 = op(&mut g, "to_f32", "Cast", &[e], to(1));
    // cond: floor(4 · (x mod 0.5)) ∈ {0, 1}, as bool
    let half = g.add_const("half", Tensor::from_f32(vec![1], vec![0.5]));
    let four = g.add_const("four", Tensor::from_f32(vec![1], vec![4.0]));
    let r = op(&mut g, "mod", "Mod", &[x, half], Attrs::default().with("fmod", Attr::Int(0)));
    let r = op(&mut g, "mul4", "Mul", &[r, four], none());
    let f = op(&mut g, "floor", "Floor", &[r], none());
    let cond = op(&mut g, "to_bool", "Cast", &[f], to(9));
    let lo = op(&mut g, "min", "Min", &[h, c], none());
    let w = op(&mut g, "where", "Where", &[cond, e32, lo], none());
    // a NaN/inf guard that never fires
    let nan = op(&mut g, "isnan", "IsNaN", &[h], none());
    let inf = op(&mut g, "isinf", "IsInf", &[h], Attrs::default().with("detect_negative", Attr::Int(0)));
    let bad = op(&mut g, "or", "Or", &[nan, inf], none());
    let zero = g.add_const("zero", Tensor::from_f32(vec![1], vec![0.0]));
    let w = op(&mut g, "guard", "Where", &[bad, zero, w], none());
    let cf = op(&mut g, "cond_f32", "Cast", &[cond], to(1));
    let y = op(&mut g, "scale", "Mul", &[w, cf], none());
    let y2 = op(&mut g, "sum", "Add", &[y, w], none());
    let third = g.add_const("third", Tensor::from_f32(vec![1], vec![0.3]));
    let fm = op(&mut g, "fmod", "Mod", &[x, third], Attrs::default().with("fmod", Attr::Int(1)));
    let y2 = op(&mut g, "plus_fmod", "Add", &[y2, fm], none());
    g.outputs.push(y2);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Indices: an embedding Gather of int64 ids (GatherGrad into the table), a Gather on axis -2
/// with a negative constant index, GatherElements on axis -1 (GatherElementsGrad), and the ids
/// cast to f32.
pub(super) fn embedding(rng: &mut Rng) -> Model {
    let input = vec![2, 4];
    let vocab = 6;
    let (mut g, ids) = new_model_of(&input, DType::I64);
    let mut ws = Vec::new();
    let emb = weight(&mut g, &mut ws, "emb", &[vocab, 5], rng);
    let w = weight(&mut g, &mut ws, "w", &[5, 3], rng);
    let h = op(&mut g, "lookup", "Gather", &[emb, ids], Attrs::default());
    let h = op(&mut g, "mm", "MatMul", &[h, w], Attrs::default());
    let idx: Vec<i64> = (0..16).map(|i| [0, 2, -1, 1, -3, 2, 1, 0][i % 8]).collect();
    let idx = g.add_const("elements_idx", Tensor::from_i64(vec![2, 4, 2], idx));
    let ge = op(&mut g, "elements", "GatherElements", &[h, idx], Attrs::default().with("axis", Attr::Int(-1)));
    let cid = op(&mut g, "ids_f32", "Cast", &[ids], Attrs::default().with("to", Attr::Int(1)));
    let axes = ints(&mut g, "unsq_axes", &[-1]);
    let u = op(&mut g, "unsq", "Unsqueeze", &[cid, axes], Attrs::default());
    let y = op(&mut g, "scaled", "Mul", &[ge, u], Attrs::default());
    g.outputs.push(y);
    let rows = ints(&mut g, "rows", &[-1, 1, 1]);
    let y2 = op(&mut g, "pick", "Gather", &[h, rows], Attrs::default().with("axis", Attr::Int(-2)));
    g.outputs.push(y2);
    Model { graph: g, input, input_dtype: DType::I64, index_bound: vocab as i64, weights: ws }
}

/// Pow with exponents of other types than the base (int64, int32 and float64 constants, as the
/// exporters write `x ** 2`): the CUDA kernel reads both operands as the base's type, so the
/// dispatcher casts the exponent first.
pub(super) fn pow_mixed(rng: &mut Rng) -> Model {
    let input = vec![3, 4];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[4, 4], rng);
    let h = op(&mut g, "mm", "MatMul", &[x, w], Attrs::default());
    let two = g.add_const("two_i64", Tensor::from_i64(vec![], vec![2]));
    let three = g.add_const("three_i32", Tensor { shape: vec![1], data: Data::I32(vec![3]) });
    let half = g.add_const("two_f64", Tensor { shape: vec![], data: Data::F64(vec![2.0]) });
    let sq = op(&mut g, "square", "Pow", &[h, two], Attrs::default());
    let cube = op(&mut g, "cube", "Pow", &[h, three], Attrs::default());
    let sq2 = op(&mut g, "square_f64", "Pow", &[h, half], Attrs::default());
    let y = op(&mut g, "sum1", "Add", &[sq, cube], Attrs::default());
    let y = op(&mut g, "sum2", "Add", &[y, sq2], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// LayerNorm, Softmax, Dropout (inference mode: masks of a training-mode Dropout differ
/// between backends by design), LogSoftmax and a softmax cross-entropy with ignore_index.
pub(super) fn attention_bits(rng: &mut Rng) -> Model {
    let input = vec![2, 6, 8];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let scale = weight(&mut g, &mut ws, "ln_scale", &[8], rng);
    let bias = weight(&mut g, &mut ws, "ln_bias", &[8], rng);
    let w = weight(&mut g, &mut ws, "w", &[8, 8], rng);
    let h = op(&mut g, "ln", "LayerNormalization", &[x, scale, bias], Attrs::default().with("axis", Attr::Int(-1)));
    let h = op(&mut g, "mm", "MatMul", &[h, w], Attrs::default());
    let p = op(&mut g, "sm", "Softmax", &[h], Attrs::default().with("axis", Attr::Int(-1)));
    let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.3]));
    let training = g.add_const("training", Tensor::new(vec![], crate::tensor::Data::Bool(vec![0])).expect("bool"));
    let d = g.add_node("drop", "Dropout", vec![Some(p), Some(ratio), Some(training)], Attrs::default(), 1)[0];
    let lp = op(&mut g, "lsm", "LogSoftmax", &[d], Attrs::default().with("axis", Attr::Int(1)));
    g.outputs.push(lp);
    let shape = ints(&mut g, "rows", &[12, 8]);
    let scores = op(&mut g, "flat", "Reshape", &[h, shape], Attrs::default());
    let labels = g.add_const("labels", Tensor::from_i64(vec![12], (0..12).map(|i| (i * 5 % 8) as i64).collect()));
    let loss = op(
        &mut g,
        "ce",
        "SoftmaxCrossEntropyLoss",
        &[scores, labels],
        Attrs::default().with("ignore_index", Attr::Int(2)).with("reduction", Attr::String("mean".into())),
    );
    g.outputs.push(loss);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Self-attention over x [2, 70, 8] (three 32-row tiles, the last partial; the causal mask's
/// upper tiles are skipped by the kernels) with 2 heads of 4, written as the exporters write it: Q and
/// Kᵀ from Reshape + Transpose, then either torchlib's scaled_dot_product_attention (Q and Kᵀ
/// each scaled by √scale, a causal -inf mask added, `Where(IsNaN(p), 0, p)` after the softmax)
/// or the eager form (scores / √D, a [B, 1, 1, S] padding mask of 0 / -1e9, no guard).
pub(super) fn self_attention(rng: &mut Rng, torchlib: bool) -> Model {
    self_attention_of(rng, torchlib, 70, 4)
}

/// The same over x [2, t, 2·hd] with 2 heads of `hd` (the scale 1/√hd; the padding: the first
/// sample's last 5 positions and the second's last 40).
pub(super) fn self_attention_of(rng: &mut Rng, torchlib: bool, t: usize, hd: usize) -> Model {
    self_attention_masked(rng, torchlib, t, hd, f32::NEG_INFINITY)
}

/// As `self_attention_of`, the torchlib form's causal mask filled with `masked` above the
/// diagonal (-inf as torchlib writes it; f32::MIN, finfo.min, as Hugging Face's models do).
pub(super) fn self_attention_masked(rng: &mut Rng, torchlib: bool, t: usize, hd: usize, masked: f32) -> Model {
    self_attention_built(rng, torchlib, t, hd, masked, 0.0)
}

/// As `self_attention_of`, with a training-mode Dropout of `ratio` on the probabilities (as
/// Hugging Face's attn_pdrop and torchlib's dropout_p put it): named "attn_drop".
pub(super) fn self_attention_dropped(rng: &mut Rng, torchlib: bool, t: usize, hd: usize, ratio: f32) -> Model {
    self_attention_built(rng, torchlib, t, hd, f32::NEG_INFINITY, ratio)
}

fn self_attention_built(rng: &mut Rng, torchlib: bool, t: usize, hd: usize, masked: f32, ratio: f32) -> Model {
    #[allow(non_snake_case)]
    let T = t;
    let width = 2 * hd;
    let input = vec![2, T, width];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let perm = |p: &[i64]| Attrs::default().with("perm", Attr::Ints(p.to_vec()));
    let dropped = |g: &mut crate::ir::Graph, p| {
        if ratio == 0.0 {
            return p;
        }
        let r = g.add_const("attn_ratio", Tensor::from_f32(vec![], vec![ratio]));
        let on = g.add_const("attn_training", Tensor::new(vec![], crate::tensor::Data::Bool(vec![1])).expect("bool"));
        g.add_node("attn_drop", "Dropout", vec![Some(p), Some(r), Some(on)], Attrs::default(), 1)[0]
    };
    let heads = ints(&mut g, "heads", &[2, T as i64, 2, hd as i64]);
    let q = {
        let w = weight(&mut g, &mut ws, "wq", &[width, width], rng);
        let h = op(&mut g, "q_mm", "MatMul", &[x, w], Attrs::default());
        let h = op(&mut g, "q_split", "Reshape", &[h, heads], Attrs::default());
        op(&mut g, "q_t", "Transpose", &[h], perm(&[0, 2, 1, 3]))
    };
    let kt = {
        let w = weight(&mut g, &mut ws, "wk", &[width, width], rng);
        let h = op(&mut g, "k_mm", "MatMul", &[x, w], Attrs::default());
        let h = op(&mut g, "k_split", "Reshape", &[h, heads], Attrs::default());
        op(&mut g, "k_t", "Transpose", &[h], perm(&[0, 2, 3, 1]))
    };
    let v = {
        let w = weight(&mut g, &mut ws, "wv", &[width, width], rng);
        let h = op(&mut g, "v_mm", "MatMul", &[x, w], Attrs::default());
        let h = op(&mut g, "v_split", "Reshape", &[h, heads], Attrs::default());
        op(&mut g, "v_t", "Transpose", &[h], perm(&[0, 2, 1, 3]))
    };
    let o = if torchlib {
        // as torchlib writes it: Sqrt(CastLike(scale, q)), folded at plan time
        let scale = g.add_const("scale", Tensor::from_f32(vec![], vec![1.0 / (hd as f32).sqrt()]));
        let c = op(&mut g, "scale_like_q", "CastLike", &[scale, q], Attrs::default());
        let c = op(&mut g, "sqrt_scale", "Sqrt", &[c], Attrs::default());
        let qs = op(&mut g, "q_scaled", "Mul", &[q, c], Attrs::default());
        let ks = op(&mut g, "k_scaled", "Mul", &[kt, c], Attrs::default());
        let s = op(&mut g, "scores", "MatMul", &[qs, ks], Attrs::default());
        let causal: Vec<f32> = (0..T * T).map(|i| if i % T > i / T { masked } else { 0.0 }).collect();
        let mask = g.add_const("causal", Tensor::from_f32(vec![1, 1, T, T], causal));
        let s = op(&mut g, "masked", "Add", &[s, mask], Attrs::default());
        let p = op(&mut g, "probs", "Softmax", &[s], Attrs::default().with("axis", Attr::Int(-1)));
        let nan = op(&mut g, "isnan", "IsNaN", &[p], Attrs::default());
        let zero = g.add_const("zero", Tensor::from_f32(vec![], vec![0.0]));
        let p = g.add_node("guard", "Where", vec![Some(nan), Some(zero), Some(p)], Attrs::default(), 1)[0];
        let p = dropped(&mut g, p);
        op(&mut g, "context", "MatMul", &[p, v], Attrs::default())
    } else {
        let s = op(&mut g, "scores", "MatMul", &[q, kt], Attrs::default());
        let c = g.add_const("sqrt_d", Tensor::from_f32(vec![], vec![(hd as f32).sqrt()]));
        let s = op(&mut g, "scaled", "Div", &[s, c], Attrs::default());
        // the first sample's last 5 positions and the second's last 40 are padding
        let pad: Vec<f32> = (0..2 * T).map(|i| if (i < T && i >= T - 5) || i >= 2 * T - 40 { -1e9 } else { 0.0 }).collect();
        let mask = g.add_const("padding", Tensor::from_f32(vec![2, 1, 1, T], pad));
        let s = op(&mut g, "masked", "Add", &[mask, s], Attrs::default());
        let p = op(&mut g, "probs", "Softmax", &[s], Attrs::default().with("axis", Attr::Int(-1)));
        let p = dropped(&mut g, p);
        op(&mut g, "context", "MatMul", &[p, v], Attrs::default())
    };
    let o = op(&mut g, "merge_t", "Transpose", &[o], perm(&[0, 2, 1, 3]));
    let merged = ints(&mut g, "merged", &[2, T as i64, width as i64]);
    let o = op(&mut g, "merge", "Reshape", &[o, merged], Attrs::default());
    let wo = weight(&mut g, &mut ws, "wo", &[width, width], rng);
    let y = op(&mut g, "out", "MatMul", &[o, wo], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// An LM head and its loss, which CUDA sessions fuse into one LinearCrossEntropy:
/// Reshape(x·op(W) [+ b], [-1, C]) into SoftmaxCrossEntropyLoss. `big`: x [3, 3000, 8] (9000
/// rows: 18 chunks of 500 under the CUDA budget), W [C, 8] read through a Transpose (transB),
/// a bias, class weights, ignore_index and the mean; otherwise x [2, 35, 8] (one chunk), W [8, C],
/// no bias, the sum.
pub(super) fn lm_head(rng: &mut Rng, big: bool) -> Model {
    let input = if big { vec![3, 3000, 8] } else { vec![2, 35, 8] };
    lm_head_with(rng, input, 40, big, if big { "mean" } else { "sum" })
}

/// The LM head over `input` ([a, b, K]) and `classes`; `full`: W [C, K] through a Transpose, a
/// bias, class weights and ignore_index 3 (else W [K, C] alone); `reduction` of the loss.
pub(super) fn lm_head_with(rng: &mut Rng, input: Vec<usize>, classes: usize, full: bool, reduction: &str) -> Model {
    let (c, k) = (classes, input[2]);
    let rows: usize = input[..2].iter().product();
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let h = if full {
        let w = weight(&mut g, &mut ws, "w", &[c, k], rng);
        let b = weight(&mut g, &mut ws, "b", &[c], rng);
        let wt = op(&mut g, "w_t", "Transpose", &[w], Attrs::default().with("perm", Attr::Ints(vec![1, 0])));
        let h = op(&mut g, "head", "MatMul", &[x, wt], Attrs::default());
        op(&mut g, "head_bias", "Add", &[h, b], Attrs::default())
    } else {
        let w = weight(&mut g, &mut ws, "w", &[k, c], rng);
        op(&mut g, "head", "MatMul", &[x, w], Attrs::default())
    };
    let shape = ints(&mut g, "rows", &[-1, c as i64]);
    let scores = op(&mut g, "flat", "Reshape", &[h, shape], Attrs::default());
    let labels = g.add_const("labels", Tensor::from_i64(vec![rows], (0..rows).map(|i| (i * 7 % c) as i64).collect()));
    let mut ins = vec![Some(scores), Some(labels)];
    let mut attrs = Attrs::default().with("reduction", Attr::String(reduction.into()));
    if full {
        let cw = g.add_const("class_weights", Tensor::from_f32(vec![c], (0..c).map(|c| 0.5 + (c % 3) as f32 * 0.25).collect()));
        ins.push(Some(cw));
        attrs.set("ignore_index", Attr::Int(3));
    }
    let loss = g.add_node("ce", "SoftmaxCrossEntropyLoss", ins, attrs, 1)[0];
    g.outputs.push(loss);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// Reductions, each kernel shape: h = x·W [2, 3, 6]; c = h − ReduceMean(h, [-1]) (the sum by a
/// matrix product, scaled); d = c·ReduceMax(x, [-1]) + ReduceMin(x, [0, 2]) (Max and Min of the
/// input: no gradient needed); outputs ReduceSum(d, [1]) (a thread per output), ReduceMean(d,
/// [0, 2]) (a block per output, scaled) and ReduceSum(h, [0]) with keepdims 0 (over rows by a
/// matrix product). The gradients are ReduceGrad and ReduceSumTo.
pub(super) fn reductions(rng: &mut Rng) -> Model {
    let input = vec![2, 3, 4];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[4, 6], rng);
    let axes = |v: &[i64]| Attrs::default().with("axes", Attr::Ints(v.to_vec()));
    let h = op(&mut g, "mm", "MatMul", &[x, w], Attrs::default());
    let mean = op(&mut g, "row_mean", "ReduceMean", &[h], axes(&[-1]));
    let c = op(&mut g, "center", "Sub", &[h, mean], Attrs::default());
    let mx = op(&mut g, "x_max", "ReduceMax", &[x], axes(&[-1]));
    let mn = op(&mut g, "x_min", "ReduceMin", &[x], axes(&[0, 2]));
    let d = op(&mut g, "scale", "Mul", &[c, mx], Attrs::default());
    let d = op(&mut g, "shift", "Add", &[d, mn], Attrs::default());
    let a1 = ints(&mut g, "sum_axes", &[1]);
    let y1 = op(&mut g, "sum_mid", "ReduceSum", &[d, a1], Attrs::default());
    let y2 = op(&mut g, "mean_outer", "ReduceMean", &[d], axes(&[0, 2]));
    let a0 = ints(&mut g, "rows_axes", &[0]);
    let y3 = op(&mut g, "sum_rows", "ReduceSum", &[h, a0], Attrs::default().with("keepdims", Attr::Int(0)));
    g.outputs.extend([y1, y2, y3]);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// A small CNN: Conv (3×3, pads 1, strides [2, 1], bias) → Relu → BatchNormalization in
/// training mode (running statistics as extra outputs) → MaxPool (2×2, stride 1, Indices for
/// the gradient) → grouped 1×1 Conv (the direct path, 2 groups) → AveragePool (3×2, pads,
/// count_include_pad) and GlobalAveragePool. Gradients: ConvGradX/W/B, BatchNormGrad,
/// MaxPoolGrad, AveragePoolGrad, GlobalAveragePoolGrad.
pub(super) fn conv_net(rng: &mut Rng) -> Model {
    let input = vec![2, 3, 7, 6];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w1 = weight(&mut g, &mut ws, "w1", &[4, 3, 3, 3], rng);
    let b1 = weight(&mut g, &mut ws, "b1", &[4], rng);
    let gamma = weight(&mut g, &mut ws, "gamma", &[4], rng);
    let beta = weight(&mut g, &mut ws, "beta", &[4], rng);
    let w2 = weight(&mut g, &mut ws, "w2", &[4, 2, 1, 1], rng);
    let ints_attr = |v: &[i64]| Attr::Ints(v.to_vec());
    let c1 = op(
        &mut g,
        "conv1",
        "Conv",
        &[x, w1, b1],
        Attrs::default().with("pads", ints_attr(&[1, 1, 1, 1])).with("strides", ints_attr(&[2, 1])),
    );
    let r = op(&mut g, "relu", "Relu", &[c1], Attrs::default());
    let mean = g.add_const("running_mean", Tensor::from_f32(vec![4], vec![0.1, -0.2, 0.0, 0.3]));
    let var = g.add_const("running_var", Tensor::from_f32(vec![4], vec![1.0, 0.5, 2.0, 1.5]));
    let bn_attrs =
        Attrs::default().with("training_mode", Attr::Int(1)).with("momentum", Attr::Float(0.8)).with("epsilon", Attr::Float(1e-3));
    let bn = g.add_node("bn", "BatchNormalization", vec![Some(r), Some(gamma), Some(beta), Some(mean), Some(var)], bn_attrs, 3);
    let mp = op(&mut g, "maxpool", "MaxPool", &[bn[0]], Attrs::default().with("kernel_shape", ints_attr(&[2, 2])));
    let c2 = op(&mut g, "conv2", "Conv", &[mp, w2], Attrs::default().with("group", Attr::Int(2)));
    let avg_attrs = Attrs::default()
        .with("kernel_shape", ints_attr(&[3, 2]))
        .with("pads", ints_attr(&[1, 0, 1, 1]))
        .with("count_include_pad", Attr::Int(1));
    let ap = op(&mut g, "avgpool", "AveragePool", &[c2], avg_attrs);
    let gp = op(&mut g, "gap", "GlobalAveragePool", &[c2], Attrs::default());
    g.outputs.extend([ap, gp, bn[1], bn[2]]);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// A 1-D convolution (grouped, dilated, SAME_UPPER) into CumSum and GatherND: h = Conv1d(x)
/// [2, 4, 9]; CumSum over the last axis (reverse, exclusive); GatherND with batch_dims 1 and
/// index tuples of length 1, a repeated and a negative index (GatherNDGrad sums the repeat).
pub(super) fn conv1d_scan_gather(rng: &mut Rng) -> Model {
    let input = vec![2, 4, 9];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w = weight(&mut g, &mut ws, "w", &[4, 2, 3], rng);
    let conv_attrs = Attrs::default()
        .with("group", Attr::Int(2))
        .with("dilations", Attr::Ints(vec![2]))
        .with("auto_pad", Attr::String("SAME_UPPER".into()));
    let h = op(&mut g, "conv", "Conv", &[x, w], conv_attrs);
    let axis = g.add_const("cumsum_axis", Tensor::from_i64(vec![], vec![-1]));
    let cs = op(&mut g, "cumsum", "CumSum", &[h, axis], Attrs::default().with("reverse", Attr::Int(1)).with("exclusive", Attr::Int(1)));
    let idx = g.add_const("nd_indices", Tensor::from_i64(vec![2, 3, 1], vec![1, 3, 0, 2, 2, -1]));
    let y = op(&mut g, "gather_nd", "GatherND", &[cs, idx], Attrs::default().with("batch_dims", Attr::Int(1)));
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

pub(super) fn models() -> Vec<(&'static str, Model)> {
    let mut rng = Rng::new(3);
    vec![
        ("mlp", mlp(&mut rng)),
        ("gelu_mlp", gelu_mlp(&mut rng, 16)),
        ("movement", movement(&mut rng)),
        ("masks", masks(&mut rng)),
        ("embedding", embedding(&mut rng)),
        ("attention_bits", attention_bits(&mut rng)),
        ("pre_norm_residual", pre_norm_residual(&mut rng)),
        ("sdpa_causal", self_attention(&mut rng, true)),
        ("eager_attention_padding", self_attention(&mut rng, false)),
        ("lm_head_chunked", lm_head(&mut rng, true)),
        ("lm_head", lm_head(&mut rng, false)),
        ("reductions", reductions(&mut rng)),
        ("conv_net", conv_net(&mut rng)),
        ("conv1d_scan_gather", conv1d_scan_gather(&mut rng)),
        ("pow_mixed", pow_mixed(&mut rng)),
        ("gelu_mlp_12", gelu_mlp(&mut rng, 12)),
        ("folded_scores", folded_scores(&mut rng)),
        ("rms_pre_norm", rms_pre_norm(&mut rng)),
    ]
}

pub(super) fn bytes_of(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice covers exactly v's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
