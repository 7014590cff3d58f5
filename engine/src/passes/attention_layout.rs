//! attention_layout (after fuse_attention): the fused Attention reads Q, K, V in
//! the layout the projections write them, [B, T, H, D] with the heads inside each row, and writes
//! O in it (`layout = "BSHD"`, ops/attention.rs), where the graph moved the heads out with
//! Transposes: Q = Transpose(Xq, [0, 2, 1, 3]), the same for V; Kᵀ = Transpose(Xk, [0, 2, 3, 1]),
//! or made from K = Transpose(Xk, [0, 2, 1, 3]) by Transpose(K, [0, 1, 3, 2]) or by torchlib's
//! Reshape(Transpose(Reshape(K, [-1, S, D]), [0, 2, 1]), [B, H, D, S]); and O's only reader
//! Transpose(O, [0, 2, 1, 3]) (after an identity Reshape, as torchlib writes it). Those
//! transposes and their gradients, ten [B, T, H, D] copies a layer in a step, are not made; the
//! kernels read with strides. The Reshapes are proved from the exporter's symbolic shapes
//! (sym_shape.rs).

use super::sym_shape::{reshapes_to, shape_of, values, SymDim};
use crate::ir::{Attr, Graph, NodeId, ValueId, ValueKind};

const HEADS_OUT: [i64; 4] = [0, 2, 1, 3];

/// The producer of `v` if it is a Transpose by `perm`, and its input.
fn transposed(graph: &Graph, v: ValueId, perm: &[i64]) -> Option<ValueId> {
    let node = &graph.nodes[graph.value(v).producer?.0];
    (node.op_type == "Transpose" && node.attrs.ints("perm").ok()?.as_deref() == Some(perm)).then(|| node.input(0)).flatten()
}

/// (input, target) of a Reshape producing `v`, its target without zeros (which mean "copy that
/// dim" or a literal 0 depending on `allowzero`: neither is what these patterns write).
pub(super) fn reshaped(graph: &Graph, v: ValueId) -> Option<(ValueId, Vec<SymDim>)> {
    let node = &graph.nodes[graph.value(v).producer?.0];
    if node.op_type != "Reshape" {
        return None;
    }
    let target = values(graph, node.input(1)?)?;
    (!target.contains(&SymDim::Known(0))).then_some((node.input(0)?, target))
}

/// K [B, H, S, D] of an operand Kᵀ [B, H, D, S] written as Transpose(K, [0, 1, 3, 2]) or as
/// torchlib writes it, Reshape(Transpose(Reshape(K, [-1, S, D]), [0, 2, 1]), [B, H, D, S]).
pub(super) fn keys_of(graph: &Graph, kt: ValueId) -> Option<ValueId> {
    if let Some(k) = transposed(graph, kt, &[0, 1, 3, 2]) {
        return Some(k);
    }
    let (flat_t, split) = reshaped(graph, kt)?;
    let flat = transposed(graph, flat_t, &[0, 2, 1])?;
    let (k, merge) = reshaped(graph, flat)?;
    let [b, h, s, d] = <[SymDim; 4]>::try_from(shape_of(graph, k)?).ok()?;
    let merged = reshapes_to(&merge, &[SymDim::Known(-1), s.clone(), d.clone()]);
    (merged && reshapes_to(&split, &[b, h, d, s])).then_some(k)
}

/// Xk of an operand Kᵀ [B, H, D, S] made from K = Transpose(Xk, [0, 2, 1, 3]).
fn key_source(graph: &Graph, kt: ValueId) -> Option<ValueId> {
    if let Some(xk) = transposed(graph, kt, &[0, 2, 3, 1]) {
        return Some(xk);
    }
    transposed(graph, keys_of(graph, kt)?, &HEADS_OUT)
}

/// Whether Xq [B, T, H, D], Xk [B, S, H, D] and Xv [B, S, H, Dv] are known to share B, H and
/// S (and D for Q and K), as layout BSHD needs: a batch or heads broadcast (multi-query
/// attention's one K and V head) stay in the BHSD layout, whose strides broadcast.
fn same_heads(graph: &Graph, xq: ValueId, xk: ValueId, xv: ValueId) -> bool {
    let (Some(q), Some(k), Some(v)) = (shape_of(graph, xq), shape_of(graph, xk), shape_of(graph, xv)) else { return false };
    let ranks = q.len() == 4 && k.len() == 4 && v.len() == 4;
    ranks && q[0] == k[0] && q[0] == v[0] && q[2] == k[2] && q[2] == v[2] && q[3] == k[3] && k[1] == v[1]
}

/// The value of Transpose(O, [0, 2, 1, 3]) when that (after an identity Reshape) is O's only
/// reader, and the nodes on the way.
fn merged_output(graph: &Graph, consumers: &[Vec<(NodeId, usize)>], o: ValueId) -> Option<(ValueId, Vec<NodeId>)> {
    let only = |v: ValueId| match consumers[v.0][..] {
        [(n, 0)] if !graph.outputs.contains(&v) => Some(n),
        _ => None,
    };
    let mut n = only(o)?;
    let mut way = vec![n];
    if graph.nodes[n.0].op_type == "Reshape" {
        let (_, target) = reshaped(graph, graph.nodes[n.0].outputs[0])?;
        if !reshapes_to(&target, &shape_of(graph, o)?) {
            return None;
        }
        n = only(graph.nodes[n.0].outputs[0])?;
        way.push(n);
    }
    let node = &graph.nodes[n.0];
    let y = node.outputs[0];
    (transposed(graph, y, &HEADS_OUT).is_some()).then_some((y, way))
}

pub fn run(graph: &mut Graph) -> usize {
    let consumers = graph.consumers();
    let mut rewrites = 0;
    for n in 0..graph.nodes.len() {
        let node = &graph.nodes[n];
        if node.op_type != "Attention" || node.attrs.get("layout").is_some() {
            continue;
        }
        let (Some(q), Some(kt), Some(v), Some(&o)) = (node.input(0), node.input(1), node.input(2), node.outputs.first()) else { continue };
        let sources = (transposed(graph, q, &HEADS_OUT), key_source(graph, kt), transposed(graph, v, &HEADS_OUT));
        let (Some(xq), Some(xk), Some(xv)) = sources else { continue };
        if !same_heads(graph, xq, xk, xv) {
            continue;
        }
        let Some((y, way)) = merged_output(graph, &consumers, o) else { continue };
        let node = &mut graph.nodes[n];
        node.inputs[0] = Some(xq);
        node.inputs[1] = Some(xk);
        node.inputs[2] = Some(xv);
        node.outputs[0] = y;
        node.attrs.set("layout", Attr::String("BSHD".into()));
        // the nodes between O and y now write values nobody reads: the dead-node sweep drops them
        for w in way {
            let name = format!("{}:unused", graph.nodes[w.0].name);
            let unused = graph.add_value(&name, ValueKind::Computed, None, None);
            graph.values[unused.0].producer = Some(w);
            graph.nodes[w.0].outputs[0] = unused;
        }
        graph.values[y.0].producer = Some(NodeId(n));
        rewrites += 1;
    }
    rewrites
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, Dim};
    use crate::tensor::{DType, Tensor};

    use crate::passes::sym_shape::test_dims as sym;

    fn node_out(g: &mut Graph, name: &str, op: &str, ins: &[ValueId], attrs: Attrs, shape: Option<Vec<Dim>>) -> ValueId {
        let out = g.add_node(name, op, ins.iter().map(|&v| Some(v)).collect(), attrs, 1)[0];
        g.values[out.0].shape = shape;
        out
    }

    fn perm(p: &[i64]) -> Attrs {
        Attrs::default().with("perm", Attr::Ints(p.to_vec()))
    }

    /// torchlib's attention over xq, xk, xv [b, t, 4, 8]: Kᵀ through Reshape(Transpose(Reshape(K,
    /// [-1, K[-2], K[-1]]), [0, 2, 1]), [K[:-2], K[-1], K[-2]]) (`swap`: the merge's last two
    /// dims the wrong way round), O transposed back; `o_read`: O is also a graph output;
    /// `kv_heads`: the heads of xk and xv ("1": multi-query attention, K and V broadcast).
    fn torchlib(swap: bool, o_read: bool, kv_heads: &str) -> Graph {
        let mut g = Graph::default();
        let bthd = sym(&["b", "t", "4", "8"]);
        let kv = sym(&["b", "t", kv_heads, "8"]);
        let mut input = |name: &str, shape: &Option<Vec<Dim>>| {
            let v = g.add_value(name, ValueKind::Input, Some(DType::F32), shape.clone());
            g.inputs.push(v);
            v
        };
        let (xq, xk, xv) = (input("xq", &bthd), input("xk", &kv), input("xv", &kv));
        let (heads, kv_out) = (sym(&["b", "4", "t", "8"]), sym(&["b", kv_heads, "t", "8"]));
        let q = node_out(&mut g, "q", "Transpose", &[xq], perm(&[0, 2, 1, 3]), heads.clone());
        let k = node_out(&mut g, "k", "Transpose", &[xk], perm(&[0, 2, 1, 3]), kv_out.clone());
        let v = node_out(&mut g, "v", "Transpose", &[xv], perm(&[0, 2, 1, 3]), kv_out);
        let c = |g: &mut Graph, name: &str, x: i64| g.add_const(name, Tensor::from_i64(vec![1], vec![x]));
        let (minus1, minus2, lo, hi) = (c(&mut g, "m1", -1), c(&mut g, "m2", -2), c(&mut g, "lo", i64::MIN), c(&mut g, "hi", i64::MAX));
        let shape = node_out(&mut g, "shape", "Shape", &[k], Attrs::default(), None);
        let slice = |g: &mut Graph, name: &str, a: ValueId, b: ValueId| node_out(g, name, "Slice", &[shape, a, b], Attrs::default(), None);
        let (last, second, lead) =
            (slice(&mut g, "last", minus1, hi), slice(&mut g, "second", minus2, minus1), slice(&mut g, "lead", lo, minus2));
        let merge_dims = if swap { [minus1, last, second] } else { [minus1, second, last] };
        let merge = node_out(&mut g, "merge", "Concat", &merge_dims, Attrs::default().with("axis", Attr::Int(0)), None);
        let flat = node_out(&mut g, "flat", "Reshape", &[k, merge], Attrs::default(), None);
        let flat_t = node_out(&mut g, "flat_t", "Transpose", &[flat], perm(&[0, 2, 1]), None);
        let split = node_out(&mut g, "split", "Concat", &[lead, last, second], Attrs::default().with("axis", Attr::Int(0)), None);
        let kt = node_out(&mut g, "kt", "Reshape", &[flat_t, split], Attrs::default(), None);
        let outs = g.add_node("attn", "Attention", vec![Some(q), Some(kt), Some(v)], Attrs::default(), 2);
        g.values[outs[0].0].shape = heads;
        let y = node_out(&mut g, "merged", "Transpose", &[outs[0]], perm(&[0, 2, 1, 3]), bthd);
        g.outputs.push(y);
        if o_read {
            g.outputs.push(outs[0]);
        }
        g
    }

    #[test]
    fn torchlib_attention_reads_and_writes_the_heads_inside_the_rows() {
        let mut g = torchlib(false, false, "4");
        assert_eq!(run(&mut g), 1);
        super::super::remove_dead_nodes(&mut g);
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Attention"], "every transpose, reshape and shape expression is gone");
        let a = &g.nodes[0];
        let names: Vec<&str> = a.inputs.iter().flatten().map(|v| g.value(*v).name.as_str()).collect();
        assert_eq!(names, ["xq", "xk", "xv"]);
        assert_eq!(a.attrs.string("layout", "").expect("layout"), "BSHD");
        assert_eq!(g.outputs, vec![a.outputs[0]], "the attention writes the merged output itself");
    }

    #[test]
    fn an_unproven_reshape_a_read_output_or_broadcast_heads_keep_the_layout() {
        let mut g = torchlib(true, false, "4");
        assert_eq!(run(&mut g), 0, "a merge of [S, D] as [D, S] is not Kᵀ");
        let mut g = torchlib(false, true, "4");
        assert_eq!(run(&mut g), 0, "O in the heads-out layout is read elsewhere");
        let mut g = torchlib(false, false, "1");
        assert_eq!(run(&mut g), 0, "one K and V head for 4 query heads broadcasts");
    }
}
