//! The CUDA executor against the CPU executor: small graphs built here, exported to ONNX and
//! imported into a Session (so the graph passes and autodiff run as for a user's model), then
//! one training step (forward, seeded backward) on each backend; outputs and every weight
//! gradient must agree. Without a GPU the plans are still checked to have a CUDA kernel for
//! every step (so a missing kernel fails in CI, not on the rare GPU run), the models are
//! checked to run the op types they are meant to cover, and their CPU half runs.
//!
//! Models: `mlp` (Linear, MatMul, activations, broadcasting arithmetic, Transpose), `movement`
//! (Expand, Slice, Concat, Split, Trilu and their gradients), `masks` (Max/Min, Cast to f64 and
//! bool, Erf, Mod, IsNaN/IsInf, Where and their gradients), `embedding` (int64 ids: Gather,
//! GatherElements and their gradients, Cast of integers).

use std::collections::HashMap;
use std::sync::Arc;

use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::ops::CudaCtx;
use crate::exec::cuda::{self as cexec, DeviceArena, DeviceBindings, DeviceConsts, InputSrc};
use crate::exec::Phase;
use crate::ir::{Attr, Attrs, Dim, Graph, ValueId, ValueKind};
use crate::session::{Session, Sig};
use crate::tensor::{DType, Tensor};

/// A test model: a graph with one input (f32, or int64 indices), named f32 weights (with data)
/// and its f32 outputs.
struct Model {
    graph: Graph,
    input: Vec<usize>,
    /// The input's type; for int64 inputs, indices are drawn in [-`index_bound`, `index_bound`)
    /// (valid for a dimension of that size, negative ones included).
    input_dtype: DType,
    index_bound: i64,
    weights: Vec<(String, Vec<usize>)>,
}

impl Model {
    fn sig(&self) -> Sig {
        (self.input_dtype, self.input.clone())
    }
    /// Random input bytes of the model's input type.
    fn input_bytes(&self, rng: &mut Rng) -> Vec<u8> {
        let n: usize = self.input.iter().product();
        match self.input_dtype {
            DType::I64 => (0..n).flat_map(|_| rng.int(-self.index_bound, self.index_bound).to_le_bytes()).collect(),
            _ => bytes_of(&rng.f32s(n, -1.0, 1.0)).to_vec(),
        }
    }
}

fn new_model(input: &[usize]) -> (Graph, ValueId) {
    new_model_of(input, DType::F32)
}

fn new_model_of(input: &[usize], dtype: DType) -> (Graph, ValueId) {
    let mut g = Graph::default();
    let x = g.add_value("x", ValueKind::Input, Some(dtype), Some(input.iter().map(|&d| Dim::Known(d)).collect()));
    g.inputs.push(x);
    (g, x)
}

fn ints(g: &mut Graph, name: &str, v: &[i64]) -> ValueId {
    g.add_const(name, Tensor::from_i64(vec![v.len()], v.to_vec()))
}

fn weight(g: &mut Graph, ws: &mut Vec<(String, Vec<usize>)>, name: &str, shape: &[usize], rng: &mut Rng) -> ValueId {
    let v = g.add_value(name, ValueKind::Weight, Some(DType::F32), Some(shape.iter().map(|&d| Dim::Known(d)).collect()));
    let n = shape.iter().product();
    g.weights.push((v, Some(Arc::new(Tensor::from_f32(shape.to_vec(), rng.f32s(n, -0.5, 0.5))))));
    ws.push((name.to_string(), shape.to_vec()));
    v
}

fn op(g: &mut Graph, name: &str, op: &str, ins: &[ValueId], attrs: Attrs) -> ValueId {
    g.add_node(name, op, ins.iter().map(|&v| Some(v)).collect(), attrs, 1)[0]
}

/// Linear layers with bias and activations over a 3-D input (batch folded into rows), a
/// batched MatMul against a weight, broadcasting arithmetic and a Transpose.
fn mlp(rng: &mut Rng) -> Model {
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

/// Data movement: Expand of a weight (ReduceSumTo back), Slice with a negative step and
/// negative axes (SliceGrad), Concat on axis -1 (ConcatGrad of each part), Split with an unused
/// output (its gradient: Concat with an Affine zero part), Trilu with a constant k (Trilu of dy).
fn movement(rng: &mut Rng) -> Model {
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
fn masks(rng: &mut Rng) -> Model {
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
fn embedding(rng: &mut Rng) -> Model {
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

/// LayerNorm, Softmax, Dropout (inference mode: masks of a training-mode Dropout differ
/// between backends by design), LogSoftmax and a softmax cross-entropy with ignore_index.
fn attention_bits(rng: &mut Rng) -> Model {
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
fn self_attention(rng: &mut Rng, torchlib: bool) -> Model {
    self_attention_of(rng, torchlib, 70, 4)
}

/// The same over x [2, t, 2·hd] with 2 heads of `hd` (the scale 1/√hd; the padding: the first
/// sample's last 5 positions and the second's last 40).
fn self_attention_of(rng: &mut Rng, torchlib: bool, t: usize, hd: usize) -> Model {
    #[allow(non_snake_case)]
    let T = t;
    let width = 2 * hd;
    let input = vec![2, T, width];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let perm = |p: &[i64]| Attrs::default().with("perm", Attr::Ints(p.to_vec()));
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
        let c = g.add_const("sqrt_scale", Tensor::from_f32(vec![], vec![(1.0 / (hd as f32).sqrt()).sqrt()]));
        let qs = op(&mut g, "q_scaled", "Mul", &[q, c], Attrs::default());
        let ks = op(&mut g, "k_scaled", "Mul", &[kt, c], Attrs::default());
        let s = op(&mut g, "scores", "MatMul", &[qs, ks], Attrs::default());
        let causal: Vec<f32> = (0..T * T).map(|i| if i % T > i / T { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = g.add_const("causal", Tensor::from_f32(vec![1, 1, T, T], causal));
        let s = op(&mut g, "masked", "Add", &[s, mask], Attrs::default());
        let p = op(&mut g, "probs", "Softmax", &[s], Attrs::default().with("axis", Attr::Int(-1)));
        let nan = op(&mut g, "isnan", "IsNaN", &[p], Attrs::default());
        let zero = g.add_const("zero", Tensor::from_f32(vec![], vec![0.0]));
        let p = g.add_node("guard", "Where", vec![Some(nan), Some(zero), Some(p)], Attrs::default(), 1)[0];
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
/// rows: two chunks of 4500 under the CUDA budget), W [C, 8] read through a Transpose (transB),
/// a bias, class weights, ignore_index and the mean; otherwise x [2, 35, 8] (one chunk), W [8, C],
/// no bias, the sum.
fn lm_head(rng: &mut Rng, big: bool) -> Model {
    const C: usize = 40;
    let input = if big { vec![3, 3000, 8] } else { vec![2, 35, 8] };
    let rows: usize = input[..2].iter().product();
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let h = if big {
        let w = weight(&mut g, &mut ws, "w", &[C, 8], rng);
        let b = weight(&mut g, &mut ws, "b", &[C], rng);
        let wt = op(&mut g, "w_t", "Transpose", &[w], Attrs::default().with("perm", Attr::Ints(vec![1, 0])));
        let h = op(&mut g, "head", "MatMul", &[x, wt], Attrs::default());
        op(&mut g, "head_bias", "Add", &[h, b], Attrs::default())
    } else {
        let w = weight(&mut g, &mut ws, "w", &[8, C], rng);
        op(&mut g, "head", "MatMul", &[x, w], Attrs::default())
    };
    let shape = ints(&mut g, "rows", &[-1, C as i64]);
    let scores = op(&mut g, "flat", "Reshape", &[h, shape], Attrs::default());
    let labels = g.add_const("labels", Tensor::from_i64(vec![rows], (0..rows).map(|i| (i * 7 % C) as i64).collect()));
    let mut ins = vec![Some(scores), Some(labels)];
    let mut attrs = Attrs::default().with("reduction", Attr::String(if big { "mean" } else { "sum" }.into()));
    if big {
        let cw = g.add_const("class_weights", Tensor::from_f32(vec![C], (0..C).map(|c| 0.5 + (c % 3) as f32 * 0.25).collect()));
        ins.push(Some(cw));
        attrs.set("ignore_index", Attr::Int(3));
    }
    let loss = g.add_node("ce", "SoftmaxCrossEntropyLoss", ins, attrs, 1)[0];
    g.outputs.push(loss);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

fn session(m: &Model) -> Session {
    session_for(m, crate::session::Target::Cuda)
}

fn session_for(m: &Model, target: crate::session::Target) -> Session {
    // the attention fusion is opt-in; every test here wants it (no test reads the variable
    // expecting it unset)
    std::env::set_var(crate::passes::ENV_ENABLE, "fuse_attention");
    let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &HashMap::new(), 17).expect("export");
    let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
    Session::from_onnx_for(&bytes, None, &names, &vec![true; names.len()], None, target).expect("import")
}

fn weight_data(m: &Model) -> Vec<Vec<f32>> {
    m.weights
        .iter()
        .map(|(name, _)| {
            let v = m.graph.find(name).expect("weight");
            let t = m.graph.weights.iter().find(|(w, _)| *w == v).and_then(|(_, t)| t.clone()).expect("data");
            t.to_f64_vec().into_iter().map(|x| x as f32).collect()
        })
        .collect()
}

fn bytes_of(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice covers exactly v's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// (outputs, gradients) of one step on the CPU.
fn cpu_step(s: &Session, x: &[u8], sig: &Sig, mut weights: Vec<Vec<f32>>, seeds: &mut [Vec<f32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let wptrs: Vec<*mut u8> = weights.iter_mut().map(|w| w.as_mut_ptr() as *mut u8).collect();
    // SAFETY: every pointer holds its value's planned f32 data and outlives the calls.
    let mut pending = unsafe { s.forward(&[(sig.clone(), x)], &wptrs, true, 1, &[]) }.expect("cpu forward");
    let outs: Vec<Vec<f32>> = (0..s.outputs.len())
        .map(|k| {
            let (p, _, shape) = s.output_ptr(&mut pending, k).expect("output");
            let n: usize = shape.iter().product();
            // SAFETY: the output holds n f32 values while `pending` lives.
            unsafe { std::slice::from_raw_parts(p as *const f32, n) }.to_vec()
        })
        .collect();
    let mut grads: Vec<Vec<f32>> = weights.iter().map(|w| vec![0.0; w.len()]).collect();
    let sptrs: Vec<*mut u8> = seeds.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
    let gptrs: Vec<*mut u8> = grads.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
    // SAFETY: as above, for seeds and gradients.
    unsafe { s.backward(pending, &wptrs, &sptrs, &gptrs) }.expect("cpu backward");
    (outs, grads)
}

fn download_f32(g: &crate::backend::cuda::loader::Loaded, addr: u64, n: usize) -> Vec<f32> {
    g.synchronize().expect("sync");
    let mut v = vec![0f32; n];
    // SAFETY: addr holds n f32 values of a live device buffer (the arena or a bound buffer).
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, addr) }.expect("download");
    v
}

/// (outputs, gradients) of one step on the GPU, through the CUDA executor.
fn gpu_step(s: &Session, x: &[u8], sig: &Sig, weights: &[Vec<f32>], seeds: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    gpu_step_in(s, x, sig, weights, seeds, F32Mode::Exact)
}

/// As `gpu_step`, with the session's f32 matmuls in `mode`.
fn gpu_step_in(
    s: &Session,
    x: &[u8],
    sig: &Sig,
    weights: &[Vec<f32>],
    seeds: &[Vec<f32>],
    mode: F32Mode,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let g = gpu_or_reason().expect("under gpu()");
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let plan = s.plan(std::slice::from_ref(sig), true).expect("plan");
    let kernels = cexec::resolve(&s.graph, &plan).unwrap_or_else(|e| panic!("{e}"));
    let consts = DeviceConsts::upload(rt, &plan).expect("constants");
    let mut arena = DeviceArena::default();
    let base = arena.reserve(rt, plan.arena_bytes).expect("arena");
    let dw: Vec<DeviceBuffer> = weights.iter().map(|w| dev(g, w)).collect();
    let ds: Vec<DeviceBuffer> = seeds.iter().map(|v| dev(g, v)).collect();
    let dg: Vec<DeviceBuffer> = weights.iter().map(|w| zeros::<f32>(g, w.len())).collect();
    let mut bind = DeviceBindings::new(s.graph.values.len());
    // SAFETY: each buffer holds its value's planned f32 data and lives until the end.
    unsafe {
        for (&v, b) in s.weights.iter().zip(&dw) {
            bind.bind(v, b.ptr());
        }
        for (sv, b) in s.seeds.iter().zip(&ds) {
            bind.bind(sv.expect("seeded"), b.ptr());
        }
        for (gv, b) in s.grads.iter().zip(&dg) {
            bind.bind(gv.expect("has a gradient"), b.ptr());
        }
    }
    let mut ctx = CudaCtx { rt, stream: std::ptr::null_mut(), seed: 1, f32_mode: mode, error_flag: 0 };
    let feed = [(s.inputs[0], InputSrc::Host(x))];
    cexec::run_phase(&s.graph, &plan, &kernels, Phase::Forward, base, &bind, &consts, &feed, &mut ctx).unwrap_or_else(|e| panic!("{e}"));
    let outs: Vec<Vec<f32>> = s
        .outputs
        .iter()
        .map(|&o| {
            let a = cexec::address(&s.graph, &plan, base, &bind, &consts, o).expect("output address");
            download_f32(g, a, plan.shape(o).iter().product())
        })
        .collect();
    cexec::run_phase(&s.graph, &plan, &kernels, Phase::Backward, base, &bind, &consts, &[], &mut ctx).unwrap_or_else(|e| panic!("{e}"));
    let grads = dg.iter().map(host::<f32>).collect();
    (outs, grads)
}

fn compare(name: &str, m: &Model) {
    let mut rng = Rng::new(5);
    let s = session(m);
    let x = m.input_bytes(&mut rng);
    let sig = m.sig();
    let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
    let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let weights = weight_data(m);
    let (co, cg) = cpu_step(&s, &x, &sig, weights.clone(), &mut seeds);
    let (go, gg) = gpu_step(&s, &x, &sig, &weights, &seeds);
    let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    for (k, (c, g)) in co.iter().zip(&go).enumerate() {
        assert_close(&format!("{name}: output {k}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    for ((wname, _), (c, g)) in m.weights.iter().zip(cg.iter().zip(&gg)) {
        assert_close(&format!("{name}: gradient of {wname}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    println!("{name}: {} outputs and {} gradients match ({})", co.len(), cg.len(), plan.describe(&s.graph).lines().last().unwrap_or(""));
}

fn models() -> Vec<(&'static str, Model)> {
    let mut rng = Rng::new(3);
    vec![
        ("mlp", mlp(&mut rng)),
        ("movement", movement(&mut rng)),
        ("masks", masks(&mut rng)),
        ("embedding", embedding(&mut rng)),
        ("attention_bits", attention_bits(&mut rng)),
        ("sdpa_causal", self_attention(&mut rng, true)),
        ("eager_attention_padding", self_attention(&mut rng, false)),
        ("lm_head_chunked", lm_head(&mut rng, true)),
        ("lm_head", lm_head(&mut rng, false)),
    ]
}

#[test]
fn every_test_model_has_a_cuda_kernel_for_every_step() {
    for (name, m) in models() {
        let s = session(&m);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let missing = cexec::missing_kernels(&s.graph, &plan);
        assert!(missing.is_empty(), "{name}: no CUDA kernel for {missing:?}");
    }
}

#[test]
fn gpu_train_step_matches_the_cpu_executor() {
    let Some(_) = gpu("gpu_train_step_matches_the_cpu_executor") else { return };
    for (name, m) in models() {
        compare(name, &m);
    }
}

/// At bf16 matmul precision, attention with heads of 64 and 128 runs on the tensor-core kernels
/// (kernels/attention_mma.cu; 150 rows: three 64-row tiles, the last partial, and the causal
/// mask's upper tiles skipped): outputs and weight gradients within bf16's precision of the CPU
/// executor's exact f32, for both exporter forms.
#[test]
fn gpu_tensor_core_attention_matches_the_cpu_executor() {
    let Some(_) = gpu("gpu_tensor_core_attention_matches_the_cpu_executor") else { return };
    let mut rng = Rng::new(17);
    for hd in [64, 128] {
        for torchlib in [true, false] {
            let m = self_attention_of(&mut rng, torchlib, 150, hd);
            let name = format!("heads of {hd}, torchlib={torchlib}");
            let s = session(&m);
            let x = m.input_bytes(&mut rng);
            let sig = m.sig();
            let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
            let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
            let (co, cg) = cpu_step(&s, &x, &sig, weight_data(&m), &mut seeds);
            let (go, gg) = gpu_step_in(&s, &x, &sig, &weight_data(&m), &seeds, F32Mode::Bf16);
            let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            assert_close_scaled(&format!("{name}: output"), &f(&go[0]), &f(&co[0]), 3e-2);
            for ((wname, _), (c, g)) in m.weights.iter().zip(cg.iter().zip(&gg)) {
                assert_close_scaled(&format!("{name}: gradient of {wname}"), &f(g), &f(c), 3e-2);
            }
            println!("{name}: output and {} gradients within 3e-2 of the largest value", cg.len());
        }
    }
}

/// The test models together run every op type of the CUDA kernel table that has no other
/// train-step coverage here (forward, and backward where the op has a gradient).
#[test]
fn test_models_cover_the_movement_elementwise_and_gather_dispatchers() {
    let mut seen = std::collections::BTreeSet::new();
    for (name, m) in models() {
        let s = session(&m);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        seen.extend(plan.steps.iter().map(|n| s.graph.nodes[n.0].op_type.clone()));
    }
    let want = [
        "Expand",
        "Slice",
        "SliceGrad",
        "Concat",
        "ConcatGrad",
        "Split",
        "Trilu",
        "Cast",
        "CastLike",
        "Mod",
        "MinMaxGrad",
        "ErfGrad",
        "IsNaN",
        "IsInf",
        "MaskSelect",
        "Affine",
        "Where",
        "Gather",
        "GatherGrad",
        "GatherElements",
        "GatherElementsGrad",
        "LinearCrossEntropy",
    ];
    let missing: Vec<&str> = want.iter().copied().filter(|o| !seen.contains(*o)).collect();
    assert!(missing.is_empty(), "no test model runs {missing:?}; steps seen: {seen:?}");
}

/// The exporters' attention becomes one Attention node in a CUDA session, and the fused graph's
/// train step on the CPU executor (the reference the GPU is compared with) matches the unfused
/// graph of a CPU session: outputs and every weight gradient.
#[test]
fn attention_fuses_for_cuda_and_matches_the_unfused_graph() {
    let mut rng = Rng::new(11);
    // heads of 4 (the SIMT kernels' test models) and of 64 over 150 rows (the tensor-core ones')
    for (torchlib, t, hd) in [(true, 70, 4), (false, 70, 4), (true, 150, 64), (false, 150, 64)] {
        let m = self_attention_of(&mut rng, torchlib, t, hd);
        let (fused, plain) = (session(&m), session_for(&m, crate::session::Target::Cpu));
        let count = |s: &Session| s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "Attention").count();
        assert_eq!((count(&fused), count(&plain)), (1, 0), "torchlib={torchlib}");
        let x = m.input_bytes(&mut rng);
        let plan = fused.plan(&[m.sig()], true).expect("plan");
        let mut seeds: Vec<Vec<f32>> = fused.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let (fo, fg) = cpu_step(&fused, &x, &m.sig(), weight_data(&m), &mut seeds.clone());
        let (po, pg) = cpu_step(&plain, &x, &m.sig(), weight_data(&m), &mut seeds);
        let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        // heads of 64: sums of 64-128 terms around the largest values, in a different order (the
        // online softmax): within 2e-5 of the largest value
        let close = |what: String, a: &[f64], b: &[f64]| {
            if hd == 4 {
                assert_close(&what, a, b, 1e-5, 1e-6)
            } else {
                assert_close_scaled(&what, a, b, 2e-5)
            }
        };
        close(format!("torchlib={torchlib}, heads of {hd}: output"), &f(&fo[0]), &f(&po[0]));
        for ((name, _), (a, b)) in m.weights.iter().zip(fg.iter().zip(&pg)) {
            close(format!("torchlib={torchlib}, heads of {hd}: gradient of {name}"), &f(a), &f(b));
        }
    }
}

/// CUDA sessions fuse the LM head with its loss, in chunks of thousands of rows: the 9000 rows
/// of `lm_head_chunked` take two chunks of 4500 (the scratch output), the 70 of `lm_head` one.
#[test]
fn lm_head_loss_fuses_for_cuda_in_large_chunks() {
    let mut rng = Rng::new(13);
    for (big, scratch) in [(true, vec![4500, 40]), (false, vec![70, 40])] {
        let m = lm_head(&mut rng, big);
        let s = session(&m);
        let fused: Vec<_> = s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "LinearCrossEntropy").collect();
        assert_eq!(fused.len(), 1, "big={big}: {:?}", s.graph.nodes.iter().map(|n| &n.op_type).collect::<Vec<_>>());
        assert_eq!(fused[0].attrs.string("target", "").expect("target"), "cuda");
        let plan = s.plan(&[m.sig()], true).expect("plan");
        assert_eq!(plan.shape(fused[0].outputs[4]), scratch.as_slice(), "big={big}");
    }
}

/// Without a GPU, the CPU half of the comparison still runs: every test model imports, gives
/// every weight a gradient and runs a train step on the CPU executor with finite results.
#[test]
fn every_test_model_runs_a_cpu_train_step() {
    for (name, m) in models() {
        let mut rng = Rng::new(5);
        let s = session(&m);
        assert!(s.grads.iter().all(|g| g.is_some()), "{name}: a weight has no gradient");
        let x = m.input_bytes(&mut rng);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let (outs, grads) = cpu_step(&s, &x, &m.sig(), weight_data(&m), &mut seeds);
        for (what, v) in outs.iter().map(|v| ("output", v)).chain(grads.iter().map(|g| ("gradient", g))) {
            assert!(v.iter().all(|x| x.is_finite()), "{name}: a {what} is not finite");
        }
        assert!(grads.iter().all(|g| g.iter().any(|&x| x != 0.0)), "{name}: a gradient is all zero");
    }
}
