//! The intermediate representation: a graph of nodes over values with symbolic shapes.

mod attrs;
mod graph;

pub use attrs::{Attr, Attrs};
pub use graph::{Dim, Graph, Node, NodeId, RecomputeSegment, Value, ValueId, ValueKind};
