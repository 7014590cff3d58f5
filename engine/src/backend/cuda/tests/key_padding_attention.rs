//! Key padding in the CUDA attention (an attention_mask's flags, ops/attention.rs; made by
//! passes/attention_key_padding.rs): causal self-attention with Hugging Face's finfo.min mask
//! (GPT-2) and self-attention with no mask or one of zeros (BERT), batch rows padded on the left
//! (causal: their first queries see no key: PyTorch gives them equal weights over all keys), on
//! the right, with holes, not at all, and everywhere (no query sees a key). The flash kernels
//! take it on bf16 and f16 tensors; with them turned off, and on f32 tensors, the mask made from
//! the padding is read. Every output and gradient against an f64 reference of the
//! unfused graph's arithmetic (scores plus the mask, softmax, its gradient).

use std::sync::Arc;

use super::attention_reference::{attention_reference, AttnDims};
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::ops::{attention_path, kernel, DView, ENV_FLASH, ENV_FLASH_ROWS};
use crate::ir::{Attr, Node};
use crate::tensor::{DType, Data, Tensor};

use super::flash_attention::{flash_blocks, PRECISION, SCALE};

/// Hugging Face's masked value (finfo(float32).min), in the mask and as the padding's value.
const MIN: f32 = f32::MIN;

/// The flash tests' node, with the padding's value.
fn node(op: &str) -> Node {
    let mut node = super::flash_attention::node(op);
    node.attrs.set("padding_value", Attr::Float(MIN));
    node
}

/// Batch, heads, length (queries = keys), head size.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
}

/// The attention's mask beside the padding: GPT-2's causal finfo.min constant [1, 1, t, t],
/// BERT's once its padding is taken apart (zeros, [1, 1, t, 1]), or none. Constants come with
/// their host copy, as folded ones do.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mask {
    Causal,
    Zeros,
    Absent,
}

/// The flags [b, t] (1: a real key): row 0 padded on the left (70 keys: more than a tile of
/// queries without a visible key), row 1 on the right (the last 50), row 2 with holes (every
/// third key after the first), row 3 not at all, row 4 everywhere.
fn flags(c: Case) -> Vec<u8> {
    let t = c.t;
    (0..c.b * t)
        .map(|i| {
            let (row, j) = (i / t, i % t);
            let real = match row % 5 {
                0 => j >= 70.min(t - 1),
                1 => j < t.saturating_sub(50).max(1),
                2 => j == 0 || j % 3 != 0,
                3 => true,
                _ => false,
            };
            real as u8
        })
        .collect()
}

/// Whether query `i` of batch row `bi` sees no key (causal: no real key at or before it;
/// otherwise no real key at all).
fn no_visible_key(c: Case, mask: Mask, kp: &[u8], bi: usize, i: usize) -> bool {
    let last = if mask == Mask::Causal { i } else { c.t - 1 };
    (0..=last).all(|j| kp[bi * c.t + j] == 0)
}

/// O, LSE, dQ, dK, dV in f64 (BSHD; LSE [b, h, t]) of softmax(scale · Q·Kᵀ + M) with M 0 where
/// the key is real (and, with the causal mask, not past the query) and finfo.min elsewhere.
fn reference(c: Case, mask: Mask, kp: &[u8], q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> [Vec<f64>; 5] {
    let Case { b, h, t, d } = c;
    let causal = mask == Mask::Causal;
    let m = |bi: usize, i: usize, j: usize| if (j <= i || !causal) && kp[bi * t + j] != 0 { 0.0 } else { MIN as f64 };
    attention_reference(AttnDims { b, h, t, s: t, d }, SCALE, [q, k, v, dout], m)
}

/// The dispatchers' O, LSE, dQ, dK, dV and the forward's recorded path, on `dt` tensors ("bf16",
/// "f16", "f32"): Attention(Q, K, V, M, KP) with M as `mask` says and KP the flags [b, 1, 1, t].
fn run(c: Case, mask: Mask, dt: &str, kp: &[u8], ins: &[Vec<f64>; 4]) -> ([Vec<f64>; 5], Option<&'static str>) {
    let g = gpu_or_reason().expect("under gpu()");
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let Case { b, h, t, d } = c;
    let shape = [b, t, h, d];
    let (dtype, mode) = match dt {
        "f16" => (DType::F16, F32Mode::F16),
        "bf16" => (DType::BF16, F32Mode::Bf16),
        _ => (DType::F32, F32Mode::Exact),
    };
    let bufs: Vec<_> = ins.iter().map(|x| dev_as(g, dt, x)).collect();
    let view = |i: usize| Some(DView { dtype, shape: &shape, ptr: bufs[i].ptr(), host: None });
    let (mask_shape, mask_values): (Vec<usize>, Vec<f32>) = match mask {
        Mask::Causal => (vec![1, 1, t, t], (0..t * t).map(|i| if i % t > i / t { MIN } else { 0.0 }).collect()),
        Mask::Zeros | Mask::Absent => (vec![1, 1, t, 1], vec![0.0; t]),
    };
    let host = Arc::new(Tensor::new(mask_shape.clone(), Data::F32(mask_values.clone())).expect("mask"));
    let (dmask, dflags) = (dev(g, &mask_values), dev(g, kp));
    let kp_shape = [b, 1, 1, t];
    let m = (mask != Mask::Absent).then(|| DView { dtype: DType::F32, shape: &mask_shape, ptr: dmask.ptr(), host: Some(&host) });
    let flags = Some(DView { dtype: DType::Bool, shape: &kp_shape, ptr: dflags.ptr(), host: None });
    let (mut ctx, _claim) = direct_ctx(mode, 0);
    let (o, lse) = (zeros_as(g, dt, b * t * h * d), zeros_as(g, "f32", b * h * t));
    let lse_shape = [b, h, t];
    let o_view = DView { dtype, shape: &shape, ptr: o.ptr(), host: None };
    let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
    let forward = node("Attention");
    kernel("Attention").expect("Attention")(&forward, &[view(0), view(1), view(2), m, flags], &[o_view, lse_view], &mut ctx)
        .unwrap_or_else(|e| panic!("{dt} {c:?}: {e}"));
    let grads: Vec<_> = (0..3).map(|i| zeros_as(g, dt, ins[i].len())).collect();
    let gouts: Vec<DView> = (0..3).map(|i| DView { dtype, shape: &shape, ptr: grads[i].ptr(), host: None }).collect();
    let bins = [view(3), view(0), view(1), view(2), m, Some(o_view), Some(lse_view), flags];
    kernel("AttentionGrad").expect("AttentionGrad")(&node("AttentionGrad"), &bins, &gouts, &mut ctx)
        .unwrap_or_else(|e| panic!("{dt} {c:?}: {e}"));
    g.synchronize().expect("sync");
    let outs = [host_as(&o, dt), host_as(&lse, "f32"), host_as(&grads[0], dt), host_as(&grads[1], dt), host_as(&grads[2], dt)];
    (outs, rt.attention_path(&forward))
}

/// Largest error over the largest reference value, among the elements `keep` says.
fn rel_err(got: &[f64], want: &[f64], keep: impl Fn(usize) -> bool) -> f64 {
    let kept: Vec<usize> = (0..want.len()).filter(|&i| keep(i)).collect();
    let err = kept.iter().fold(0.0f64, |m, &i| if got[i].is_finite() { m.max((got[i] - want[i]).abs()) } else { f64::INFINITY });
    err / kept.iter().fold(1e-30f64, |m, &i| m.max(want[i].abs()))
}

/// Checks one run against the reference: O, dQ, dK, dV within `bound` of the largest value,
/// LSE on the rows that see a key (a row without one has finfo.min + ln S, which f32 rounds to
/// finfo.min; the flash kernels keep ln S there for their backward).
fn check(what: &str, c: Case, mask: Mask, kp: &[u8], got: &[Vec<f64>; 5], want: &[Vec<f64>; 5], bound: f64) {
    let Case { h, t, .. } = c;
    let seen = |i: usize| {
        let (bi, qi) = (i / (h * t), i % t);
        !no_visible_key(c, mask, kp, bi, qi)
    };
    for (i, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
        let e = if i == 1 { rel_err(&got[i], &want[i], seen) } else { rel_err(&got[i], &want[i], |_| true) };
        println!("{what} {c:?} {name}: {e:.2e} of the largest value from the f64 reference");
        assert!(e <= bound, "{what} {c:?} {name}: {e:.2e} from the f64 reference, over {bound:e}");
    }
}

/// The flash kernels with key padding and each of `masks` (which give the same scores: one
/// reference), bf16 and f16, on `cases` (each in the blocks `flash_blocks` gives its head size):
/// the path recorded is `want_path`, their `_kp` kernels were launched, and every output
/// and gradient is within the type's precision of the reference, the rows without a visible key
/// included (their gradients counted: dO is not zero there).
fn flash_takes_key_padding(seed: u64, cases: [Case; 2], masks: &[Mask], want_path: &str) {
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(seed);
    for (dt, bound) in PRECISION {
        for c in cases {
            let Case { b, h, t, d } = c;
            let kp = flags(c);
            let ins = [(); 4].map(|_| rand_as(&mut rng, dt, b * t * h * d, -1.0, 1.0));
            let want = reference(c, masks[0], &kp, &ins[0], &ins[1], &ins[2], &ins[3]);
            let (v, blocks) = flash_blocks(d);
            for &(rows, suffix) in blocks {
                for &mask in masks {
                    match rows {
                        Some(r) => std::env::set_var(ENV_FLASH_ROWS, r),
                        None => std::env::remove_var(ENV_FLASH_ROWS),
                    }
                    let (got, path) = run(c, mask, dt, &kp, &ins);
                    std::env::remove_var(ENV_FLASH_ROWS);
                    assert_eq!(path, Some(want_path), "{dt} {c:?} {mask:?} rows {rows:?}");
                    for k in ["fwd", "bwd_dq", "bwd_dkv"].map(|k| format!("attention_flash_{k}_{v}{suffix}_kp_{dt}")) {
                        assert!(rt.has_launched(&k), "{dt} {c:?} {rows:?}: {k} never launched");
                    }
                    check(&format!("flash {dt} {mask:?} rows {rows:?}"), c, mask, &kp, &got, &want, bound);
                }
            }
        }
    }
}

/// GPT-2's attention: the causal finfo.min mask and key padding, the queries before a row's
/// first visible key with equal weights over all 150 keys.
#[test]
fn gpu_flash_attention_takes_key_padding_and_rows_without_a_key() {
    let Some(_) = gpu_alone("gpu_flash_attention_takes_key_padding_and_rows_without_a_key") else { return };
    let cases = [Case { b: 5, h: 2, t: 150, d: 64 }, Case { b: 2, h: 1, t: 150, d: 128 }];
    flash_takes_key_padding(83, cases, &[Mask::Causal], attention_path::FLASH_PADDED);
}

/// The same with heads of 32 (blocks of 128 rows) and 96 (blocks of 64).
#[test]
fn gpu_flash_attention_takes_key_padding_with_heads_of_32_and_96() {
    let Some(_) = gpu_alone("gpu_flash_attention_takes_key_padding_with_heads_of_32_and_96") else { return };
    let cases = [Case { b: 5, h: 1, t: 150, d: 32 }, Case { b: 5, h: 1, t: 150, d: 96 }];
    flash_takes_key_padding(89, cases, &[Mask::Causal], attention_path::FLASH_PADDED);
}

/// Where the flash kernels do not run (turned off: the tensor-core kernels; f32 tensors: the
/// CUDA-core ones), the mask made from the padding is read, with the same results. Their
/// backward gives a row without a visible key S times its gradient (its LSE, finfo.min, cannot
/// hold ln S: doc/GPU-RUNS.md), so dO is zero on those rows here, as where their labels are
/// ignored; the forward's equal weights are checked.
#[test]
fn gpu_attention_without_flash_reads_the_mask_made_from_key_padding() {
    let Some(_) = gpu_alone("gpu_attention_without_flash_reads_the_mask_made_from_key_padding") else { return };
    let mut rng = Rng::new(89);
    let c = Case { b: 5, h: 2, t: 150, d: 64 };
    let Case { b, h, t, d } = c;
    let kp = flags(c);
    for (dt, bound, want_path) in [("bf16", 1e-2, attention_path::PADDED_READ), ("f32", 1e-5, attention_path::SIMT)] {
        let mut ins = [(); 4].map(|_| rand_as(&mut rng, dt, b * t * h * d, -1.0, 1.0));
        for (i, x) in ins[3].iter_mut().enumerate() {
            if no_visible_key(c, Mask::Causal, &kp, i / (t * h * d), (i / (h * d)) % t) {
                *x = 0.0;
            }
        }
        let want = reference(c, Mask::Causal, &kp, &ins[0], &ins[1], &ins[2], &ins[3]);
        std::env::set_var(ENV_FLASH, "0");
        let (got, path) = run(c, Mask::Causal, dt, &kp, &ins);
        std::env::remove_var(ENV_FLASH);
        assert_eq!(path, Some(want_path), "{dt}");
        check(&format!("read mask {dt}"), c, Mask::Causal, &kp, &got, &want, bound);
    }
}

/// BERT's attention: key padding with no mask, or with the mask of zeros its padding leaves
/// ([1, 1, t, 1], a folded constant), every key tile live; a batch entry whose keys are all
/// padding (row 4) gives each of its queries equal weights over all keys, as PyTorch's softmax
/// of all-finfo.min scores does.
#[test]
fn gpu_flash_attention_takes_key_padding_without_a_causal_mask() {
    let Some(_) = gpu_alone("gpu_flash_attention_takes_key_padding_without_a_causal_mask") else { return };
    let cases = [Case { b: 5, h: 2, t: 150, d: 64 }, Case { b: 5, h: 1, t: 100, d: 128 }];
    flash_takes_key_padding(97, cases, &[Mask::Zeros, Mask::Absent], attention_path::FLASH_KEY_PADDING);
}
