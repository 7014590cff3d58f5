//! The tensor-core attention kernels with a causal mask constant (ops/causal_mask.rs): where
//! the mask's host copy is causal the kernels compute the mask instead of reading it, and give
//! the outputs and gradients of the read mask bit for bit, for -inf and finfo.min masks.

use std::sync::Arc;

use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::ops::{attention_path as path, kernel, DView};
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::{DType, Data, Tensor};

fn node(op: &str) -> Node {
    let attrs = Attrs::default().with("scale", Attr::Float(0.125)).with("nan_guard", Attr::Int(1));
    Node { name: op.into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs }
}

/// O, LSE, dQ, dKt, dV of one Attention + AttentionGrad over Q, Kt, V, dO ([b, h, t, 64],
/// [b, h, 64, t], [b, h, t, 64], [b, h, t, 64]) with the mask `dmask` [1, 1, t, t] on the
/// device, its host copy given to the kernels or not; and what the runtime recorded of the
/// forward's kernels (explain()'s line).
fn run(ins: &[Vec<f64>; 4], dt: &str, dims: [usize; 3], dmask: &DeviceBuffer, host: Option<&Arc<Tensor>>) -> (Vec<Vec<f64>>, &'static str) {
    let g = gpu_or_reason().expect("under gpu()");
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let [b, h, t] = dims;
    let d = 64;
    let dtype = if dt == "bf16" { DType::BF16 } else { DType::F32 };
    let shapes = [[b, h, t, d], [b, h, d, t], [b, h, t, d], [b, h, t, d]];
    let mask_shape = [1, 1, t, t];
    let bufs: Vec<_> = ins.iter().map(|x| dev_as(g, dt, x)).collect();
    let view = |i: usize| Some(DView { dtype, shape: &shapes[i], ptr: bufs[i].ptr(), host: None });
    let m = Some(DView { dtype: DType::F32, shape: &mask_shape, ptr: dmask.ptr(), host });
    let (mut ctx, _claim) = direct_ctx(F32Mode::Bf16, 0);
    let (o, lse) = (zeros_as(g, dt, b * h * t * d), zeros_as(g, "f32", b * h * t));
    let lse_shape = [b, h, t];
    let o_view = DView { dtype, shape: &shapes[0], ptr: o.ptr(), host: None };
    let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
    let forward = node("Attention");
    kernel("Attention").expect("Attention")(&forward, &[view(0), view(1), view(2), m], &[o_view, lse_view], &mut ctx)
        .unwrap_or_else(|e| panic!("{e}"));
    let path = rt.attention_path(&forward).expect("the launch was recorded");
    let grads: Vec<_> = (0..3).map(|i| zeros_as(g, dt, ins[i].len())).collect();
    let gouts: Vec<DView> = (0..3).map(|i| DView { dtype, shape: &shapes[i], ptr: grads[i].ptr(), host: None }).collect();
    let bins = [view(3), view(0), view(1), view(2), m, Some(o_view), Some(lse_view)];
    kernel("AttentionGrad").expect("AttentionGrad")(&node("AttentionGrad"), &bins, &gouts, &mut ctx).unwrap_or_else(|e| panic!("{e}"));
    g.synchronize().expect("sync");
    let mut out = vec![host_as(&o, dt), host_as(&lse, "f32")];
    out.extend(grads.iter().map(|x| host_as(x, dt)));
    (out, path)
}

/// 150 queries over 150 keys (three 64-row tiles, the last partial), heads of 64, f32 tensors
/// with bf16 products and bf16 tensors: the causal mask given with its host copy (computed by
/// the kernels) gives what the same mask read from the device gives, bit for bit, for -inf and
/// finfo.min fills; and with the host copy given, the device copy is not read (a device mask
/// of zeros beside a causal host copy still gives the causal results, where read alone it
/// gives others).
#[test]
fn gpu_a_causal_mask_constant_is_computed_and_gives_the_read_masks_results() {
    let Some(g) = gpu("gpu_a_causal_mask_constant_is_computed_and_gives_the_read_masks_results") else { return };
    let mut rng = Rng::new(61);
    let (b, h, t) = (2usize, 3usize, 150usize);
    let n = b * h * t * 64;
    for dt in ["f32", "bf16"] {
        let ins = [(); 4].map(|_| rand_as(&mut rng, dt, n, -1.0, 1.0));
        for fill in [f32::NEG_INFINITY, f32::MIN] {
            let case = format!("{dt}, masked with {fill}");
            let values: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { fill } else { 0.0 }).collect();
            let host = Arc::new(Tensor::new(vec![1, 1, t, t], Data::F32(values.clone())).expect("mask"));
            let dmask = dev(g, &values);
            let (read, read_path) = run(&ins, dt, [b, h, t], &dmask, None);
            let (computed, computed_path) = run(&ins, dt, [b, h, t], &dmask, Some(&host));
            assert_eq!((read_path, computed_path), (path::MMA_READ, path::MMA_CAUSAL), "{case}: what explain() is told");
            let names = ["O", "LSE", "dQ", "dKt", "dV"];
            for (k, name) in names.iter().enumerate() {
                assert_eq!(computed[k], read[k], "{case}: {name}, computed causal mask against the read one");
            }
            assert!(read[2].iter().any(|&x| x != 0.0), "{case}: gradients computed");
            let zeros = dev(g, &vec![0f32; t * t]);
            let (beside_zeros, _) = run(&ins, dt, [b, h, t], &zeros, Some(&host));
            assert_eq!(beside_zeros[0], read[0], "{case}: with the causal host copy the device mask is not read");
            let (unmasked, _) = run(&ins, dt, [b, h, t], &zeros, None);
            assert_ne!(unmasked[0], read[0], "{case}: without a host copy the device mask is read");
        }
    }
}
