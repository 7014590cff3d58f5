//! The FlashAttention-2-style kernels (kernels/attention_flash.cuh): bf16 or f16 Q, K, V in layout
//! BSHD with no mask or the computed causal one. Outputs and gradients against an f64 reference
//! on the same 16-bit inputs, no further from it than the tensor-core kernels they replace
//! (attention_mma.cu, the path `ORTRAIN_FLASH_ATTENTION=0` keeps) and within the type's
//! precision; heads of 64 in both block sizes (128 query rows or keys, and 64 under
//! `ORTRAIN_FLASH_ROWS=64`). Heads of 32, 80 and 96, which the tensor-core kernels do not take,
//! within the type's precision.

use std::sync::Arc;

use super::attention_reference::{attention_reference, rel_err, AttnDims};
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::ops::{kernel, DView, ENV_FLASH, ENV_FLASH_ROWS};
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::{DType, Data, Tensor};

pub(super) const SCALE: f64 = 0.125;

/// Each 16-bit type and the largest error (of the largest value) its kernels may have against
/// the f64 reference on inputs of that type.
pub(super) const PRECISION: [(&str, f64); 2] = [("bf16", 1e-2), ("f16", 1.5e-3)];

/// A fused attention node of this file's tests: scale 1/8, nan_guard, layout BSHD.
pub(super) fn node(op: &str) -> Node {
    let attrs = Attrs::default()
        .with("scale", Attr::Float(SCALE as f32))
        .with("nan_guard", Attr::Int(1))
        .with("layout", Attr::String("BSHD".into()));
    Node { name: op.into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs }
}

/// The flash kernels' instance for heads of `d` ("d64") and the block settings to run them in:
/// (`ORTRAIN_FLASH_ROWS`, the suffix of the kernels that setting launches). Heads of 64 run in
/// blocks of 128 rows and, set to 64, of 64; heads of 32 only in 128; the others only in 64.
pub(super) fn flash_blocks(d: usize) -> (String, &'static [(Option<&'static str>, &'static str)]) {
    let blocks: &[(Option<&str>, &str)] = match d {
        64 => &[(None, "r128"), (Some("64"), "")],
        32 => &[(None, "r128"), (Some("64"), "r128")],
        _ => &[(None, "")],
    };
    (format!("d{d}"), blocks)
}

/// Sizes of one case: batch, heads, queries, keys, head size, and whether causal (T = S).
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    t: usize,
    s: usize,
    d: usize,
    causal: bool,
}

/// O, LSE, dQ, dK, dV in f64 from Q [b, t, h, d], K and V [b, s, h, d], dO [b, t, h, d] (BSHD);
/// LSE [b, h, t].
fn reference(c: Case, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> [Vec<f64>; 5] {
    let Case { b, h, t, s, d, causal } = c;
    attention_reference(AttnDims { b, h, t, s, d }, SCALE, [q, k, v, dout], |_, i, j| if causal && j > i { f64::NEG_INFINITY } else { 0.0 })
}

/// The kernels' O, LSE, dQ, dK, dV for one case on `dt` ("bf16", "f16") tensors (the causal mask
/// as a constant with its host copy).
fn run(c: Case, dt: &str, ins: &[Vec<f64>; 4]) -> [Vec<f64>; 5] {
    let g = gpu_or_reason().expect("under gpu()");
    let Case { b, h, t, s, d, causal } = c;
    let shapes = [[b, t, h, d], [b, s, h, d], [b, s, h, d], [b, t, h, d]];
    let (dtype, mode) = if dt == "f16" { (DType::F16, F32Mode::F16) } else { (DType::BF16, F32Mode::Bf16) };
    let bufs: Vec<_> = ins.iter().map(|x| dev_as(g, dt, x)).collect();
    let view = |i: usize| Some(DView { dtype, shape: &shapes[i], ptr: bufs[i].ptr(), host: None });
    let mask_values: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    let host = Arc::new(Tensor::new(vec![1, 1, t, t], Data::F32(mask_values.clone())).expect("mask"));
    let dmask = dev(g, &mask_values);
    let mask_shape = [1, 1, t, t];
    let m = causal.then(|| DView { dtype: DType::F32, shape: &mask_shape, ptr: dmask.ptr(), host: Some(&host) });
    let (mut ctx, _claim) = direct_ctx(mode, 0);
    let (o, lse) = (zeros_as(g, dt, b * t * h * d), zeros_as(g, "f32", b * h * t));
    let lse_shape = [b, h, t];
    let o_view = DView { dtype, shape: &shapes[0], ptr: o.ptr(), host: None };
    let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
    kernel("Attention").expect("Attention")(&node("Attention"), &[view(0), view(1), view(2), m], &[o_view, lse_view], &mut ctx)
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let grads: Vec<_> = (0..3).map(|i| zeros_as(g, dt, ins[i].len())).collect();
    let gouts: Vec<DView> = (0..3).map(|i| DView { dtype, shape: &shapes[i], ptr: grads[i].ptr(), host: None }).collect();
    let bins = [view(3), view(0), view(1), view(2), m, Some(o_view), Some(lse_view)];
    kernel("AttentionGrad").expect("AttentionGrad")(&node("AttentionGrad"), &bins, &gouts, &mut ctx)
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    g.synchronize().expect("sync");
    [host_as(&o, dt), host_as(&lse, "f32"), host_as(&grads[0], dt), host_as(&grads[1], dt), host_as(&grads[2], dt)]
}

/// One flash run of a case: the tensors' type and its precision bound, the case, the
/// `ORTRAIN_FLASH_ROWS` setting, and [O, LSE, dQ, dK, dV] from the flash kernels, from the
/// kernels `ORTRAIN_FLASH_ATTENTION=0` leaves, and from the f64 reference.
struct FlashRun<'a> {
    dt: &'a str,
    precision: f64,
    c: Case,
    rows: Option<&'a str>,
    flash: &'a [Vec<f64>; 5],
    other: &'a [Vec<f64>; 5],
    want: &'a [Vec<f64>; 5],
}

/// Every case on random bf16 and f16 inputs (drawn from `seed`), its kernels run with the flash
/// kernels off and then on in each block setting of its head size (`flash_blocks`, the
/// setting's kernels asserted launched, their results asserted not the other kernels' bits);
/// `check` gets each flash run.
fn each_flash_run(seed: u64, cases: &[Case], mut check: impl FnMut(&FlashRun)) {
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(seed);
    for (dt, precision) in PRECISION {
        for &c in cases {
            let Case { b, h, t, s, d, .. } = c;
            let ins = [b * t * h * d, b * s * h * d, b * s * h * d, b * t * h * d].map(|n| rand_as(&mut rng, dt, n, -1.0, 1.0));
            let want = reference(c, &ins[0], &ins[1], &ins[2], &ins[3]);
            std::env::set_var(ENV_FLASH, "0");
            let other = run(c, dt, &ins);
            std::env::remove_var(ENV_FLASH);
            let (v, blocks) = flash_blocks(d);
            for &(rows, suffix) in blocks {
                match rows {
                    Some(r) => std::env::set_var(ENV_FLASH_ROWS, r),
                    None => std::env::remove_var(ENV_FLASH_ROWS),
                }
                let flash = run(c, dt, &ins);
                std::env::remove_var(ENV_FLASH_ROWS);
                for k in ["fwd", "bwd_dq", "bwd_dkv"].map(|k| format!("attention_flash_{k}_{v}{suffix}_{dt}")) {
                    assert!(rt.has_launched(&k), "{dt} {c:?} {rows:?}: {k} never launched");
                }
                check(&FlashRun { dt, precision, c, rows, flash: &flash, other: &other, want: &want });
                assert!(flash != other, "{dt} {c:?}: the same bits as the other kernels: did the flash kernels run?");
            }
        }
    }
}

/// Causal self-attention over partial tiles (150 = 2 · 64 + 22) with heads of 64 and 128, full
/// tiles without a mask (three key tiles: the double buffer is refilled), and cross-attention
/// of 100 queries over 45 keys and of 45 over 100, on bf16 and on f16 tensors: every output and
/// gradient at most 1.25 times the tensor-core kernels' distance from the f64 reference, plus
/// 1e-3 of the largest value (bf16 outputs round at 2^-9 = 2e-3 relative), and both within
/// `PRECISION`'s bound for the type (f16 products keep 3 more bits than bf16's: its bound is
/// tighter, so a kernel that rounded an f16 operand through bf16 fails it). Heads of 64 in
/// blocks of 128 query rows or keys (causal 150: the first forward and dQ block's first two warps
/// skip its second key tile, the second block's last warps hold no row; in the first dK/dV
/// block, warps past a query part's last row skip it) and of 64. The flash kernels did run:
/// their names were launched, and their results are not the other kernels' bits.
#[test]
fn gpu_flash_attention_is_as_close_to_f64_as_the_tensor_core_kernels() {
    let Some(_) = gpu_alone("gpu_flash_attention_is_as_close_to_f64_as_the_tensor_core_kernels") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let cases = [
        Case { b: 2, h: 3, t: 150, s: 150, d: 64, causal: true },
        Case { b: 1, h: 2, t: 150, s: 150, d: 128, causal: true },
        Case { b: 1, h: 2, t: 192, s: 192, d: 64, causal: false },
        Case { b: 2, h: 2, t: 100, s: 45, d: 64, causal: false },
        Case { b: 1, h: 2, t: 45, s: 100, d: 64, causal: false },
    ];
    each_flash_run(71, &cases, |r| {
        let FlashRun { dt, precision, c, rows, .. } = *r;
        let v = flash_blocks(c.d).0;
        for k in ["fwd", "bwd_dq", "bwd_dkv"].map(|k| format!("attention_mma_{k}_{v}_{dt}")) {
            assert!(rt.has_launched(&k), "{dt} {c:?}: {k} never launched");
        }
        for (i, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
            let (ef, em) = (rel_err(&r.flash[i], &r.want[i]), rel_err(&r.other[i], &r.want[i]));
            println!("{dt} {c:?} rows {rows:?} {name}: flash {ef:.2e}, tensor-core kernels {em:.2e} of the largest value");
            assert!(
                ef <= 1.25 * em + 1e-3,
                "{dt} {c:?} rows {rows:?} {name}: flash kernels {ef:.2e} from the f64 reference, the tensor-core kernels {em:.2e}"
            );
            assert!(
                ef.max(em) <= precision,
                "{dt} {c:?} rows {rows:?} {name}: flash {ef:.2e}, tensor-core kernels {em:.2e} from the f64 reference, over {dt}'s {precision:e}"
            );
        }
    });
}

/// Heads of 32, 80 and 96, which only the flash kernels and the CUDA-core ones (on f32 copies)
/// take: causal self-attention over partial tiles (150) with heads of 32 and 96, three full key
/// tiles without a mask (192, heads of 96: the double buffer refilled), cross-attention of 100
/// queries over 45 keys with heads of 80, bf16 and f16. Every output and gradient within the
/// type's precision of the f64 reference; the flash kernels of the head size were launched (heads
/// of 32 in blocks of 128 whatever `ORTRAIN_FLASH_ROWS` says), and their results are not the
/// CUDA-core kernels' bits.
#[test]
fn gpu_flash_attention_takes_heads_of_32_80_and_96() {
    let Some(_) = gpu_alone("gpu_flash_attention_takes_heads_of_32_80_and_96") else { return };
    let cases = [
        Case { b: 1, h: 2, t: 150, s: 150, d: 32, causal: true },
        Case { b: 2, h: 1, t: 150, s: 150, d: 96, causal: true },
        Case { b: 1, h: 1, t: 192, s: 192, d: 96, causal: false },
        Case { b: 1, h: 2, t: 100, s: 45, d: 80, causal: false },
    ];
    each_flash_run(79, &cases, |r| {
        let FlashRun { dt, precision, c, rows, .. } = *r;
        for (i, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
            let e = rel_err(&r.flash[i], &r.want[i]);
            println!("{dt} {c:?} rows {rows:?} {name}: flash {e:.2e} of the largest value from the f64 reference");
            assert!(e <= precision, "{dt} {c:?} rows {rows:?} {name}: flash {e:.2e} from the f64 reference, over {dt}'s {precision:e}");
        }
    });
}
