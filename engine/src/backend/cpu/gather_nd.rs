//! CPU kernels of ops/gather_nd.rs: GatherND copies slices (any element type, by byte width);
//! GatherNDGrad scatter-adds them back into zeros.

use rayon::prelude::*;

use super::elementwise::{first, Arith};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::ops::gather_nd_layout_of;

/// The data offset (in slices, within its batch) of every index tuple, checked and wrapped.
fn tuple_offsets(node: &Node, idx: &In, dims: &[usize], k: usize) -> Result<Vec<usize>> {
    let iv = idx.slice::<i64>()?;
    iv.chunks(k.max(1))
        .map(|t| {
            let mut off = 0usize;
            for (j, (&i, &d)) in t.iter().zip(dims).enumerate() {
                let w = if i < 0 { i + d as i64 } else { i };
                if w < 0 || w >= d as i64 {
                    return Err(node.err(format!("index {i} at tuple position {j} is out of range for a dimension of size {d}")));
                }
                off = off * d + w as usize;
            }
            Ok(off)
        })
        .collect()
}

fn gather_nd(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let idx = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (indices) missing"))?;
    let l = gather_nd_layout_of(node, x.shape, idx.shape)?;
    let offs = tuple_offsets(node, idx, &l.dims, l.k)?;
    let es = x.dtype.size();
    let slice = l.slice * es;
    let src = x.bytes();
    let dst = out[0].bytes();
    if slice == 0 {
        return Ok(());
    }
    let copy = |(t, chunk): (usize, &mut [u8])| {
        let batch = t / l.tuples.max(1);
        let s = batch * l.batch_block * es + offs[t] * slice;
        chunk.copy_from_slice(&src[s..s + slice]);
    };
    if dst.len() >= PAR_MIN * 4 {
        dst.par_chunks_mut(slice).enumerate().for_each(copy);
    } else {
        dst.chunks_mut(slice).enumerate().for_each(copy);
    }
    Ok(())
}

fn gather_nd_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let idx = inputs.get(1).and_then(|v| v.as_ref()).ok_or_else(|| node.err("input 1 (indices) missing"))?;
    let shape = out[0].shape.to_vec();
    let l = gather_nd_layout_of(node, &shape, idx.shape)?;
    let offs = tuple_offsets(node, idx, &l.dims, l.k)?;
    fn go<T: Arith>(dy: &In, o: &mut Out, l: &crate::ops::gather_nd::GatherNdLayout, offs: &[usize]) -> Result<()> {
        let src = dy.slice::<T>()?;
        let dst = o.slice::<T>()?;
        dst.iter_mut().for_each(|v| *v = T::zero());
        let s = l.slice;
        for (t, &off) in offs.iter().enumerate() {
            let batch = t / l.tuples.max(1);
            let d = batch * l.batch_block + off * s;
            for (a, &b) in dst[d..d + s].iter_mut().zip(&src[t * s..(t + 1) * s]) {
                *a = *a + b;
            }
        }
        Ok(())
    }
    crate::dispatch_num!(dy.dtype, node, go::<T>(dy, &mut out[0], &l, &offs))
}

pub fn register(t: &mut KernelTable) {
    t.add("GatherND", gather_nd);
    t.add("GatherNDGrad", gather_nd_grad);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::Tensor;

    #[test]
    fn gather_nd_spec_examples_and_grad() {
        // spec example 2: data [[0,1],[2,3]], indices [[1],[0]] -> rows [[2,3],[0,1]]
        let x = Tensor::from_f32(vec![2, 2], vec![0., 1., 2., 3.]);
        let i = Tensor::from_i64(vec![2, 1], vec![1, 0]);
        let r = run("GatherND", Attrs::default(), &[&x, &i]);
        assert_eq!((r[0].shape.clone(), r[0].to_f64_vec()), (vec![2, 2], vec![2., 3., 0., 1.]));
        // full tuples with a repeat and a negative index: [[0,0],[1,-1],[0,0]] -> [0, 3, 0]
        let i = Tensor::from_i64(vec![3, 2], vec![0, 0, 1, -1, 0, 0]);
        let r = run("GatherND", Attrs::default(), &[&x, &i]);
        assert_eq!(r[0].to_f64_vec(), vec![0., 3., 0.]);
        let dy = Tensor::from_f32(vec![3], vec![1., 2., 4.]);
        let s = Tensor::from_i64(vec![2], vec![2, 2]);
        assert_eq!(run("GatherNDGrad", Attrs::default(), &[&dy, &i, &s])[0].to_f64_vec(), vec![5., 0., 0., 2.]);
        // batch_dims 1 (spec example 5): data [2,2,2], indices [[1],[0]] -> [[2,3],[4,5]]
        let x = Tensor::from_i64(vec![2, 2, 2], (0..8).collect());
        let i = Tensor::from_i64(vec![2, 1], vec![1, 0]);
        let a = Attrs::default().with("batch_dims", Attr::Int(1));
        let r = run("GatherND", a, &[&x, &i]);
        assert_eq!(r[0].to_i64_vec().unwrap(), vec![2, 3, 4, 5]);
        let bad = Tensor::from_i64(vec![1, 1], vec![2]);
        assert!(super::super::testutil::try_run("GatherND", Attrs::default(), &[&Tensor::from_f32(vec![2], vec![0., 1.]), &bad]).is_err());
    }
}
