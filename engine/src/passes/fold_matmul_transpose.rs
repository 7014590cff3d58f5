//! fold_matmul_transpose (fp32 sessions): a MatMul whose operands are scaled by constants
//! and/or transposed in their last two axes first, as the exporters decompose an unfused
//! attention's `softmax(q·kᵀ·scale)` (torchlib: `MatMul(Mul(q, √s), Mul(Transpose(k), √s))`),
//! becomes one FusedMatMul(q, k, transB = 1, alpha = s): the product reads the operands in
//! place. The tutorial's two layers lose three kernels each forward (the two scalings and
//! the transpose) and their three gradients backward. Only where each folded Mul and Transpose
//! has the product as its only reader, and both operands have rank ≥ 2 (FusedMatMul's gradient
//! restores no 1-D dims). The values differ from the unfused graph's by rounding (one scaling of
//! the product instead of one of each operand). Mixed-precision sessions keep the MatMul, whose
//! 16-bit rule autocast knows.

use super::sym_shape::{reshapes_to, shape_of, values, SymDim};
use super::{scalar_value, sole_producer};
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, ValueId};

/// An operand with the scalings and the transpose in front of it peeled off.
struct Peeled {
    value: ValueId,
    scale: f64,
    transposed: bool,
    folded: usize,
}

/// Whether `node` is a Transpose swapping the last two of its axes only.
fn swaps_last_two(node: &Node) -> Option<usize> {
    let perm = node.attrs.ints("perm").ok()??;
    let r = perm.len();
    let swapped = r >= 2 && perm[r - 2] == r as i64 - 1 && perm[r - 1] == r as i64 - 2 && (0..r - 2).all(|i| perm[i] == i as i64);
    swapped.then_some(r)
}

/// x where `v` is torchlib's batched transpose of x's last two axes: `Reshape(Transpose(
/// Reshape(x, [-1, m, n]), [0, 2, 1]), [...lead, n, m])` (the leading axes merged, the last
/// two swapped, the leading ones restored), each with one reader.
fn merged_transpose_of(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> Option<ValueId> {
    let split = sole_producer(graph, consumers, v, "Reshape")?;
    let t = sole_producer(graph, consumers, split.input(0)?, "Transpose")?;
    let merge = sole_producer(graph, consumers, t.input(0)?, "Reshape")?;
    let x = merge.input(0)?;
    let shape = shape_of(graph, x)?;
    let n = shape.len();
    if swaps_last_two(t)? != 3 || n < 2 {
        return None;
    }
    let merged = values(graph, merge.input(1)?)?;
    if merged.len() != 3 || merged[0] != SymDim::Known(-1) || merged[1..] != shape[n - 2..] {
        return None;
    }
    let mut swapped = shape.clone();
    swapped.swap(n - 2, n - 1);
    reshapes_to(&values(graph, split.input(1)?)?, &swapped).then_some(x)
}

/// Peels at most one scaling by a one-element constant and one last-two transpose, in either
/// order, each with one reader, off operand `v`; Reshapes to the shape their input has (the
/// exporters' no-op views between them) are looked through.
fn peel(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], v: ValueId) -> Peeled {
    let mut p = Peeled { value: v, scale: 1.0, transposed: false, folded: 0 };
    for _ in 0..4 {
        if let Some(x) = merged_transpose_of(graph, consumers, p.value).filter(|_| !p.transposed) {
            p = Peeled { value: x, transposed: true, folded: p.folded + 3, ..p };
            continue;
        }
        if let Some(r) = sole_producer(graph, consumers, p.value, "Reshape") {
            let same = r.input(0).and_then(|x| shape_of(graph, x)).is_some_and(|s| shape_of(graph, p.value) == Some(s));
            if let (true, Some(x)) = (same, r.input(0)) {
                p.value = x;
                continue;
            }
        }
        if let Some(t) = sole_producer(graph, consumers, p.value, "Transpose").filter(|_| !p.transposed) {
            if let (Some(_), Some(x)) = (swaps_last_two(t), t.input(0)) {
                p = Peeled { value: x, transposed: true, folded: p.folded + 1, ..p };
                continue;
            }
        }
        if let Some(m) = sole_producer(graph, consumers, p.value, "Mul").filter(|_| p.scale == 1.0) {
            let (Some(a), Some(b)) = (m.input(0), m.input(1)) else { break };
            let scaled = |c: ValueId| scalar_value(graph, c).filter(|&(s, rank)| rank <= 1 && s.is_finite() && s != 0.0).map(|(s, _)| s);
            let (x, s) = match (scaled(a), scaled(b)) {
                (_, Some(s)) => (a, s),
                (Some(s), None) => (b, s),
                (None, None) => break,
            };
            p = Peeled { value: x, scale: s, folded: p.folded + 1, ..p };
            continue;
        }
        break;
    }
    p
}

/// Rewrites the foldable MatMuls; returns how many.
pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let rank = |v: ValueId| shape_of(graph, v).map(|s| s.len());
    let mut folds: Vec<(usize, Node)> = Vec::new();
    for (n, node) in graph.nodes.iter().enumerate() {
        if node.op_type != "MatMul" || node.inputs.len() != 2 || node.outputs.len() != 1 {
            continue;
        }
        let (Some(a), Some(b)) = (node.input(0), node.input(1)) else { continue };
        let (pa, pb) = (peel(graph, &consumers, a), peel(graph, &consumers, b));
        if pa.folded + pb.folded == 0 || pa.value == pb.value {
            continue;
        }
        if !(rank(pa.value).is_some_and(|r| r >= 2) && rank(pb.value).is_some_and(|r| r >= 2)) {
            continue;
        }
        let attrs = Attrs::default()
            .with("transA", Attr::Int(pa.transposed as i64))
            .with("transB", Attr::Int(pb.transposed as i64))
            .with("alpha", Attr::Float((pa.scale * pb.scale) as f32));
        let inputs = vec![Some(pa.value), Some(pb.value)];
        folds.push((n, Node { name: node.name.clone(), op_type: "FusedMatMul".into(), inputs, outputs: node.outputs.clone(), attrs }));
    }
    let count = folds.len();
    // the peeled Mul and Transpose nodes now feed nothing: the dead-node sweep drops them
    for (n, node) in folds {
        graph.nodes[n] = node;
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Dim, ValueKind};
    use crate::tensor::{DType, Tensor};

    /// q [2, 3, 4] · (k [2, 5, 4] transposed) with torchlib's scalings; `extra`: the scaled k
    /// is also a graph output (a second reader).
    fn attention_scores(extra: bool) -> Graph {
        let mut g = Graph::default();
        let dims = |d: &[usize]| Some(d.iter().map(|&x| Dim::Known(x)).collect());
        let q = g.add_value("q", ValueKind::Input, Some(DType::F32), dims(&[2, 3, 4]));
        let k = g.add_value("k", ValueKind::Input, Some(DType::F32), dims(&[2, 5, 4]));
        g.inputs.extend([q, k]);
        let s = g.add_const("s", Tensor::scalar_f32(0.5));
        let kt = g.add_node("kt", "Transpose", vec![Some(k)], Attrs::default().with("perm", Attr::Ints(vec![0, 2, 1])), 1)[0];
        let qs = g.add_node("qs", "Mul", vec![Some(q), Some(s)], Attrs::default(), 1)[0];
        let ks = g.add_node("ks", "Mul", vec![Some(s), Some(kt)], Attrs::default(), 1)[0];
        let y = g.add_node("scores", "MatMul", vec![Some(qs), Some(ks)], Attrs::default(), 1)[0];
        g.outputs.push(y);
        if extra {
            g.outputs.push(ks);
        }
        g
    }

    #[test]
    fn scaled_transposed_operands_fold_into_the_product() {
        let mut g = attention_scores(false);
        assert_eq!(run(&mut g), 1);
        let mm = &g.nodes[3];
        assert_eq!(mm.op_type, "FusedMatMul");
        assert_eq!((mm.input(0), mm.input(1)), (g.find("q"), g.find("k")));
        assert_eq!(mm.attrs.int("transA", -1).expect("transA"), 0);
        assert_eq!(mm.attrs.int("transB", -1).expect("transB"), 1);
        assert_eq!(mm.attrs.float("alpha", 0.0).expect("alpha"), 0.25);
    }

    #[test]
    fn an_operand_read_elsewhere_keeps_its_scaling() {
        // ks has a second reader: only q's scaling folds, and k's transposed product stays read
        let mut g = attention_scores(true);
        assert_eq!(run(&mut g), 1);
        let mm = &g.nodes[3];
        assert_eq!(mm.input(0), g.find("q"));
        assert_eq!(mm.input(1), Some(g.nodes[2].outputs[0]), "the scaled kᵀ is still computed");
        assert_eq!(mm.attrs.int("transB", -1).expect("transB"), 0);
        assert_eq!(mm.attrs.float("alpha", 0.0).expect("alpha"), 0.5);
    }

    #[test]
    fn plain_products_and_other_permutations_stay() {
        let mut g = Graph::default();
        let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(vec![Dim::Known(2), Dim::Known(3), Dim::Known(3)]));
        g.inputs.push(x);
        let t = g.add_node("t", "Transpose", vec![Some(x)], Attrs::default().with("perm", Attr::Ints(vec![1, 0, 2])), 1)[0];
        let y = g.add_node("mm", "MatMul", vec![Some(x), Some(t)], Attrs::default(), 1)[0];
        let z = g.add_node("mm2", "MatMul", vec![Some(y), Some(y)], Attrs::default(), 1)[0];
        g.outputs.push(z);
        assert_eq!(run(&mut g), 0);
        assert!(g.nodes.iter().all(|n| n.op_type != "FusedMatMul"));
    }

    /// torchlib's form: q and k [B, H, T, D] declared; the scale √(1/√D) with D read from q's
    /// declared shape, on q and on kᵀ; kᵀ as Reshape(Transpose(Reshape(k, [-1, T, D])),
    /// [B, H, D, T]). All of it folds into FusedMatMul(q, k, transB, alpha = 1/√D).
    #[test]
    fn torchlibs_shape_computed_scale_and_batched_transpose_fold() {
        let mut g = Graph::default();
        let d4 = || Some(vec![Dim::Sym("b".into()), Dim::Known(2), Dim::Sym("t".into()), Dim::Known(16)]);
        let q = g.add_value("q", ValueKind::Input, Some(DType::F32), d4());
        let k = g.add_value("k", ValueKind::Input, Some(DType::F32), d4());
        g.inputs.extend([q, k]);
        let op = |g: &mut Graph, name: &str, op: &str, ins: &[ValueId], attrs: Attrs| {
            g.add_node(name, op, ins.iter().map(|&v| Some(v)).collect(), attrs, 1)[0]
        };
        // scale = Sqrt(1 / Sqrt(CastLike(Gather(Shape(q), -1), q)))
        let shape = op(&mut g, "shape", "Shape", &[q], Attrs::default());
        let last = g.add_const("last", Tensor::from_i64(vec![], vec![-1]));
        let d = op(&mut g, "d", "Gather", &[shape, last], Attrs::default());
        let df = op(&mut g, "df", "CastLike", &[d, q], Attrs::default());
        let sd = op(&mut g, "sd", "Sqrt", &[df], Attrs::default());
        let one = g.add_const("one", Tensor::scalar_f32(1.0));
        let inv = op(&mut g, "inv", "Div", &[one, sd], Attrs::default());
        let s = op(&mut g, "s", "Sqrt", &[inv], Attrs::default());
        // kᵀ: the leading axes merged, the last two swapped, the leading ones restored
        let kshape = op(&mut g, "kshape", "Shape", &[k], Attrs::default());
        let slice = |g: &mut Graph, name: &str, a: i64, b: i64| {
            let (sa, sb) = (
                g.add_const(&format!("{name}_a"), Tensor::from_i64(vec![1], vec![a])),
                g.add_const(&format!("{name}_b"), Tensor::from_i64(vec![1], vec![b])),
            );
            op(g, name, "Slice", &[kshape, sa, sb], Attrs::default())
        };
        let (lead, tdim, ddim) = (slice(&mut g, "lead", 0, 2), slice(&mut g, "tdim", 2, 3), slice(&mut g, "ddim", 3, 4));
        let minus = g.add_const("minus", Tensor::from_i64(vec![1], vec![-1]));
        let axis0 = Attrs::default().with("axis", Attr::Int(0));
        let merged = op(&mut g, "merged", "Concat", &[minus, tdim, ddim], axis0.clone());
        let back = op(&mut g, "back", "Concat", &[lead, ddim, tdim], axis0);
        let k3 = op(&mut g, "k3", "Reshape", &[k, merged], Attrs::default());
        let kt3 = op(&mut g, "kt3", "Transpose", &[k3], Attrs::default().with("perm", Attr::Ints(vec![0, 2, 1])));
        let kt = op(&mut g, "kt", "Reshape", &[kt3, back], Attrs::default());
        let qs = op(&mut g, "qs", "Mul", &[q, s], Attrs::default());
        let ks = op(&mut g, "ks", "Mul", &[kt, s], Attrs::default());
        let y = op(&mut g, "scores", "MatMul", &[qs, ks], Attrs::default());
        g.outputs.push(y);
        assert_eq!(run(&mut g), 1);
        let mm = g.nodes.iter().find(|n| n.outputs[0] == y).expect("the product");
        assert_eq!((mm.op_type.as_str(), mm.input(0), mm.input(1)), ("FusedMatMul", Some(q), Some(k)));
        assert_eq!(mm.attrs.int("transB", -1).expect("transB"), 1);
        assert!((mm.attrs.float("alpha", 0.0).expect("alpha") - 0.25).abs() < 1e-7, "alpha 1/√16");
    }
}
