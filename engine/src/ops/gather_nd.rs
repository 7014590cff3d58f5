//! GatherND (opset 13, batch_dims) and its internal gradient GatherNDGrad(dy, indices,
//! data_shape) (scatter-add of dy slices into zeros of the data's shape).
//! Output shape: indices.shape[..q-1] ++ data.shape[batch_dims + k..], k = indices.shape[q-1].

use super::util::{const_ints, input};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::DType;

/// Layout of a GatherND: (batch count, tuples per batch, tuple length k, slice size, data
/// elements per batch, dims indexed by a tuple).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatherNdLayout {
    pub batches: usize,
    pub tuples: usize,
    pub k: usize,
    pub slice: usize,
    pub batch_block: usize,
    pub dims: Vec<usize>,
    pub out_shape: Vec<usize>,
}

pub fn gather_nd_layout(node: &Node, data: &[usize], indices: &[usize]) -> Result<GatherNdLayout> {
    let b = node.attrs.int("batch_dims", 0).map_err(|e| node.err(e.to_string()))?;
    let (r, q) = (data.len(), indices.len());
    if b < 0 || q < 1 || r < 1 || b as usize >= q.min(r) {
        return Err(node.err(format!("batch_dims {b} does not fit data {data:?} and indices {indices:?}")));
    }
    let b = b as usize;
    if data[..b] != indices[..b] {
        return Err(node.err(format!("batch dims of data {data:?} and indices {indices:?} differ")));
    }
    let k = indices[q - 1];
    if k < 1 || k > r - b {
        return Err(node.err(format!("index tuples of length {k} do not fit data {data:?} with batch_dims {b}")));
    }
    let mut out_shape = indices[..q - 1].to_vec();
    out_shape.extend_from_slice(&data[b + k..]);
    let batches: usize = data[..b].iter().product();
    Ok(GatherNdLayout {
        batches,
        tuples: indices[b..q - 1].iter().product(),
        k,
        slice: data[b + k..].iter().product(),
        batch_block: data[b..].iter().product(),
        dims: data[b..b + k].to_vec(),
        out_shape,
    })
}

struct GatherNd;
impl OpDef for GatherNd {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let idx = input(node, inputs, 1)?;
        if idx.dtype != DType::I64 {
            return Err(node.err(format!("indices must be int64, got {}", idx.dtype.name())));
        }
        let l = gather_nd_layout(node, x.shape, idx.shape)?;
        Ok(vec![TypeOut::new(x.dtype, l.out_shape)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, idx) = (g.x(0)?, g.x(1)?);
            let s = g.shape_of(x);
            let attrs = Attrs::default().with("batch_dims", Attr::Int(node.attrs.int("batch_dims", 0)?));
            let d = g.op("GatherNDGrad", &[dy, idx, s], attrs);
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1]
    }
}

struct GatherNdGrad;
impl OpDef for GatherNdGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let idx = input(node, inputs, 1)?;
        let s: Vec<usize> = const_ints(node, &inputs[2], "shape")?.into_iter().map(|d| d.max(0) as usize).collect();
        let l = gather_nd_layout(node, &s, idx.shape)?;
        if l.out_shape != dy.shape {
            return Err(node.err(format!("dy {:?} does not match the gather's output {:?}", dy.shape, l.out_shape)));
        }
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("GatherND", GatherNd);
    r.internal("GatherNDGrad", GatherNdGrad);
}
