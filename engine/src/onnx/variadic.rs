//! Import-time rewrite of ONNX's variadic element-wise ops into the binary ones the engine
//! runs (both backends, with their gradients): `Sum(x1..xn)` and `Mean` become a chain of Adds
//! (Mean then scaled by 1/n with `Affine`), `Max` and `Min` of other than two inputs a chain of
//! two-input Max / Min. One input is an `Identity`. Broadcasting is the binary ops' own (the
//! variadic ops broadcast the same way, pairwise). Models from PyTorch's exporters rarely hold
//! these; models converted from other frameworks do (brief: start from an ONNX model).

use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Graph, Node, ValueId, ValueKind};

/// Whether the importer rewrites a node of `op_type` with `n_inputs` inputs here.
pub fn rewrites(op_type: &str, n_inputs: usize) -> bool {
    match op_type {
        "Sum" | "Mean" => true,
        "Max" | "Min" => n_inputs != 2,
        _ => false,
    }
}

/// Adds the nodes computing `op_type(inputs)` into `output`, named after `name`.
pub fn push(graph: &mut Graph, name: &str, op_type: &str, inputs: &[Option<ValueId>], output: ValueId, opset: i64) -> Result<()> {
    let err = |msg: String| Error::Node { op_type: op_type.into(), node: name.into(), msg };
    let xs: Vec<ValueId> = inputs.iter().map(|v| v.ok_or_else(|| err("an input is empty".into()))).collect::<Result<_>>()?;
    let binary = match op_type {
        "Sum" | "Mean" => "Add",
        "Max" => "Max",
        "Min" => "Min",
        other => return Err(err(format!("{other} is not a variadic op"))),
    };
    let (first, rest) = xs.split_first().ok_or_else(|| err("needs one input at least".into()))?;
    let scale = (op_type == "Mean" && xs.len() > 1).then(|| 1.0 / xs.len() as f32);
    let attrs = || Attrs::default().with("__opset", Attr::Int(opset));
    let node = |name: String, op: &str, inputs: Vec<ValueId>, output: ValueId, attrs: Attrs| Node {
        name,
        op_type: op.into(),
        inputs: inputs.into_iter().map(Some).collect(),
        outputs: vec![output],
        attrs,
    };
    if rest.is_empty() {
        graph.push_node(node(name.to_string(), "Identity", vec![*first], output, attrs()))?;
        return Ok(());
    }
    let mut acc = *first;
    for (k, &x) in rest.iter().enumerate() {
        let last = k + 1 == rest.len() && scale.is_none();
        let out = if last { output } else { graph.add_value(&format!("{name}:partial{k}"), ValueKind::Computed, None, None) };
        let step = if rest.len() == 1 && scale.is_none() { name.to_string() } else { format!("{name}:{binary}{k}") };
        graph.push_node(node(step, binary, vec![acc, x], out, attrs()))?;
        acc = out;
    }
    if let Some(s) = scale {
        let a = attrs().with("alpha", Attr::Float(s)).with("beta", Attr::Float(0.0));
        graph.push_node(node(name.to_string(), "Affine", vec![acc], output, a))?;
    }
    Ok(())
}

/// The ops rewritten here for any number of inputs, with the registered ops they become.
pub const REWRITTEN: &[(&str, &[&str])] = &[("Sum", &["Add", "Identity"]), ("Mean", &["Add", "Affine", "Identity"])];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;

    fn inputs(g: &mut Graph, n: usize) -> Vec<Option<ValueId>> {
        (0..n).map(|k| Some(g.add_value(&format!("x{k}"), ValueKind::Input, None, Some(vec![Dim::Known(2)])))).collect()
    }

    fn ops(g: &Graph) -> Vec<&str> {
        g.nodes.iter().map(|n| n.op_type.as_str()).collect()
    }

    #[test]
    fn variadic_ops_become_chains_of_binary_ones() {
        let mut g = Graph::default();
        let xs = inputs(&mut g, 3);
        let y = g.add_value("y", ValueKind::Computed, None, None);
        push(&mut g, "mean", "Mean", &xs, y, 17).unwrap();
        assert_eq!(ops(&g), ["Add", "Add", "Affine"]);
        assert_eq!(g.nodes[2].attrs.float("alpha", 0.0).unwrap(), 1.0 / 3.0);
        assert_eq!(g.nodes[2].outputs, [y], "the chain ends in the node's output");
        assert_eq!(g.nodes[1].inputs[0], Some(g.nodes[0].outputs[0]), "each Add takes the one before");

        let mut g = Graph::default();
        let xs = inputs(&mut g, 1);
        let y = g.add_value("y", ValueKind::Computed, None, None);
        push(&mut g, "max", "Max", &xs, y, 17).unwrap();
        assert_eq!(ops(&g), ["Identity"]);

        let mut g = Graph::default();
        let xs = inputs(&mut g, 2);
        let y = g.add_value("y", ValueKind::Computed, None, None);
        push(&mut g, "sum", "Sum", &xs, y, 17).unwrap();
        assert_eq!((ops(&g), g.nodes[0].name.as_str()), (vec!["Add"], "sum"), "two inputs: one Add named as the node");
        assert!(rewrites("Min", 3) && rewrites("Min", 1) && !rewrites("Min", 2) && rewrites("Sum", 2));
        assert!(push(&mut g, "bad", "Sum", &[], y, 17).is_err(), "no inputs is an error");
    }
}
