//! autocast: 16-bit activations for mixed-precision sessions (`precision="bf16"` or `"fp16"`),
//! by PyTorch autocast's rules, on the forward graph before autodiff (so the gradients are
//! 16-bit where the activations are, and the weight gradients come back to f32 through the
//! casts' own gradients, as under autocast):
//!
//! - matmuls (MatMul, Gemm, Linear, Conv) take 16-bit operands (f32 weights, biases and
//!   activations are cast, each value once) and give 16-bit results;
//! - the fused attention takes and gives 16 bits, as PyTorch's scaled_dot_product_attention
//!   does under autocast (its softmax statistics and additive mask stay f32);
//! - numerically sensitive ops (softmax, normalisation, reductions, exp/log/pow, losses) get
//!   f32 inputs (16-bit ones are cast back) and give f32 results;
//! - elementwise and data-movement ops run in 16 bits when all their float operands are 16-bit
//!   (a one-element float constant counts as such: it is cast, as PyTorch treats a 0-dim
//!   tensor), else in f32 (type promotion: the 16-bit operands are cast up);
//! - anything else gets f32 inputs. Graph outputs keep their type (cast back at the end).
//!
//! Compared with the rounding of matmul operands alone (what `precision="bf16"` does without
//! this pass), activations between matmuls take half the memory and traffic, and each weight is
//! rounded once per step instead of at every product. Element types come from the declared
//! types of inputs, weights and constants; a value of unknown type is never taken for an f32
//! activation (left as it is).

use std::collections::{HashMap, HashSet};

use crate::error::Result;
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};
use crate::tensor::DType;

/// How an op treats 16-bit operands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rule {
    /// 16-bit float operands in, 16-bit out (inputs: the float operands to cast; other float
    /// operands, such as the attention mask, stay f32).
    Low(&'static [usize]),
    /// f32 in (16-bit operands cast back), f32 out.
    F32,
    /// 16-bit when every float operand among `inputs` is (or is a one-element constant), else f32.
    Follow(&'static [usize]),
}

const ALL: &[usize] = &[0, 1, 2, 3, 4, 5, 6, 7];

fn rule(op: &str) -> Rule {
    match op {
        "MatMul" | "Gemm" | "Linear" | "Conv" => Rule::Low(&[0, 1, 2]),
        // as PyTorch's scaled_dot_product_attention: Q, Kᵀ, V in 16 bits (softmax statistics in
        // f32 inside the kernels), the output in 16 bits, LSE f32; the additive mask stays f32
        // (finfo(f32).min, the usual padding value, is -inf in bf16: a fully masked row would
        // become empty, NaN, where f32 gives a finite softmax)
        "Attention" => Rule::Low(&[0, 1, 2]),
        "Add" | "Sub" | "Mul" | "Div" | "Max" | "Min" | "Concat" => Rule::Follow(ALL),
        "Neg" | "Abs" | "Relu" | "LeakyRelu" | "Gelu" | "Tanh" | "Sigmoid" | "Erf" | "Dropout" | "Transpose" | "Reshape" | "Flatten"
        | "Squeeze" | "Unsqueeze" | "Slice" | "Split" | "Expand" | "Identity" | "Gather" => Rule::Follow(&[0]),
        "Where" => Rule::Follow(&[1, 2]),
        _ => Rule::F32,
    }
}

/// Outputs that stay f32 when their op runs in 16 bits (the fused attention's log-sum-exp).
fn f32_output(op: &str, k: usize) -> bool {
    op == "Attention" && k == 1
}

/// Rewrites the forward graph; returns how many nodes now run in 16 bits.
///
/// A matmul whose 16-bit result every reader would cast back to f32 (attention scores before
/// an f32 mask and softmax) stays f32: a 16-bit result and its f32 copy would take more memory
/// and traffic than the f32 result alone. Found by rewriting again without those matmuls,
/// until none is left.
pub fn run(graph: &mut Graph, half: DType) -> Result<usize> {
    let types = forward_types(graph);
    casts_to_known_types(graph, &types);
    let scalars = scalar_consts(graph);
    let original = graph.clone();
    let mut keep_f32: HashSet<usize> = HashSet::new();
    loop {
        let mut w = Rewrite {
            graph,
            types: &types,
            scalars: &scalars,
            half,
            half_of: HashMap::new(),
            produced: HashSet::new(),
            widened: HashSet::new(),
            nodes: Vec::new(),
        };
        let old = std::mem::take(&mut w.graph.nodes);
        let mut low = 0;
        let mut low_outputs = Vec::new();
        for (i, node) in old.into_iter().enumerate() {
            let is_low = matches!(rule(&node.op_type), Rule::Low(_));
            if w.node(node, keep_f32.contains(&i)) {
                low += 1;
                if is_low {
                    low_outputs.push((i, w.nodes.last().map(|n| n.outputs.clone()).unwrap_or_default()));
                }
            }
        }
        let outputs = w.graph.outputs.clone();
        for o in outputs {
            w.wide_value(o);
        }
        // matmuls whose 16-bit results only casts back to f32 read
        let read: HashSet<ValueId> =
            w.nodes.iter().filter(|n| n.op_type != "Cast").flat_map(|n| n.inputs.iter().flatten().copied()).collect();
        let wasted: Vec<usize> = low_outputs.iter().filter(|(_, outs)| !outs.iter().any(|o| read.contains(o))).map(|(i, _)| *i).collect();
        if !wasted.is_empty() {
            *w.graph = original.clone();
            keep_f32.extend(wasted);
            continue;
        }
        if low == 0 {
            *w.graph = original;
            return Ok(0);
        }
        // producers are renumbered by the pipeline's dead-node sweep after any rewrite
        w.graph.nodes = std::mem::take(&mut w.nodes);
        return Ok(low);
    }
}

/// The element type of each value, from the declared types of inputs, weights and constants
/// (a shape-free walk: most ops give their first typed input's type; the ones that do not are
/// listed). None where a type is not known.
pub(super) fn forward_types(graph: &Graph) -> Vec<Option<DType>> {
    let mut t: Vec<Option<DType>> = graph
        .values
        .iter()
        .map(|v| match &v.kind {
            ValueKind::Const(c) => Some(c.dtype()),
            _ => v.dtype,
        })
        .collect();
    for node in &graph.nodes {
        let of = |i: usize| node.input(i).and_then(|v| t[v.0]);
        let first = node.inputs.iter().flatten().find_map(|v| t[v.0]);
        let mut got = Vec::with_capacity(node.outputs.len());
        for k in 0..node.outputs.len() {
            let d = match (node.op_type.as_str(), k) {
                ("Cast", _) => node.attrs.int("to", 0).ok().and_then(|c| DType::from_onnx(c as i32)),
                ("CastLike", _) => of(1),
                ("Shape" | "Size" | "ArgMax" | "ArgMin" | "NonZero", _) | ("TopK" | "MaxPool", 1) => Some(DType::I64),
                ("Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "Not" | "And" | "Or" | "Xor" | "IsNaN" | "IsInf", _)
                | ("Dropout", 1) => Some(DType::Bool),
                ("Where", _) => of(1).or(of(2)),
                ("ConstantOfShape", _) => match node.attrs.get("value") {
                    Some(Attr::Tensor(v)) => Some(v.dtype()),
                    _ => Some(DType::F32),
                },
                ("LayerNormalization" | "BatchNormalization" | "RmsNorm", k) if k > 0 => Some(DType::F32),
                // a Linear adding a residual (passes/fuse_residual_linear.rs) gives its type
                ("Linear", 0) if node.input(3).is_some() => of(3),
                (op, _) if matches!(rule(op), Rule::Low(_) | Rule::Follow(_)) || KEEPS_TYPE.contains(&op) => first,
                // anything else: unknown, so never taken for an f32 activation
                _ => None,
            };
            got.push(d);
        }
        for (o, d) in node.outputs.iter().zip(got) {
            if t[o.0].is_none() {
                t[o.0] = d;
            }
        }
    }
    t
}

/// CastLike(x, like) with `like` of a known type becomes Cast(x, to = that type): `like` is read
/// for its type only, and after the rewrite its f32 form would have to be made again (a cast
/// back of a whole activation) just to be read so (torchlib's attention scale
/// `CastLike(c, q)`).
fn casts_to_known_types(graph: &mut Graph, types: &[Option<DType>]) {
    for node in graph.nodes.iter_mut().filter(|n| n.op_type == "CastLike") {
        let Some(to) = node.input(1).and_then(|v| types[v.0]) else { continue };
        node.op_type = "Cast".into();
        node.inputs.truncate(1);
        node.attrs.set("to", Attr::Int(to.onnx_code() as i64));
    }
}

/// Which values are one-element constants, or elementwise arithmetic on such constants only
/// (torchlib's attention scale `Sqrt(CastLike(c, q))`, folded at plan time).
fn scalar_consts(graph: &Graph) -> Vec<bool> {
    let mut s: Vec<bool> = graph.values.iter().map(|v| matches!(&v.kind, ValueKind::Const(t) if t.numel() == 1)).collect();
    for node in &graph.nodes {
        let data: &[usize] = match node.op_type.as_str() {
            // CastLike reads its second operand's type only
            "Cast" | "CastLike" | "Sqrt" | "Neg" | "Reciprocal" | "Abs" | "Exp" | "Log" => &[0],
            "Add" | "Sub" | "Mul" | "Div" => &[0, 1],
            _ => continue,
        };
        if node.outputs.len() == 1 && data.iter().all(|&i| node.input(i).is_some_and(|x| s[x.0])) {
            s[node.outputs[0].0] = true;
        }
    }
    s
}

/// Ops (of the F32 rule) whose outputs have their first typed input's type.
const KEEPS_TYPE: &[&str] = &[
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "RmsNorm",
    "Exp",
    "Log",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "CumSum",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "LinearCrossEntropy",
    "Sign",
    "Floor",
    "Ceil",
    "Range",
    "GatherElements",
    "GatherND",
    "Trilu",
    "Sin",
    "Cos",
    "BatchNormalization",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "HardSigmoid",
    "HardSwish",
    "Softplus",
    "Mod",
];

struct Rewrite<'g, 't> {
    graph: &'g mut Graph,
    /// Each original value's element type (before this pass).
    types: &'t [Option<DType>],
    /// Original values that are one-element constants (`scalar_consts`).
    scalars: &'t [bool],
    half: DType,
    /// Original f32 value -> its 16-bit form (a node's 16-bit output, or a cast).
    half_of: HashMap<ValueId, ValueId>,
    /// Original values whose producer now writes the 16-bit form (16-bit values in PyTorch's
    /// sense: a weight cast for a matmul is not one).
    produced: HashSet<ValueId>,
    /// Of those, the ones whose f32 form has been made again (a cast back, emitted once).
    widened: HashSet<ValueId>,
    nodes: Vec<Node>,
}

impl Rewrite<'_, '_> {
    fn is_f32(&self, v: ValueId) -> bool {
        self.types.get(v.0).copied().flatten() == Some(DType::F32)
    }

    fn is_half_now(&self, v: ValueId) -> bool {
        self.produced.contains(&v)
    }

    fn scalar_const(&self, v: ValueId) -> bool {
        self.scalars.get(v.0).copied().unwrap_or(false)
    }

    fn cast(&mut self, x: ValueId, to: DType, name: &str, out: Option<ValueId>) -> ValueId {
        let out = out.unwrap_or_else(|| self.graph.add_value(name, ValueKind::Computed, Some(to), None));
        self.nodes.push(Node {
            name: format!("{name}:cast"),
            op_type: "Cast".into(),
            inputs: vec![Some(x)],
            outputs: vec![out],
            attrs: Attrs::default().with("to", Attr::Int(to.onnx_code() as i64)),
        });
        out
    }

    /// The 16-bit form of the f32 value `v` (cast once, then shared).
    fn half_value(&mut self, v: ValueId) -> ValueId {
        if let Some(&h) = self.half_of.get(&v) {
            return h;
        }
        let name = format!("{}:{}", self.graph.value(v).name, self.half.name());
        let h = self.cast(v, self.half, &name, None);
        self.half_of.insert(v, h);
        h
    }

    /// Makes the f32 value `v` exist (a cast back from its 16-bit form where its producer now
    /// writes 16 bits).
    fn wide_value(&mut self, v: ValueId) {
        if self.produced.contains(&v) && self.widened.insert(v) {
            let h = self.half_of[&v];
            let name = self.graph.value(v).name.clone();
            self.cast(h, DType::F32, &name, Some(v));
        }
    }

    /// Emits `node` rewritten; true when it runs in 16 bits (`keep_f32`: it may not).
    fn node(&mut self, mut node: Node, keep_f32: bool) -> bool {
        let floats: Vec<usize> = (0..node.inputs.len()).filter(|&i| node.input(i).is_some_and(|v| self.is_f32(v))).collect();
        let in_half = |w: &Self, i: usize| node.input(i).is_some_and(|v| w.is_half_now(v));
        // an operand of unknown type could not be cast with the others: the op would mix types
        let untyped =
            |w: &Self, which: &[usize]| which.iter().any(|&i| node.input(i).is_some_and(|v| w.types.get(v.0).copied().flatten().is_none()));
        let go_half = !keep_f32
            && match rule(&node.op_type) {
                Rule::Low(which) | Rule::Follow(which) if untyped(self, which) => false,
                Rule::Low(which) => floats.iter().any(|i| which.contains(i)),
                Rule::F32 => false,
                Rule::Follow(which) => {
                    let data: Vec<usize> = floats.iter().copied().filter(|i| which.contains(i)).collect();
                    data.iter().any(|&i| in_half(self, i))
                        && data.iter().all(|&i| in_half(self, i) || node.input(i).is_some_and(|v| self.scalar_const(v)))
                }
            };
        if !go_half {
            for i in 0..node.inputs.len() {
                let Some(v) = node.input(i) else { continue };
                // Shape and Size read no element type: a 16-bit input is read as it is, with no
                // f32 copy made for them
                if matches!(node.op_type.as_str(), "Shape" | "Size") && i == 0 && self.is_half_now(v) {
                    node.inputs[i] = Some(self.half_of[&v]);
                } else {
                    self.wide_value(v);
                }
            }
            self.nodes.push(node);
            return false;
        }
        let which = match rule(&node.op_type) {
            Rule::Low(w) | Rule::Follow(w) => w,
            Rule::F32 => &[],
        };
        for i in floats.iter().copied().filter(|i| which.contains(i)) {
            let v = node.inputs[i].expect("float input");
            node.inputs[i] = Some(self.half_value(v));
        }
        // other inputs (a Dropout ratio, indices, a condition) keep their type
        for i in 0..node.inputs.len() {
            if let Some(v) = node.input(i) {
                if !(floats.contains(&i) && which.contains(&i)) {
                    self.wide_value(v);
                }
            }
        }
        for k in 0..node.outputs.len() {
            let o = node.outputs[k];
            if self.is_f32(o) && !f32_output(&node.op_type, k) {
                let name = format!("{}:{}", self.graph.value(o).name, self.half.name());
                let h = self.graph.add_value(&name, ValueKind::Computed, Some(self.half), None);
                node.outputs[k] = h;
                self.half_of.insert(o, h);
                self.produced.insert(o);
            }
        }
        self.nodes.push(node);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;

    fn f32_value(g: &mut Graph, name: &str, kind: ValueKind) -> ValueId {
        g.add_value(name, kind, Some(DType::F32), Some(vec![Dim::Known(4), Dim::Known(4)]))
    }

    #[test]
    fn a_shape_read_of_a_16_bit_activation_casts_nothing_back() {
        let mut g = Graph::default();
        let x = f32_value(&mut g, "x", ValueKind::Input);
        let w = f32_value(&mut g, "w", ValueKind::Weight);
        let y = g.add_node("mm", "MatMul", vec![Some(x), Some(w)], Attrs::default(), 1)[0];
        let z = g.add_node("mm2", "MatMul", vec![Some(y), Some(w)], Attrs::default(), 1)[0];
        let s = g.add_node("shape", "Shape", vec![Some(y)], Attrs::default(), 1)[0];
        let r = g.add_node("reshape", "Reshape", vec![Some(z), Some(s)], Attrs::default(), 1)[0];
        g.outputs = vec![r];
        assert!(run(&mut g, DType::BF16).unwrap() >= 2);
        let node = |name: &str| g.nodes.iter().find(|n| n.name == name).expect(name).clone();
        let read = node("shape").inputs[0].expect("Shape's input");
        assert_eq!(g.value(read).dtype, Some(DType::BF16), "Shape reads the 16-bit activation as it is");
        let widened = g.nodes.iter().filter(|n| n.op_type == "Cast" && n.attrs.int("to", 0).ok() == Some(1)).count();
        assert_eq!(widened, 1, "only the graph output is cast back to f32: {:?}", g.nodes);
    }

    /// A 16-bit matmul has 16-bit operands only: after an op whose output type the pass knows
    /// (BatchNormalization) the activation is cast with the weight; after one it does not know,
    /// the matmul stays f32 with nothing cast. (An f32 activation beside a bf16 weight was read
    /// as garbage by the CUDA gemm.)
    #[test]
    fn a_matmul_never_mixes_element_types() {
        for (op, low) in [("BatchNormalization", true), ("MaxPool", true), ("NotAKnownOp", false)] {
            let mut g = Graph::default();
            let x = f32_value(&mut g, "x", ValueKind::Input);
            let w = f32_value(&mut g, "w", ValueKind::Weight);
            let h = g.add_node("pre", op, vec![Some(x)], Attrs::default(), 1)[0];
            let y = g.add_node("mm", "MatMul", vec![Some(h), Some(w)], Attrs::default(), 1)[0];
            // read by a 16-bit op, so that a 16-bit product is worth making
            let r = g.add_node("relu", "Relu", vec![Some(y)], Attrs::default(), 1)[0];
            g.outputs = vec![r];
            run(&mut g, DType::BF16).unwrap();
            let mm = g.nodes.iter().find(|n| n.name == "mm").expect("mm");
            let types: Vec<Option<DType>> = mm.inputs.iter().map(|v| g.value(v.expect("operand")).dtype).collect();
            if low {
                assert_eq!(types, vec![Some(DType::BF16); 2], "after {op}: {:?}", g.nodes);
            } else {
                assert!(!types.contains(&Some(DType::BF16)), "after {op}: the matmul mixes {types:?}");
            }
        }
    }
}
