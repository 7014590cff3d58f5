//! Graph passes run on the forward graph after import and before autodiff, so that gradients
//! are built from the fused ops' own rules. One file per rule; the pipeline is the list below.
//! `ORTRAIN_DISABLE_PASSES` (a comma list of pass names, or `all`) turns passes off, for
//! fused-vs-unfused comparisons and for bisecting a suspected miscompile;
//! `ORTRAIN_ENABLE_PASSES` turns on the opt-in ones. A pass whose fused op has kernels on some
//! backends only runs for sessions built for those (`Target`).

mod attention_grouped_kv;
mod attention_key_padding;
mod attention_keys;
mod attention_layout;
mod attention_packed_qkv;
mod autocast;
mod cse;
mod fold_matmul_transpose;
mod fuse_attention;
mod fuse_dropout_add;
mod fuse_gelu_tanh;
mod fuse_linear;
mod fuse_linear_cross_entropy;
mod fuse_linear_gelu;
mod fuse_residual_linear;
mod fuse_rms_norm;
mod layer_norm_grad_col_sum;
mod layer_norm_grad_sum;
mod layer_norm_half;
mod layer_norm_stats;
mod lce_weight_grad;
mod matmul_gelu_grad;
mod recompute;
mod recompute_segments;
mod selects_to_split;
mod slice_before_linear;
mod sym_shape;
mod wgrad_f32;

use crate::error::{Error, Result};
use crate::ir::{Graph, Node, NodeId, ValueId, ValueKind};
use crate::tensor::DType;

type Pass = fn(&mut Graph, &PassCtx) -> Result<usize>;

/// Ops whose output is their input's data in another shape (the plan aliases them): passes look
/// through them from a value to its readers, or back to its producer.
const VIEWS: &[&str] = &["Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"];

/// What a pass may know of the session it runs for.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassCtx {
    pub target: Target,
    /// The 16-bit float type of a mixed-precision session (bf16 or fp16), None for fp32.
    pub half: Option<DType>,
}

/// The backend a session's plans will run on: passes whose fused ops lack kernels there are
/// skipped (a missing kernel would be a plan-time error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Target {
    #[default]
    Cpu,
    Cuda,
}

/// Which sessions a pass runs for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runs {
    Both,
    CpuOnly,
    CudaOnly,
    /// Every CPU session; CUDA sessions only when named in `ORTRAIN_ENABLE_PASSES` (a fusion
    /// that is correct there but not yet faster everywhere).
    CpuAndCudaOptIn,
    /// Every session, only when named in `ORTRAIN_ENABLE_PASSES`.
    OptIn,
}

/// The pipeline, in order: (name, pass, sessions it runs for). A pass returns how many
/// rewrites it made.
const PIPELINE: &[(&str, Pass, Runs)] = &[
    ("cse", |g, _| cse::run(g), Runs::Both),
    // a tensor taken apart whole by constant-index Gathers (nn.MultiheadAttention's packed
    // q, k, v): one Split, whose gradient is one Concat instead of n scatters and their sum
    ("selects_to_split", |g, _| Ok(selects_to_split::run(g)), Runs::Both),
    // CPU sessions (backend/cpu/attention_f32/: blocked gemms, masked keys skipped, the
    // probabilities' dropout too, as in the CUDA kernels); CUDA
    // sessions opt-in: on an H100 the GPU kernels (SIMT f32) cut GPT-2 124M's peak memory by
    // 38% but made its step slower than the unfused graph (doc/GPU-RUNS.md, 2026-11-24)
    ("fuse_attention", |g, c| fuse_attention::run(g, c.target), Runs::CpuAndCudaOptIn),
    // after it: an attention_mask input's padding reaches the fused attention as one flag per
    // key, the rest of its mask a constant (a no-op without fused attentions)
    ("attention_key_padding", |g, _| Ok(attention_key_padding::run(g)), Runs::Both),
    // after it: the fused attention reads Q, K, V and writes O with the heads inside the rows,
    // where the graph transposed them out and back
    ("attention_layout", |g, _| Ok(attention_layout::run(g)), Runs::Both),
    // after it: an attention it left in BHSD (Llama's: rotary Q, repeated K) reads K itself
    // where the graph transposed it for the product
    ("attention_keys", |g, _| Ok(attention_keys::run(g)), Runs::Both),
    // after it: a grouped-query attention reads its keys and values before their repeat
    ("attention_grouped_kv", |g, _| Ok(attention_grouped_kv::run(g)), Runs::Both),
    // after it, before autocast renames the values whose shapes the exporter declared: a
    // self-attention over the three parts of one split projection reads the projection itself
    ("attention_packed_qkv", |g, _| Ok(attention_packed_qkv::run(g)), Runs::CudaOnly),
    ("fuse_gelu_tanh", |g, _| fuse_gelu_tanh::run(g), Runs::Both),
    // Llama's RMS normalisation written out
    ("fuse_rms_norm", |g, _| fuse_rms_norm::run(g), Runs::Both),
    ("fuse_linear", |g, _| fuse_linear::run(g), Runs::Both),
    // after fuse_linear, before the loss fusion: a shifted LM loss's slice moves onto the
    // LM head's input, so that the Linear feeds the loss's reshape directly
    ("slice_before_linear", |g, _| slice_before_linear::run(g), Runs::Both),
    // after fuse_linear: it matches the Linear that pass made; one name, chunks sized per backend
    ("fuse_linear_cross_entropy", |g, c| fuse_linear_cross_entropy::run_cpu(g, c.half.is_some()), Runs::CpuOnly),
    ("fuse_linear_cross_entropy", |g, _| fuse_linear_cross_entropy::run_cuda(g), Runs::CudaOnly),
    // after the linear and attention fusions (which match the MatMuls it would take), fp32
    // sessions only (autocast has no 16-bit rule for FusedMatMul): an unfused attention's
    // scalings and kᵀ read by the product itself
    ("fold_matmul_transpose", |g, c| Ok(if c.half.is_some() { 0 } else { fold_matmul_transpose::run(g) }), Runs::Both),
    // last, on the fused graph; opt-in until it has run on a GPU: 16-bit activations in
    // mixed-precision sessions (a no-op in fp32 ones). On the CPU, 16-bit values run widened
    // to f32 (backend/cpu/widen.rs): a reference, not a fast path.
    ("autocast", |g, c| c.half.map_or(Ok(0), |h| autocast::run(g, h)), Runs::OptIn),
    // after autocast (which leaves a 16-bit residual branch's Dropout and its widened copy apart):
    // a dropout whose only reader adds it to a residual of its shape and type, one DropoutAdd
    ("fuse_dropout_add", |g, _| Ok(fuse_dropout_add::run(g)), Runs::Both),
    // after autocast (a no-op without its casts): LayerNorm writes the 16-bit copy its matmul
    // reads, and its gradient reads the 16-bit dy
    ("layer_norm_half", |g, _| Ok(layer_norm_half::run(g)), Runs::CudaOnly),
    // after autocast (a no-op without its casts): a 16-bit projection added to the f32
    // residual stream writes the f32 sum itself (cuBLASLt's epilogue adds the residual)
    ("fuse_residual_linear", |g, _| Ok(fuse_residual_linear::run(g)), Runs::CudaOnly),
    // after autocast (it fuses the 16-bit product and GELU autocast leaves): a tanh GELU of a
    // product written by cuBLASLt's GELU_AUX_BIAS epilogue with the product kept as output 1
    ("fuse_linear_gelu", |g, _| Ok(fuse_linear_gelu::run(g)), Runs::CudaOnly),
    // last: LayerNorm's statistics kept for its gradient (the GPU's recomputation reads x again)
    ("layer_norm_stats", |g, _| Ok(layer_norm_stats::run(g)), Runs::CudaOnly),
];

/// Passes over the train graph, after autodiff (forward nodes first, `n_fwd` of them).
type TrainPass = fn(&mut Graph, usize) -> usize;
const TRAIN_PIPELINE: &[(&str, TrainPass, Runs)] = &[
    // both backends: a frozen LM head's fused loss skips its weight gradient
    ("lce_weight_grad", lce_weight_grad::run, Runs::Both),
    // both backends: the parts the user checkpointed (torch.utils.checkpoint)
    // recomputed in the backward pass, as PyTorch would; a no-op for models without any
    ("recompute_segments", recompute_segments::run, Runs::Both),
    // CUDA only: on the CPU, memory is not where the targets are short, and the recomputation
    // would cost step time
    ("recompute", recompute::run, Runs::CudaOnly),
    // CUDA only: the residual stream's gradient summed, and rounded to 16 bits, in
    // LayerNormGrad's dx kernel instead of an Add and a cast after it
    ("layer_norm_grad_sum", layer_norm_grad_sum::run, Runs::CudaOnly),
    // CUDA only, after layer_norm_grad_sum (whose dx is the residual stream's gradient): a
    // following Linear's bias gradient, SumRows of that dx, summed by LayerNormGrad's dx kernel
    ("layer_norm_grad_col_sum", layer_norm_grad_col_sum::run, Runs::CudaOnly),
    // CUDA only: a tanh GELU's gradient applied by cuBLASLt's epilogue as the product that
    // feeds it is written (the CPU has no such epilogue to gain from)
    ("matmul_gelu_grad", matmul_gelu_grad::run, Runs::CudaOnly),
    // CUDA only, after matmul_gelu_grad (which takes plain products): a 16-bit copy's weight
    // gradient written in f32 by its product instead of widened after it
    ("wgrad_f32", wgrad_f32::run, Runs::CudaOnly),
];

pub const ENV_DISABLE: &str = "ORTRAIN_DISABLE_PASSES";
pub const ENV_ENABLE: &str = "ORTRAIN_ENABLE_PASSES";

/// Rewrites made by each pass that ran.
#[derive(Clone, Debug, Default)]
pub struct PassReport {
    pub rewrites: Vec<(&'static str, usize)>,
}

/// Pass names listed in the environment variable `var` (a comma list, or `all`).
fn listed(var: &str) -> Result<Vec<String>> {
    let Ok(v) = std::env::var(var) else { return Ok(vec![]) };
    let names: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    let all = || PIPELINE.iter().map(|(p, _, _)| *p).chain(TRAIN_PIPELINE.iter().map(|(p, _, _)| *p));
    if names.iter().any(|n| n == "all") {
        return Ok(all().map(str::to_string).collect());
    }
    for n in &names {
        if !all().any(|p| p == n) {
            let mut valid: Vec<&str> = all().collect();
            valid.dedup();
            return Err(Error::other(format!("{var}: unknown pass '{n}' (valid: all, {})", valid.join(", "))));
        }
    }
    Ok(names)
}

/// Runs the pipeline over `graph` (forward nodes only: call before autodiff) for plans on
/// `ctx.target`.
pub fn run(graph: &mut Graph, ctx: PassCtx) -> Result<PassReport> {
    let target = ctx.target;
    let (off, on) = (listed(ENV_DISABLE)?, listed(ENV_ENABLE)?);
    let mut report = PassReport::default();
    for (name, pass, runs) in PIPELINE {
        if !wanted(name, *runs, target, &off, &on) {
            continue;
        }
        let n = pass(graph, &ctx)?;
        report.rewrites.push((name, n));
        if n > 0 {
            remove_dead_nodes(graph);
        }
    }
    Ok(report)
}

/// Whether the pass `name` runs for a session on `target` (`off`/`on`: the names listed in
/// ORTRAIN_DISABLE_PASSES / ORTRAIN_ENABLE_PASSES).
fn wanted(name: &str, runs: Runs, target: Target, off: &[String], on: &[String]) -> bool {
    let skip = match (target, runs) {
        (Target::Cpu, Runs::CudaOnly) | (Target::Cuda, Runs::CpuOnly) => true,
        (Target::Cuda, Runs::CpuAndCudaOptIn) | (_, Runs::OptIn) => !on.iter().any(|n| n == name),
        _ => false,
    };
    !skip && !off.iter().any(|n| n == name)
}

/// Runs the train-graph passes over `graph` (after autodiff; its first `n_fwd` nodes are the
/// forward pass), adding their counts to `report`.
pub fn run_on_train_graph(graph: &mut Graph, n_fwd: usize, target: Target, report: &mut PassReport) -> Result<()> {
    let (off, on) = (listed(ENV_DISABLE)?, listed(ENV_ENABLE)?);
    for (name, pass, runs) in TRAIN_PIPELINE {
        if wanted(name, *runs, target, &off, &on) {
            report.rewrites.push((name, pass(graph, n_fwd)));
        }
    }
    Ok(())
}

/// Inserts each `(at, nodes)` of `inserts` just before the node now at index `at` (several at
/// one index in the order given), then renumbers producers: the recomputing passes' copies.
fn insert_before(graph: &mut Graph, mut inserts: Vec<(usize, Vec<Node>)>) {
    if inserts.is_empty() {
        return;
    }
    inserts.sort_by_key(|(at, _)| *at);
    let old = std::mem::take(&mut graph.nodes);
    let mut pending = inserts.into_iter().peekable();
    for (i, node) in old.into_iter().enumerate() {
        while let Some((_, nodes)) = pending.next_if(|(at, _)| *at == i) {
            graph.nodes.extend(nodes);
        }
        graph.nodes.push(node);
    }
    graph.renumber_producers();
}

/// Drops the nodes whose flag in `gone` is set (a fusion's replaced nodes), then renumbers
/// producers.
fn drop_nodes(graph: &mut Graph, gone: &[bool]) {
    let nodes = std::mem::take(&mut graph.nodes);
    graph.nodes = nodes.into_iter().zip(gone).filter_map(|(n, &g)| (!g).then_some(n)).collect();
    graph.renumber_producers();
}

/// Drops nodes none of whose outputs is consumed or a graph output, then renumbers producers.
fn remove_dead_nodes(graph: &mut Graph) {
    let mut live = vec![false; graph.values.len()];
    for o in &graph.outputs {
        live[o.0] = true;
    }
    let mut keep = vec![false; graph.nodes.len()];
    for (i, node) in graph.nodes.iter().enumerate().rev() {
        if node.outputs.iter().any(|o| live[o.0]) {
            keep[i] = true;
            for v in node.inputs.iter().flatten() {
                live[v.0] = true;
            }
        }
    }
    let nodes = std::mem::take(&mut graph.nodes);
    graph.nodes = nodes.into_iter().zip(keep).filter_map(|(node, k)| k.then_some(node)).collect();
    graph.renumber_producers();
}

/// The node producing `v` if it is of type `op`, `v` has exactly one reader and is no graph
/// output (an intermediate a fusion may swallow).
pub(super) fn sole_producer<'g>(graph: &'g Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId, op: &str) -> Option<&'g Node> {
    let p = graph.value(v).producer?;
    let node = &graph.nodes[p.0];
    (node.op_type == op && consumers[v.0].len() == 1 && !graph.outputs.contains(&v)).then_some(node)
}

/// Whether `v` is computed from a value `leaf` accepts (by its kind), following the inputs of
/// every producer `through` accepts.
pub(super) fn computed_from(graph: &Graph, v: ValueId, leaf: impl Fn(&ValueKind) -> bool, through: impl Fn(&Node) -> bool) -> bool {
    let mut seen = vec![false; graph.values.len()];
    let mut stack = vec![v];
    while let Some(x) = stack.pop() {
        if std::mem::replace(&mut seen[x.0], true) {
            continue;
        }
        let value = graph.value(x);
        if leaf(&value.kind) {
            return true;
        }
        if let Some(node) = value.producer.map(|p| &graph.nodes[p.0]).filter(|n| through(n)) {
            stack.extend(node.inputs.iter().flatten());
        }
    }
    false
}

/// The value of a one-element constant.
pub(super) fn scalar_const(graph: &Graph, v: ValueId) -> Option<f64> {
    let ValueKind::Const(t) = &graph.value(v).kind else { return None };
    let vals = t.to_f64_vec();
    (vals.len() == 1).then(|| vals[0])
}

/// The value and rank of a one-element float expression known at import: a one-element
/// constant, or Cast (to a float type), CastLike, Sqrt, Neg, Reciprocal, Mul, Div, Add or Sub of
/// such expressions only (torchlib writes its attention scale as `Sqrt(CastLike(c, q))`; plans
/// fold it, passes see the nodes). Evaluated in f64. CastLike's target often has no declared
/// type: it is taken for a float unless declared otherwise, so callers use this only for values
/// that scale float data (an integer target would truncate).
pub(super) fn scalar_value(graph: &Graph, v: ValueId) -> Option<(f64, usize)> {
    fn eval(graph: &Graph, v: ValueId, depth: usize) -> Option<(f64, usize)> {
        if let ValueKind::Const(t) = &graph.value(v).kind {
            return scalar_const(graph, v).map(|c| (c, t.shape.len()));
        }
        let node = &graph.nodes[graph.value(v).producer?.0];
        if depth == 0 || node.outputs.len() != 1 {
            return None;
        }
        let arg = |i: usize| node.input(i).and_then(|x| eval(graph, x, depth - 1));
        let unary = |f: fn(f64) -> f64| arg(0).map(|(x, r)| (f(x), r));
        let binary = |f: fn(f64, f64) -> f64| Some((arg(0)?, arg(1)?)).map(|((a, ra), (b, rb))| (f(a, b), ra.max(rb)));
        match node.op_type.as_str() {
            "Cast" => {
                let to = node.attrs.int("to", 0).ok().and_then(|c| DType::from_onnx(c as i32));
                to.is_some_and(|d| d.is_float()).then(|| arg(0)).flatten()
            }
            "CastLike" if node.input(1).and_then(|l| graph.value(l).dtype).is_none_or(|d| d.is_float()) => arg(0),
            "Sqrt" => unary(f64::sqrt),
            "Neg" => unary(|x| -x),
            "Reciprocal" => unary(|x| 1.0 / x),
            "Mul" => binary(|a, b| a * b),
            "Div" => binary(|a, b| a / b),
            "Add" => binary(|a, b| a + b),
            "Sub" => binary(|a, b| a - b),
            // an integer read from declared shapes (torchlib's attention scale divides by the
            // head size, `Gather(Shape(q), -1)`)
            _ => match sym_shape::values(graph, v)?.as_slice() {
                [sym_shape::SymDim::Known(n)] => Some((*n as f64, 0)),
                _ => None,
            },
        }
    }
    eval(graph, v, 8)
}
