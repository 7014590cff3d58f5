//! 16-bit floats (bf16, fp16) on the CPU. Plans of mixed-precision sessions keep activations in
//! 16 bits (half the memory and traffic on a GPU); the CPU kernels compute in f32 and f64 only,
//! so a kernel given a 16-bit input or output runs here on f32 copies: inputs widened, outputs
//! computed in f32 and rounded to nearest even once, as a GPU kernel that computes in f32 and
//! stores 16 bits does. This is the CPU's reference for those plans, not a fast path.

use half::slice::HalfFloatSliceExt;

use super::{CpuCtx, In, Kernel, Out};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// Runs `kernel`, widening 16-bit float views to f32 around it when there are any.
pub fn call(kernel: Kernel, node: &Node, ins: &[Option<In>], outs: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    // inputs read for their type only keep it (Shape's result, CastLike's target) and may have
    // no data behind them (at plan time, or memory a plan has already reused)
    let data_read = |k: usize, i: &In| i.dtype.is_half() && !crate::ops::reads_type_only(&node.op_type, k);
    let half_in = ins.iter().enumerate().any(|(k, i)| i.as_ref().is_some_and(|i| data_read(k, i)));
    if !half_in && !outs.iter().any(|o| o.dtype.is_half()) {
        return kernel(node, ins, outs, ctx);
    }
    let wide_in: Vec<Option<Vec<f32>>> = ins.iter().enumerate().map(|(k, i)| i.filter(|i| data_read(k, i)).map(|i| widen(&i))).collect();
    let views: Vec<Option<In>> = ins
        .iter()
        .zip(&wide_in)
        .map(|(i, w)| match (i, w) {
            // SAFETY: `w` holds numel(shape) f32 values and outlives the kernel call.
            (Some(i), Some(w)) => Some(unsafe { In::from_raw(DType::F32, i.shape, w.as_ptr() as *const u8) }),
            (i, _) => *i,
        })
        .collect();
    // a widened output starts from what its memory holds: kernels planned in place (an output
    // sharing an input's memory, or accumulating into it) read it
    let mut wide_out: Vec<Option<Vec<f32>>> = outs.iter_mut().map(|o| o.dtype.is_half().then(|| widen(&o.as_input()))).collect();
    {
        let mut out_views: Vec<Out> = outs
            .iter_mut()
            .zip(wide_out.iter_mut())
            .map(|(o, w)| match w {
                // SAFETY: `w` holds numel(shape) f32 values, borrowed uniquely by this view.
                Some(w) => unsafe { Out::from_raw(DType::F32, o.shape, w.as_mut_ptr() as *mut u8) },
                None => o.reborrow(),
            })
            .collect();
        kernel(node, &views, &mut out_views, ctx)?;
    }
    for (o, w) in outs.iter_mut().zip(&wide_out) {
        if let Some(w) = w {
            narrow(w, o)?;
        }
    }
    Ok(())
}

/// A 16-bit float view's values as f32.
fn widen(v: &In) -> Vec<f32> {
    let mut out = vec![0f32; v.numel()];
    match v.dtype {
        DType::BF16 => v.slice::<half::bf16>().unwrap_or(&[]).convert_to_f32_slice(&mut out),
        DType::F16 => v.slice::<half::f16>().unwrap_or(&[]).convert_to_f32_slice(&mut out),
        _ => {}
    }
    out
}

/// Rounds `w` to nearest even into the 16-bit output `o`.
fn narrow(w: &[f32], o: &mut Out) -> Result<()> {
    match o.dtype {
        DType::BF16 => o.slice::<half::bf16>()?.convert_from_f32_slice(w),
        DType::F16 => o.slice::<half::f16>()?.convert_from_f32_slice(w),
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{DType, Data, Tensor};

    fn bf16(shape: Vec<usize>, v: &[f32]) -> Tensor {
        Tensor::new(shape, Data::BF16(v.iter().map(|&x| half::bf16::from_f32(x)).collect())).unwrap()
    }

    #[test]
    fn casts_round_to_nearest_even_and_widen_exactly() {
        // 1 + 2^-8 is halfway between two bf16 neighbours: ties go to the even one (1.0);
        // 1 + 3·2^-9 rounds up to 1 + 2^-7
        let x = Tensor::from_f32(vec![4], vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 512.0, -2.5, 65504.0 * 2.0]);
        let to = |d: DType| Attrs::default().with("to", Attr::Int(d.onnx_code() as i64));
        let b = run("Cast", to(DType::BF16), &[&x]).remove(0);
        assert_eq!(b.to_f64_vec(), vec![1.0, 1.0 + 1.0 / 128.0, -2.5, 131072.0]);
        let h = run("Cast", to(DType::F16), &[&x]).remove(0);
        assert_eq!(h.dtype(), DType::F16);
        assert_eq!(&h.to_f64_vec()[..3], &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 512.0, -2.5]);
        assert!(h.to_f64_vec()[3].is_infinite(), "past fp16's range");
        let back = run("Cast", to(DType::F32), &[&b]).remove(0);
        assert_eq!(back.dtype(), DType::F32);
        assert_eq!(back.to_f64_vec(), b.to_f64_vec());
        let i = run("Cast", to(DType::I64), &[&b]).remove(0);
        assert_eq!(i.to_i64_vec().unwrap(), vec![1, 1, -2, 131072]);
    }

    #[test]
    fn a_kernel_on_bf16_computes_in_f32_and_rounds_once() {
        // 1 + (2^-8 + 2^-9): in bf16 arithmetic per step the sum would lose the small term
        let a = bf16(vec![2], &[1.0, 3.0]);
        let b = bf16(vec![2], &[1.0 / 256.0 + 1.0 / 512.0, 0.5]);
        let y = run("Add", Attrs::default(), &[&a, &b]).remove(0);
        assert_eq!(y.dtype(), DType::BF16);
        assert_eq!(y.to_f64_vec(), vec![1.0 + 1.0 / 128.0, 3.5]);
        let s = run("Softmax", Attrs::default().with("axis", Attr::Int(-1)), &[&a]).remove(0);
        assert_eq!(s.dtype(), DType::BF16);
        let want = [1.0 / (1.0 + 2f32.exp()), 2f32.exp() / (1.0 + 2f32.exp())];
        for (got, w) in s.to_f64_vec().iter().zip(want) {
            assert_eq!(*got as f32, half::bf16::from_f32(w).to_f32());
        }
    }
}
