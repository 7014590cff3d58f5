//! The probabilities' dropout inside the fused attention kernels (kernels/attention.cuh
//! `att_drop`): DropoutKey writes the Philox key a Dropout of its name draws with, and the SIMT,
//! tensor-core, flash and widened kernels' outputs and gradients match an f64 reference that
//! drops exactly what `philox::dropout_keep` drops (the unfused Dropout's mask, which dropout.rs
//! checks bit for bit against the kernels of dropout.cu).

use std::sync::Arc;

use super::attention_reference::{attention_reference, attention_reference_dropped, rel_err, AttnDims};
use super::flash_attention::SCALE;
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::ops::{attention_path, kernel, random_key, salt_of, DView, ENV_FLASH, ENV_FLASH_ROWS};
use crate::backend::cuda::philox::dropout_keep;
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::{DType, Data, Tensor};

const RATIO: f32 = 0.3;
/// Both key words non-zero.
const KEY: u64 = 0x9E37_79B9_7F4A_7C15;

/// The key padding's masked value (Hugging Face's finfo.min).
const PADDING: f32 = f32::MIN;

/// A fused attention node with the dropout attribute: scale 1/8, nan_guard, layout BSHD, and
/// the key padding's value.
fn node(op: &str) -> Node {
    let attrs = Attrs::default()
        .with("scale", Attr::Float(SCALE as f32))
        .with("nan_guard", Attr::Int(1))
        .with("layout", Attr::String("BSHD".into()))
        .with("dropout", Attr::Float(RATIO))
        .with("padding_value", Attr::Float(PADDING));
    Node { name: op.into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs }
}

/// Whether the flash kernels may run (bf16 and f16 heads of 32, 64, 80, 96 and 128), and in which
/// blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Flash {
    Off,
    Rows128,
    Rows64,
}

/// One case: the tensors' type, the session's f32 mode, the sizes, whether causal (T = S),
/// whether with key padding (no mask: the last 7 keys of batch row 0 and 20 of row 1 hidden),
/// the flash setting, and the forward kernel that must have run.
#[derive(Clone, Copy, Debug)]
struct Case {
    dt: &'static str,
    mode: F32Mode,
    n: AttnDims,
    causal: bool,
    padded: bool,
    flash: Flash,
    forward: &'static str,
}

/// The key padding's flags of a case, [b, 1, 1, s] (1: a key the queries see).
fn flags(c: Case) -> Vec<u8> {
    let s = c.n.s;
    (0..c.n.b * s).map(|i| u8::from(i % s < s - if i / s == 0 { 7 } else { 20 })).collect()
}

/// The kernels' O, LSE, dQ, dK, dV with the dropout keyed by `key`, and the forward's path
/// (ops::attention_path).
fn run(c: Case, ins: &[Vec<f64>; 4], key: u64) -> ([Vec<f64>; 5], Option<&'static str>) {
    let g = gpu_or_reason().expect("under gpu()");
    let AttnDims { b, h, t, s, d } = c.n;
    let dt = c.dt;
    let dtype = match dt {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let shapes = [[b, t, h, d], [b, s, h, d], [b, s, h, d], [b, t, h, d]];
    let bufs: Vec<_> = ins.iter().map(|x| dev_as(g, dt, x)).collect();
    let view = |i: usize| Some(DView { dtype, shape: &shapes[i], ptr: bufs[i].ptr(), host: None });
    let mask_values: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    let host = Arc::new(Tensor::new(vec![1, 1, t, t], Data::F32(mask_values.clone())).expect("mask"));
    let dmask = dev(g, &mask_values);
    let mask_shape = [1, 1, t, t];
    let m = c.causal.then(|| DView { dtype: DType::F32, shape: &mask_shape, ptr: dmask.ptr(), host: Some(&host) });
    let dkey = dev(g, &[key as i64]);
    let key_view = Some(DView { dtype: DType::I64, shape: &[1], ptr: dkey.ptr(), host: None });
    let dflags = dev(g, &flags(c));
    let kp_shape = [b, 1, 1, s];
    let kp = c.padded.then(|| DView { dtype: DType::Bool, shape: &kp_shape, ptr: dflags.ptr(), host: None });
    match c.flash {
        Flash::Off => std::env::set_var(ENV_FLASH, "0"),
        Flash::Rows64 => std::env::set_var(ENV_FLASH_ROWS, "64"),
        Flash::Rows128 => {}
    }
    let (mut ctx, _claim) = direct_ctx(c.mode, 0);
    let (o, lse) = (zeros_as(g, dt, b * t * h * d), zeros_as(g, "f32", b * h * t));
    let lse_shape = [b, h, t];
    let o_view = DView { dtype, shape: &shapes[0], ptr: o.ptr(), host: None };
    let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
    let fwd_ins = [view(0), view(1), view(2), m, kp, key_view];
    let forward = node("Attention");
    kernel("Attention").expect("Attention")(&forward, &fwd_ins, &[o_view, lse_view], &mut ctx).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let path = ctx.rt.attention_path(&forward);
    let grads: Vec<_> = (0..3).map(|i| zeros_as(g, dt, ins[i].len())).collect();
    let gouts: Vec<DView> = (0..3).map(|i| DView { dtype, shape: &shapes[i], ptr: grads[i].ptr(), host: None }).collect();
    let bins = [view(3), view(0), view(1), view(2), m, Some(o_view), Some(lse_view), kp, key_view];
    kernel("AttentionGrad").expect("AttentionGrad")(&node("AttentionGrad"), &bins, &gouts, &mut ctx)
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    std::env::remove_var(ENV_FLASH);
    std::env::remove_var(ENV_FLASH_ROWS);
    g.synchronize().expect("sync");
    ([host_as(&o, dt), host_as(&lse, "f32"), host_as(&grads[0], dt), host_as(&grads[1], dt), host_as(&grads[2], dt)], path)
}

/// Causal self-attention over 71 positions and cross-attention of 45 queries over 99 keys (S
/// odd: a Philox counter's words straddle two rows, and in every other row the pairs of
/// adjacent keys the tensor-core and flash kernels draw together straddle two counters), ratio
/// 0.3: f32 on the SIMT kernels (exact session) and on the tensor-core ones (bf16 products);
/// bf16 and f16 tensors on the flash kernels (heads of 64 in blocks of 128 and 64 rows, heads
/// of 32, 96 and 128, key padding without a mask with heads of 64 and 80) and, with them turned
/// off, on the tensor-core kernels; bf16 with heads of 48 (no flash instance) on the SIMT
/// kernels through f32 copies. Every output and gradient is
/// within the kernels' precision of the f64 reference with the Dropout's mask, and that
/// reference is far from the one without dropout (and from another key's), so a kernel that
/// dropped other elements, or none, fails.
#[test]
fn gpu_attention_dropout_drops_what_the_dropout_of_its_key_drops() {
    let Some(_) = gpu_alone("gpu_attention_dropout_drops_what_the_dropout_of_its_key_drops") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(73);
    let dims = |t, s, d| AttnDims { b: 2, h: 2, t, s, d };
    let case = |dt, mode, n, causal, flash, forward| Case { dt, mode, n, causal, padded: false, flash, forward };
    let (self71, cross) = (|d| dims(71, 71, d), |d| dims(45, 99, d));
    use Flash::*;
    let cases = [
        (case("f32", F32Mode::Exact, self71(32), true, Rows128, "attention_fwd_f32"), 2e-5),
        (case("f32", F32Mode::Exact, cross(32), false, Rows128, "attention_fwd_f32"), 2e-5),
        (case("f32", F32Mode::Bf16, self71(64), true, Rows128, "attention_mma_fwd_d64_f32"), 1.5e-2),
        (case("bf16", F32Mode::Bf16, self71(64), true, Off, "attention_mma_fwd_d64_bf16"), 1.5e-2),
        (case("f16", F32Mode::F16, cross(64), false, Off, "attention_mma_fwd_d64_f16"), 3e-3),
        (case("bf16", F32Mode::Bf16, self71(48), true, Rows128, "attention_fwd_f32"), 1.5e-2),
        (case("bf16", F32Mode::Bf16, self71(32), true, Rows128, "attention_flash_fwd_d32r128_dp_bf16"), 1.5e-2),
        (case("f16", F32Mode::F16, cross(96), false, Rows128, "attention_flash_fwd_d96_dp_f16"), 3e-3),
        (case("bf16", F32Mode::Bf16, self71(64), true, Rows128, "attention_flash_fwd_d64r128_dp_bf16"), 1.5e-2),
        (case("bf16", F32Mode::Bf16, self71(64), true, Rows64, "attention_flash_fwd_d64_dp_bf16"), 1.5e-2),
        (case("f16", F32Mode::F16, cross(128), false, Rows128, "attention_flash_fwd_d128_dp_f16"), 3e-3),
        (case("f16", F32Mode::F16, cross(64), false, Rows128, "attention_flash_fwd_d64r128_dp_f16"), 3e-3),
        (
            Case { padded: true, ..case("bf16", F32Mode::Bf16, self71(64), false, Rows128, "attention_flash_fwd_d64r128_kp_dp_bf16") },
            1.5e-2,
        ),
        (Case { padded: true, ..case("bf16", F32Mode::Bf16, self71(80), false, Rows128, "attention_flash_fwd_d80_kp_dp_bf16") }, 1.5e-2),
    ];
    let scale = (1.0f32 / (1.0 - RATIO)) as f64;
    for (c, precision) in cases {
        let AttnDims { b, h, t, s, d } = c.n;
        let ins = [b * t * h * d, b * s * h * d, b * s * h * d, b * t * h * d].map(|n| rand_as(&mut rng, c.dt, n, -1.0, 1.0));
        let refs = [&ins[0][..], &ins[1][..], &ins[2][..], &ins[3][..]];
        let kp = flags(c);
        let mask = |bi: usize, i: usize, j: usize| match () {
            _ if c.causal && j > i => f64::NEG_INFINITY,
            _ if c.padded && kp[bi * s + j] == 0 => PADDING as f64,
            _ => 0.0,
        };
        let dropped = |key: u64| {
            let keep = move |bh: usize, i: usize, j: usize| {
                let flat = ((bh * t + i) * s + j) as u64;
                if dropout_keep(key, 0, flat, RATIO) {
                    scale
                } else {
                    0.0
                }
            };
            attention_reference_dropped(c.n, SCALE, refs, mask, keep)
        };
        let want = dropped(KEY);
        let (plain, other) = (attention_reference(c.n, SCALE, refs, mask), dropped(KEY ^ 1));
        let (got, path) = run(c, &ins, KEY);
        if c.dt != "f32" && c.forward == "attention_fwd_f32" {
            assert_eq!(path, Some(attention_path::WIDENED), "{c:?}");
        }
        let backward = c.forward.replace("_fwd_", "_bwd_dkv_");
        assert!(rt.has_launched(c.forward) && rt.has_launched(&backward), "{c:?}: {} or {backward} never launched", c.forward);
        for (i, name) in ["O", "LSE", "dQ", "dK", "dV"].iter().enumerate() {
            let err = rel_err(&got[i], &want[i]);
            println!("{c:?} {name}: {err:.2e} of the largest value from the f64 reference");
            assert!(err <= precision, "{c:?} {name}: {err:.2e} of the largest value from the f64 reference with the dropout's mask");
            if *name != "LSE" {
                // LSE is the softmax's, the same with or without dropout
                let (off, apart) = (rel_err(&plain[i], &want[i]), rel_err(&other[i], &want[i]));
                assert!(off.min(apart) > 10.0 * precision, "{c:?} {name}: the references differ by only {off:.2e} / {apart:.2e}");
            }
        }
    }
}

/// Every kernel family keeps exactly the elements the Dropout keeps, read off bit by bit: with
/// Q = 0 every score is 0 and every probability 1/S, and with K = V = I (key j's row is the
/// unit vector j, S <= D) an output or gradient element is one probability. O[t, j] is
/// P∘Z[t, j] (the forward's bits); with dO = I, dV[j, t] is P∘Z[t, j] again (the dK/dV kernel's
/// transposed bits); with dO all ones, dP = 1 and dQ[t, j] = scale·P[t, j]·(Z[t, j] − Δ_t) with
/// Δ_t = Σ_j P·Z, positive where kept and negative where dropped (the dQ kernel's bits). S odd:
/// runs start on every word of a counter; 127 keys: two key tiles. A kernel that drew one
/// counter wrong, or shared one lane's bits with another's, fails here, where the tolerances
/// of the test above might let a few wrong elements pass.
#[test]
fn gpu_every_kernel_keeps_exactly_the_dropouts_elements() {
    let Some(_) = gpu_alone("gpu_every_kernel_keeps_exactly_the_dropouts_elements") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let dims = |n, d| AttnDims { b: 2, h: 2, t: n, s: n, d };
    let case = |dt, mode, n, flash, forward| Case { dt, mode, n, causal: false, padded: false, flash, forward };
    use Flash::*;
    let cases = [
        case("f32", F32Mode::Exact, dims(31, 32), Rows128, "attention_fwd_f32"),
        case("f32", F32Mode::Bf16, dims(61, 64), Rows128, "attention_mma_fwd_d64_f32"),
        case("bf16", F32Mode::Bf16, dims(61, 64), Off, "attention_mma_fwd_d64_bf16"),
        case("bf16", F32Mode::Bf16, dims(61, 64), Rows128, "attention_flash_fwd_d64r128_dp_bf16"),
        case("bf16", F32Mode::Bf16, dims(61, 64), Rows64, "attention_flash_fwd_d64_dp_bf16"),
        case("f16", F32Mode::F16, dims(127, 128), Rows128, "attention_flash_fwd_d128_dp_f16"),
        case("bf16", F32Mode::Bf16, dims(31, 32), Rows128, "attention_flash_fwd_d32r128_dp_bf16"),
        case("f16", F32Mode::F16, dims(79, 80), Rows128, "attention_flash_fwd_d80_dp_f16"),
    ];
    for c in cases {
        let AttnDims { b, h, t, s, d } = c.n;
        let at = |bi: usize, i: usize, hi: usize, e: usize| ((bi * t + i) * h + hi) * d + e;
        let unit = |ones: bool| {
            let mut x = vec![0.0; b * t * h * d];
            for (bi, i, hi) in (0..b).flat_map(|bi| (0..t).flat_map(move |i| (0..h).map(move |hi| (bi, i, hi)))) {
                for e in 0..d {
                    x[at(bi, i, hi, e)] = f64::from(u8::from(ones || e == i));
                }
            }
            x
        };
        let (zero, eye, ones) = (vec![0.0; b * t * h * d], unit(false), unit(true));
        let (by_eye, _) = run(c, &[zero.clone(), eye.clone(), eye.clone(), eye.clone()], KEY);
        let (by_ones, _) = run(c, &[zero, eye.clone(), eye.clone(), ones], KEY);
        assert!(rt.has_launched(c.forward), "{c:?}: {} never launched", c.forward);
        let mut wrong = Vec::new();
        for (bi, hi, i, j) in (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..t).flat_map(move |i| (0..s).map(move |j| (bi, hi, i, j)))))
        {
            let keep = dropout_keep(KEY, 0, (((bi * h + hi) * t + i) * s + j) as u64, RATIO);
            let seen = [
                ("O", by_eye[0][at(bi, i, hi, j)] != 0.0),
                ("dV", by_eye[4][at(bi, j, hi, i)] != 0.0),
                ("dQ", by_ones[2][at(bi, i, hi, j)] > 0.0),
            ];
            for (name, kept) in seen {
                if kept != keep {
                    wrong.push(format!("{name} of batch {bi} head {hi} query {i} key {j}: kept {kept}, the Dropout's {keep}"));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "{c:?}: {} elements disagree with the Dropout's mask, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(6)]
        );
    }
}

/// DropoutKey writes `random_key(seed, salt_of(node))`, the key `dropout_T` of a Dropout of the
/// same name draws its mask with: from the step's seed on the host, and from the seed slot a
/// CUDA graph's replay reads (the same key for the same seed).
#[test]
fn gpu_dropout_key_is_the_key_of_the_dropout_it_replaced() {
    let Some(g) = gpu("gpu_dropout_key_is_the_key_of_the_dropout_it_replaced") else { return };
    let node = Node {
        name: "layer.0.attn.dropout".into(),
        op_type: "DropoutKey".into(),
        inputs: vec![],
        outputs: vec![],
        attrs: Attrs::default(),
    };
    let want = random_key(1, salt_of(&node));
    for slot in [None, Some(1u64)] {
        let out = zeros::<i64>(g, 1);
        let seed = slot.map(|s| dev(g, &[s]));
        let (mut ctx, _claim) = direct_ctx(F32Mode::Exact, 0);
        assert_eq!(ctx.seed, 1, "the direct context's step seed");
        ctx.seed_slot = seed.as_ref().map_or(0, |b| b.ptr());
        let outs = [DView { dtype: DType::I64, shape: &[1], ptr: out.ptr(), host: None }];
        kernel("DropoutKey").expect("DropoutKey")(&node, &[], &outs, &mut ctx).expect("DropoutKey");
        g.synchronize().expect("sync");
        assert_eq!(host::<i64>(&out)[0] as u64, want, "seed slot {slot:?}");
    }
}
