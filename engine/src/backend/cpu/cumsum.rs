//! CPU kernel of ops/cumsum.rs: running sums along one axis, each (outer, inner) line in turn
//! (parallel over outer blocks for large inputs); float sums accumulate in the element type, as
//! PyTorch's cumsum does (bf16 and f16 run widened, backend/cpu/widen.rs: they sum in f32).

use rayon::prelude::*;

use super::elementwise::{first, Arith};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;

fn cumsum(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let axis_t = inputs.get(1).and_then(|v| v.as_ref()).map(|a| a.to_tensor());
    let axis_in = axis_t.as_ref().map(|t| crate::ops::InferIn { dtype: t.dtype(), shape: &t.shape, value: Some(t) });
    let axis = crate::ops::cumsum_axis_of(node, &axis_in, x.shape.len())?;
    let exclusive = node.attrs.int("exclusive", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let reverse = node.attrs.int("reverse", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let n = x.shape.get(axis).copied().unwrap_or(1);
    let inner: usize = x.shape.get(axis + 1..).map(|s| s.iter().product()).unwrap_or(1);
    fn go<T: Arith>(x: &In, o: &mut Out, n: usize, inner: usize, exclusive: bool, reverse: bool) -> Result<()> {
        let xv = x.slice::<T>()?;
        let ov = o.slice::<T>()?;
        let block = n * inner;
        if block == 0 {
            return Ok(());
        }
        let body = |(b, ob): (usize, &mut [T])| {
            let xb = &xv[b * block..(b + 1) * block];
            for j in 0..inner {
                let mut acc = T::zero();
                for s in 0..n {
                    let i = if reverse { n - 1 - s } else { s };
                    let v = xb[i * inner + j];
                    if exclusive {
                        ob[i * inner + j] = acc;
                        acc = acc + v;
                    } else {
                        acc = acc + v;
                        ob[i * inner + j] = acc;
                    }
                }
            }
        };
        if ov.len() >= PAR_MIN {
            ov.par_chunks_mut(block).enumerate().for_each(body);
        } else {
            ov.chunks_mut(block).enumerate().for_each(body);
        }
        Ok(())
    }
    crate::dispatch_num!(x.dtype, node, go::<T>(x, &mut out[0], n, inner, exclusive, reverse))
}

pub fn register(t: &mut KernelTable) {
    t.add("CumSum", cumsum);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{DType, Data, Tensor};

    #[test]
    fn cumsum_modes() {
        let x = Tensor::from_i64(vec![2, 3], vec![1, 2, 3, 4, 5, 6]);
        let ax = |a: i64| Tensor::from_i64(vec![], vec![a]);
        let r = |a: Attrs, axis: i64| run("CumSum", a, &[&x, &ax(axis)])[0].to_i64_vec().unwrap();
        assert_eq!(r(Attrs::default(), 1), vec![1, 3, 6, 4, 9, 15]);
        assert_eq!(r(Attrs::default(), -1), vec![1, 3, 6, 4, 9, 15]);
        assert_eq!(r(Attrs::default(), 0), vec![1, 2, 3, 5, 7, 9]);
        assert_eq!(r(Attrs::default().with("exclusive", Attr::Int(1)), 1), vec![0, 1, 3, 0, 4, 9]);
        assert_eq!(r(Attrs::default().with("reverse", Attr::Int(1)), 1), vec![6, 5, 3, 15, 11, 6]);
        let both = Attrs::default().with("reverse", Attr::Int(1)).with("exclusive", Attr::Int(1));
        assert_eq!(r(both, 1), vec![5, 3, 0, 11, 6, 0]);
    }

    /// A 16-bit CumSum sums in f32 and rounds each running sum once (as CUDA's kernel and
    /// PyTorch's half cumsum): 300 ones reach 300 in bf16, where summing in bf16 stalls at 256
    /// (256 + 1 rounds back to 256).
    #[test]
    fn sixteen_bit_cumsum_sums_in_f32() {
        let ax = Tensor::from_i64(vec![], vec![0]);
        let ones = Tensor::new(vec![300], Data::BF16(vec![half::bf16::ONE; 300])).expect("tensor");
        let y = run("CumSum", Attrs::default(), &[&ones, &ax]).remove(0);
        assert_eq!(y.dtype(), DType::BF16);
        let v = y.to_f64_vec();
        assert_eq!((v[255], v[299]), (256.0, 300.0));
        assert_eq!(v[256], 256.0, "257 rounds to even in bf16");
        let ones = Tensor::new(vec![3000], Data::F16(vec![half::f16::ONE; 3000])).expect("tensor");
        let v = run("CumSum", Attrs::default(), &[&ones, &ax]).remove(0).to_f64_vec();
        assert_eq!(v[2999], 3000.0, "f16 sums stall at 2048 when summed in f16");
    }
}
