//! Shapes known at import, symbolically, for passes that must prove what a Reshape does before
//! plan time: a dim is a number or the exporter's symbol for it ("s39"). Declared shapes come
//! from the file's value_info (torch.export writes them for every intermediate); shape tensors
//! are evaluated through the ops exporters build them with (Shape, Slice, Concat, Gather,
//! Squeeze, Unsqueeze, Reshape, Cast, Identity over constants). Anything else is unknown.

use crate::ir::{Dim, Graph, ValueId, ValueKind};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymDim {
    Known(i64),
    Named(String),
}

/// The declared shape of `v`.
pub fn declared(graph: &Graph, v: ValueId) -> Option<Vec<SymDim>> {
    let dims = graph.value(v).shape.as_ref()?;
    Some(
        dims.iter()
            .map(|d| match d {
                Dim::Known(n) => SymDim::Known(*n as i64),
                Dim::Sym(s) => SymDim::Named(s.clone()),
            })
            .collect(),
    )
}

/// A one-element integer constant.
fn const_int(graph: &Graph, v: ValueId) -> Option<i64> {
    let ValueKind::Const(t) = &graph.value(v).kind else { return None };
    match t.to_i64_vec()?.as_slice() {
        [x] => Some(*x),
        _ => None,
    }
}

/// `[start, end)` of a Python-style slice over `len` elements (negative indices from the end).
fn clamp_range(start: i64, end: i64, len: usize) -> (usize, usize) {
    let len = len as i64;
    let at = |i: i64| (if i < 0 { i + len } else { i }).clamp(0, len) as usize;
    let (s, e) = (at(start), at(end));
    (s, e.max(s))
}

/// The elements of an integer shape tensor (rank 0 or 1), symbolically.
pub fn values(graph: &Graph, v: ValueId) -> Option<Vec<SymDim>> {
    fn eval(graph: &Graph, v: ValueId, depth: usize) -> Option<Vec<SymDim>> {
        if let ValueKind::Const(t) = &graph.value(v).kind {
            return (t.shape.len() <= 1).then(|| t.to_i64_vec()).flatten().map(|x| x.into_iter().map(SymDim::Known).collect());
        }
        let node = &graph.nodes[graph.value(v).producer?.0];
        if depth == 0 || node.outputs.len() != 1 {
            return None;
        }
        let arg = |i: usize| node.input(i).and_then(|x| eval(graph, x, depth - 1));
        match node.op_type.as_str() {
            "Shape" => {
                let dims = declared(graph, node.input(0)?)?;
                let start = node.attrs.int("start", 0).ok()?;
                let end = node.attrs.int("end", i64::MAX).ok()?;
                let (s, e) = clamp_range(start, end, dims.len());
                Some(dims[s..e].to_vec())
            }
            "Slice" => {
                let data = arg(0)?;
                let (start, end) = (const_int(graph, node.input(1)?)?, const_int(graph, node.input(2)?)?);
                let axis_ok = node.input(3).is_none_or(|a| matches!(const_int(graph, a), Some(0 | -1)));
                let step_ok = node.input(4).is_none_or(|s| const_int(graph, s) == Some(1));
                if !axis_ok || !step_ok {
                    return None;
                }
                let (s, e) = clamp_range(start, end, data.len());
                Some(data[s..e].to_vec())
            }
            "Concat" if node.attrs.int("axis", 0).ok()? == 0 => {
                let mut all = Vec::new();
                for i in 0..node.inputs.len() {
                    all.extend(arg(i)?);
                }
                Some(all)
            }
            "Gather" if node.attrs.int("axis", 0).ok()? == 0 => {
                let data = arg(0)?;
                let (s, _) = clamp_range(const_int(graph, node.input(1)?)?, i64::MAX, data.len());
                data.get(s).map(|d| vec![d.clone()])
            }
            // a one-element tensor as a scalar or as [1]
            "Squeeze" | "Unsqueeze" | "Reshape" => arg(0).filter(|x| x.len() == 1),
            "Cast" | "Identity" => arg(0),
            _ => None,
        }
    }
    eval(graph, v, 12)
}

/// The numpy broadcast of two symbolic shapes, where it is certain (equal dims, or a known 1).
fn broadcast(a: &[SymDim], b: &[SymDim]) -> Option<Vec<SymDim>> {
    let rank = a.len().max(b.len());
    let one = SymDim::Known(1);
    let dim = |s: &[SymDim], i: usize| if i + s.len() >= rank { s[i + s.len() - rank].clone() } else { one.clone() };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y => Some(x),
            (x, y) if x == one => Some(y),
            (x, y) if y == one => Some(x),
            _ => None,
        })
        .collect()
}

/// The symbolic shape of `v`: declared, or that of a Reshape's target (without -1 or 0), of
/// a Transpose, a Cast or an Identity of a value whose shape is known, of the broadcast of an
/// Add, Sub, Mul or Div of two such values or a Where of three, or of a Linear's residual; up to
/// 16 producers back.
pub fn shape_of(graph: &Graph, v: ValueId) -> Option<Vec<SymDim>> {
    shape_within(graph, v, 16)
}

/// `shape_of`, looking at most `depth` producers back.
fn shape_within(graph: &Graph, v: ValueId, depth: usize) -> Option<Vec<SymDim>> {
    if let Some(s) = declared(graph, v) {
        return Some(s);
    }
    let node = &graph.nodes[graph.value(v).producer?.0];
    let up = |i: usize| depth.checked_sub(1).and_then(|d| shape_within(graph, node.input(i)?, d));
    let first_output = node.outputs.first() == Some(&v);
    match node.op_type.as_str() {
        "Cast" | "Identity" => up(0),
        // shaped like their input (output 0: LayerNormalization's statistics are not)
        "Dropout" | "LayerNormalization" | "Relu" | "Gelu" | "Tanh" | "Sigmoid" | "Neg" | "Softmax" if first_output => up(0),
        // a Linear adding a residual (passes/fuse_residual_linear.rs) has the residual's shape
        "Linear" if node.input(3).is_some() => up(3),
        "Add" | "Sub" | "Mul" | "Div" if node.inputs.len() == 2 => broadcast(&up(0)?, &up(1)?),
        "Where" if node.inputs.len() == 3 => broadcast(&broadcast(&up(0)?, &up(1)?)?, &up(2)?),
        "Reshape" => values(graph, node.input(1)?).filter(|t| !t.iter().any(|d| matches!(d, SymDim::Known(-1 | 0)))),
        "Transpose" => {
            let x = up(0)?;
            let perm = node.attrs.ints("perm").ok()??;
            (perm.len() == x.len()).then(|| perm.iter().map(|&a| x.get(a as usize).cloned()).collect()).flatten()
        }
        _ => None,
    }
}

/// The N (output columns) of a product `mm` whose input 1 is a 2-D B ([N, K] with `transB`,
/// else [K, N]: Gemm, FusedMatMul, Linear), symbolically.
pub fn matmul_n(graph: &Graph, mm: &crate::ir::Node) -> Option<SymDim> {
    let b = shape_of(graph, mm.input(1)?)?;
    let [b0, b1] = b.as_slice() else { return None };
    Some(if mm.attrs.int("transB", 0).ok()? != 0 { b0.clone() } else { b1.clone() })
}

/// A declared shape for tests: each dim a number or a symbol ("b").
#[cfg(test)]
pub fn test_dims(dims: &[&str]) -> Option<Vec<Dim>> {
    Some(dims.iter().map(|d| d.parse().map(Dim::Known).unwrap_or_else(|_| Dim::Sym(d.to_string()))).collect())
}

/// Whether a Reshape to `target` of a tensor of shape `from` gives `want`: `target` equals
/// `want` where each is known, with at most one -1 (then the sizes left decide it).
pub fn reshapes_to(target: &[SymDim], want: &[SymDim]) -> bool {
    let minus_one = SymDim::Known(-1);
    target.len() == want.len()
        && target.iter().filter(|d| **d == minus_one).count() <= 1
        && target.iter().zip(want).all(|(t, w)| t == w || *t == minus_one)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attrs;
    use crate::tensor::{DType, Tensor};

    #[test]
    fn torchlib_shape_expressions_evaluate_to_the_declared_dims() {
        let mut g = Graph::default();
        let x = g.add_value(
            "x",
            ValueKind::Input,
            Some(DType::F32),
            Some(vec![Dim::Sym("s0".into()), Dim::Known(12), Dim::Sym("s1".into()), Dim::Known(64)]),
        );
        let shape = g.add_node("shape", "Shape", vec![Some(x)], Attrs::default(), 1)[0];
        let (one, two, minus) = (
            g.add_const("one", Tensor::from_i64(vec![1], vec![1])),
            g.add_const("two", Tensor::from_i64(vec![1], vec![2])),
            g.add_const("m1", Tensor::from_i64(vec![1], vec![-1])),
        );
        let end = g.add_const("end", Tensor::from_i64(vec![1], vec![i64::MAX]));
        // [-1, x[-2], x[-1]] as torchlib writes the merge of the leading dims
        let m2 = g.add_const("m2", Tensor::from_i64(vec![1], vec![-2]));
        let last = g.add_node("last", "Slice", vec![Some(shape), Some(minus), Some(end)], Attrs::default(), 1)[0];
        let second = g.add_node("second", "Slice", vec![Some(shape), Some(m2), Some(minus)], Attrs::default(), 1)[0];
        let merged = g.add_node("cat", "Concat", vec![Some(minus), Some(second), Some(last)], Attrs::default(), 1)[0];
        let want = vec![SymDim::Known(-1), SymDim::Named("s1".into()), SymDim::Known(64)];
        assert_eq!(values(&g, merged), Some(want));
        // x[1:2] and Gather(shape, 0)
        let mid = g.add_node("mid", "Slice", vec![Some(shape), Some(one), Some(two)], Attrs::default(), 1)[0];
        assert_eq!(values(&g, mid), Some(vec![SymDim::Known(12)]));
        let zero = g.add_const("zero", Tensor::from_i64(vec![], vec![0]));
        let b = g.add_node("b", "Gather", vec![Some(shape), Some(zero)], Attrs::default(), 1)[0];
        assert_eq!(values(&g, b), Some(vec![SymDim::Named("s0".into())]));
        // an op it does not know
        let neg = g.add_node("neg", "Neg", vec![Some(mid)], Attrs::default(), 1)[0];
        assert_eq!(values(&g, neg), None);
        let full = declared(&g, x).expect("declared");
        assert!(reshapes_to(&[SymDim::Named("s0".into()), SymDim::Known(-1), SymDim::Named("s1".into()), SymDim::Known(64)], &full));
        assert!(!reshapes_to(&[SymDim::Known(-1), SymDim::Known(-1), SymDim::Named("s1".into()), SymDim::Known(64)], &full));
        assert!(!reshapes_to(&[SymDim::Named("s1".into()), SymDim::Known(12), SymDim::Named("s0".into()), SymDim::Known(64)], &full));
    }
}
