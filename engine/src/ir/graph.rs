//! Graph, Node and Value. Values are referenced by index; a node's optional inputs are `None`.
//! Nodes are kept in a topological order: importers append in ONNX order, autodiff appends
//! gradient nodes after the forward nodes they depend on.

use std::collections::HashMap;
use std::sync::Arc;

use super::attrs::Attrs;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// A dimension of a declared shape: known, or a named symbol bound at run time.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Known(usize),
    Sym(String),
}

#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// A graph input fed per call (user data, or the gradient of an output).
    Input,
    /// A named weight bound by the caller at run time (a parameter or a buffer).
    Weight,
    /// A constant known at import (Constant node output, or an initializer that is no weight).
    Const(Arc<Tensor>),
    /// Computed by a node.
    Computed,
}

#[derive(Clone, Debug)]
pub struct Value {
    pub name: String,
    pub kind: ValueKind,
    pub dtype: Option<DType>,
    /// Declared shape (graph inputs, weights); None where only run-time inference knows it.
    pub shape: Option<Vec<Dim>>,
    pub producer: Option<NodeId>,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    pub inputs: Vec<Option<ValueId>>,
    pub outputs: Vec<ValueId>,
    pub attrs: Attrs,
}

impl Node {
    pub fn input(&self, i: usize) -> Option<ValueId> {
        self.inputs.get(i).copied().flatten()
    }
    /// The i-th input, required: an error names the node.
    pub fn req_input(&self, i: usize) -> Result<ValueId> {
        self.input(i).ok_or_else(|| Error::Node {
            op_type: self.op_type.clone(),
            node: self.name.clone(),
            msg: format!("input {i} is required"),
        })
    }
    pub fn err(&self, msg: impl Into<String>) -> Error {
        Error::Node { op_type: self.op_type.clone(), node: self.name.clone(), msg: msg.into() }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    /// Weights in declaration order, with their initial data from the file (if any).
    pub weights: Vec<(ValueId, Option<Arc<Tensor>>)>,
    /// The model's checkpointed parts, recomputed in the backward pass (passes/recompute_segments.rs).
    pub recompute: Vec<RecomputeSegment>,
    by_name: HashMap<String, ValueId>,
}

/// A checkpointed part of the model (`torch.utils.checkpoint` around a module): the module's
/// input and output value names, from the ModelProto metadata `ortrain.recompute_segments`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecomputeSegment {
    /// The module's path in the PyTorch model (for reports).
    pub name: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
}

impl Graph {
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.0]
    }
    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }
    /// Adds a value; the name is made unique if taken.
    pub fn add_value(&mut self, name: &str, kind: ValueKind, dtype: Option<DType>, shape: Option<Vec<Dim>>) -> ValueId {
        let mut unique = name.to_string();
        let mut k = 1;
        while self.by_name.contains_key(&unique) {
            unique = format!("{name}__{k}");
            k += 1;
        }
        let id = ValueId(self.values.len());
        self.by_name.insert(unique.clone(), id);
        self.values.push(Value { name: unique, kind, dtype, shape, producer: None });
        id
    }
    pub fn add_const(&mut self, name: &str, t: Tensor) -> ValueId {
        let dtype = t.dtype();
        let shape = t.shape.iter().map(|&d| Dim::Known(d)).collect();
        self.add_value(name, ValueKind::Const(Arc::new(t)), Some(dtype), Some(shape))
    }
    /// Appends a node computing `n_out` new values; returns their ids.
    pub fn add_node(&mut self, name: &str, op_type: &str, inputs: Vec<Option<ValueId>>, attrs: Attrs, n_out: usize) -> Vec<ValueId> {
        let node_id = NodeId(self.nodes.len());
        let outputs: Vec<ValueId> = (0..n_out)
            .map(|i| {
                let v = self.add_value(&format!("{name}:{i}"), ValueKind::Computed, None, None);
                self.values[v.0].producer = Some(node_id);
                v
            })
            .collect();
        self.nodes.push(Node { name: name.to_string(), op_type: op_type.to_string(), inputs, outputs: outputs.clone(), attrs });
        outputs
    }
    /// Appends a node whose outputs are existing, producer-less values (used by importers).
    pub fn push_node(&mut self, node: Node) -> Result<NodeId> {
        let id = NodeId(self.nodes.len());
        for &o in &node.outputs {
            let v = &mut self.values[o.0];
            if v.producer.is_some() || v.kind != ValueKind::Computed {
                return Err(node.err(format!("output '{}' is already defined", v.name)));
            }
            v.producer = Some(id);
        }
        self.nodes.push(node);
        Ok(id)
    }
    /// Consumers of every value: value index -> list of (node, input slot).
    /// Sets every value's producer from the node order (a value no node writes has none), after
    /// a pass moved, replaced or dropped nodes.
    pub fn renumber_producers(&mut self) {
        for v in self.values.iter_mut() {
            v.producer = None;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            for o in &node.outputs {
                self.values[o.0].producer = Some(NodeId(i));
            }
        }
    }
    pub fn consumers(&self) -> Vec<Vec<(NodeId, usize)>> {
        let mut c = vec![Vec::new(); self.values.len()];
        for (n, node) in self.nodes.iter().enumerate() {
            for (slot, inp) in node.inputs.iter().enumerate() {
                if let Some(v) = inp {
                    c[v.0].push((NodeId(n), slot));
                }
            }
        }
        c
    }
}
