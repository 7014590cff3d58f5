//! The fused attention in layout BSHD (passes/attention_layout.rs): CUDA sessions of the test
//! models read Q, K, V and write O with the heads inside the rows (no Transpose left in their
//! plans), and on a GPU the kernels in that layout give exactly what they give on the same
//! tensors transposed to BHSD: the same arithmetic, only the addressing differs.

use super::exec::session;
use super::exec_models::self_attention_of;
use super::flash_attention::flash_blocks;
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::loader::Loaded;
use crate::backend::cuda::ops::{kernel, CudaCtx, DView};
use crate::ir::{Attr, Attrs, Node};
use crate::ops::attention::permuted_offsets;
use crate::tensor::DType;

/// CUDA sessions of the self-attention models (both exporter forms, heads of 4 and 64) fuse
/// into one BSHD Attention whose train plan has no Transpose at all: Q, K, V come from the
/// projections' reshapes, O goes to the output's reshape, and so do their gradients.
#[test]
fn cuda_attention_reads_the_projections_layout() {
    let mut rng = Rng::new(43);
    for (torchlib, hd) in [(true, 4), (false, 4), (true, 64), (false, 64)] {
        let m = self_attention_of(&mut rng, torchlib, 70, hd);
        let s = session(&m);
        let case = format!("torchlib={torchlib}, heads of {hd}");
        let attention = s.graph.nodes.iter().find(|n| n.op_type == "Attention").unwrap_or_else(|| panic!("{case}: no Attention"));
        assert_eq!(attention.attrs.string("layout", "").expect("layout"), "BSHD", "{case}");
        let plan = s.plan(&[m.sig()], true).expect("plan");
        let ops: Vec<&str> = plan.steps.iter().map(|n| s.graph.nodes[n.0].op_type.as_str()).collect();
        assert!(!ops.contains(&"Transpose"), "{case}: {ops:?}");
        assert!(ops.contains(&"AttentionGrad"), "{case}: {ops:?}");
    }
}

/// `x` of shape `shape` with its axes permuted (axis j of the result is axis perm[j] of x).
fn permute(x: &[f64], shape: [usize; 4], perm: [usize; 4]) -> Vec<f64> {
    permuted_offsets(shape, perm).into_iter().map(|at| x[at]).collect()
}

fn node(op: &str, layout: Option<&str>) -> Node {
    let mut attrs = Attrs::default().with("scale", Attr::Float(0.125)).with("nan_guard", Attr::Int(1));
    if let Some(l) = layout {
        attrs = attrs.with("layout", Attr::String(l.into()));
    }
    Node { name: format!("{op}_{}", layout.unwrap_or("BHSD")), op_type: op.into(), inputs: vec![], outputs: vec![], attrs }
}

/// Attention and AttentionGrad on B = 2, H = 3, T = 70 queries (a partial last tile) over S = 70
/// keys (self-attention) and S = 45 (cross-attention), a mask hiding keys past each query's
/// index: in layout BSHD, on the same tensors transposed to BHSD, and in BHSD_K (BHSD with K
/// [B, H, S, D] untransposed, passes/attention_keys.rs); outputs and gradients equal bit for bit
/// once transposed back. The SIMT kernels (f32, heads of 24) and the tensor-core ones (heads of
/// 64: f32 tensors with bf16 products, and bf16 tensors).
#[test]
fn gpu_attention_in_layout_bshd_is_bhsd_transposed() {
    let Some(g) = gpu("gpu_attention_in_layout_bshd_is_bhsd_transposed") else { return };
    let mut rng = Rng::new(47);
    let (b, h, t) = (2usize, 3usize, 70usize);
    for s_len in [70usize, 45] {
        let mask: Vec<f64> = (0..t * s_len).map(|i| if i % s_len > i / s_len { f64::NEG_INFINITY } else { 0.0 }).collect();
        let mask_shape = [1, 1, t, s_len];
        let dmask = dev_as(g, "f32", &mask);
        for (dt, d, mode) in [("f32", 24, F32Mode::Exact), ("f32", 64, F32Mode::Bf16), ("bf16", 64, F32Mode::Bf16)] {
            let case = format!("{dt}, heads of {d}, {mode:?}, {t} queries over {s_len} keys");
            let dtype = if dt == "bf16" { DType::BF16 } else { DType::F32 };
            let (rows, keys) = ([b, t, h, d], [b, s_len, h, d]);
            let mut rand = |n: usize| rand_as(&mut rng, dt, n, -1.0, 1.0);
            let (q, k, v, dout) = (rand(b * t * h * d), rand(b * s_len * h * d), rand(b * s_len * h * d), rand(b * t * h * d));
            let (bhtd, kt_shape, bhsd) = ([b, h, t, d], [b, h, d, s_len], [b, h, s_len, d]);
            let heads_out = [0, 2, 1, 3];
            let (qb, ktb, vb, doutb) = (
                permute(&q, rows, heads_out),
                permute(&k, keys, [0, 2, 3, 1]),
                permute(&v, keys, heads_out),
                permute(&dout, rows, heads_out),
            );
            let kb = permute(&k, keys, heads_out);
            let (mut ctx, _claim) = direct_ctx(mode, 0);
            let mut results = Vec::new();
            // (layout, Q, Kt or K, V, dO, and their shapes)
            for (layout, ins, shapes) in [
                (Some("BSHD"), [&q, &k, &v, &dout], [rows, keys, keys, rows]),
                (None, [&qb, &ktb, &vb, &doutb], [bhtd, kt_shape, bhsd, bhtd]),
                (Some("BHSD_K"), [&qb, &kb, &vb, &doutb], [bhtd, bhsd, bhsd, bhtd]),
            ] {
                let bufs: Vec<_> = ins.iter().map(|x| dev_as(g, dt, x)).collect();
                let view = |i: usize| Some(DView { dtype, shape: &shapes[i], ptr: bufs[i].ptr(), host: None });
                let m = Some(DView { dtype: DType::F32, shape: &mask_shape, ptr: dmask.ptr(), host: None });
                let (o, lse) = (zeros_as(g, dt, b * t * h * d), zeros_as(g, "f32", b * h * t));
                let lse_shape = [b, h, t];
                let o_view = DView { dtype, shape: &shapes[0], ptr: o.ptr(), host: None };
                let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
                let fwd = kernel("Attention").expect("Attention");
                fwd(&node("Attention", layout), &[view(0), view(1), view(2), m], &[o_view, lse_view], &mut ctx)
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                let grads: Vec<_> = (0..3).map(|i| zeros_as(g, dt, ins[i].len())).collect();
                let gouts: Vec<DView> = (0..3).map(|i| DView { dtype, shape: &shapes[i], ptr: grads[i].ptr(), host: None }).collect();
                let bwd = kernel("AttentionGrad").expect("AttentionGrad");
                let bins = [view(3), view(0), view(1), view(2), m, Some(o_view), Some(lse_view)];
                bwd(&node("AttentionGrad", layout), &bins, &gouts, &mut ctx).unwrap_or_else(|e| panic!("{case}: {e}"));
                g.synchronize().expect("sync");
                let mut got = vec![host_as(&o, dt), host_as(&lse, "f32")];
                got.extend(grads.iter().map(|x| host_as(x, dt)));
                results.push(got);
            }
            let (s, p, u) = (&results[0], &results[1], &results[2]);
            for i in [0, 1, 2, 4] {
                assert_eq!(u[i], p[i], "{case}: BHSD_K's output {i}, BHSD's");
            }
            assert_eq!(u[3], permute(&p[3], kt_shape, [0, 1, 3, 2]), "{case}: BHSD_K's dK, BHSD's dKt transposed");
            assert_eq!(s[0], permute(&p[0], bhtd, heads_out), "{case}: O");
            assert_eq!(s[1], p[1], "{case}: LSE");
            assert_eq!(s[2], permute(&p[2], bhtd, heads_out), "{case}: dQ");
            assert_eq!(s[3], permute(&p[3], kt_shape, [0, 3, 1, 2]), "{case}: dK");
            assert_eq!(s[4], permute(&p[4], bhsd, heads_out), "{case}: dV");
            assert!(s[2].iter().any(|&x| x != 0.0) && s[4].iter().any(|&x| x != 0.0), "{case}: gradients computed");
            assert!(s[0].iter().all(|x| x.is_finite()), "{case}: O finite");
        }
    }
}

/// One Attention + AttentionGrad on `node`'s layout; `qkv` the input tensors (one for BS3HD),
/// `shapes` theirs, `o_shape` O's; returns [O, LSE, then every gradient output].
#[allow(clippy::too_many_arguments)]
fn run_both(
    g: &Loaded,
    ctx: &mut CudaCtx,
    node_of: impl Fn(&str) -> Node,
    dt: &str,
    qkv: &[&Vec<f64>],
    shapes: &[[usize; 4]],
    dout: &[f64],
    o_shape: [usize; 4],
    lse_len: usize,
) -> Vec<Vec<f64>> {
    let dtype = if dt == "bf16" {
        DType::BF16
    } else if dt == "f16" {
        DType::F16
    } else {
        DType::F32
    };
    let bufs: Vec<_> = qkv.iter().map(|x| dev_as(g, dt, x)).collect();
    let packed_shape: Vec<usize> = vec![shapes[0][0], shapes[0][1], 3 * shapes[0][2] * shapes[0][3]];
    let shape_of = |i: usize| if qkv.len() == 1 { &packed_shape[..] } else { &shapes[i][..] };
    let view = |i: usize| Some(DView { dtype, shape: shape_of(i), ptr: bufs[i.min(bufs.len() - 1)].ptr(), host: None });
    let (o, lse) = (zeros_as(g, dt, dout.len()), zeros_as(g, "f32", lse_len));
    let lse_shape = [o_shape[0], o_shape[2], o_shape[1]];
    let o_view = DView { dtype, shape: &o_shape, ptr: o.ptr(), host: None };
    let lse_view = DView { dtype: DType::F32, shape: &lse_shape, ptr: lse.ptr(), host: None };
    let d_out = dev_as(g, dt, dout);
    let fwd = kernel("Attention").expect("Attention");
    fwd(&node_of("Attention"), &[view(0), view(1), view(2), None], &[o_view, lse_view], ctx).expect("attention");
    let grads: Vec<_> = qkv.iter().map(|x| zeros_as(g, dt, x.len())).collect();
    let gouts: Vec<DView> = (0..qkv.len()).map(|i| DView { dtype, shape: shape_of(i), ptr: grads[i].ptr(), host: None }).collect();
    let bwd = kernel("AttentionGrad").expect("AttentionGrad");
    let dview = Some(DView { dtype, shape: &o_shape, ptr: d_out.ptr(), host: None });
    bwd(&node_of("AttentionGrad"), &[dview, view(0), view(1), view(2), None, Some(o_view), Some(lse_view)], &gouts, ctx)
        .expect("attention grad");
    g.synchronize().expect("sync");
    let mut got = vec![host_as(&o, dt), host_as(&lse, "f32")];
    got.extend(grads.iter().map(|x| host_as(x, dt)));
    got
}

/// Layout BS3HD (passes/attention_packed_qkv.rs): Q, K and V read from one [B, T, 3·H·D]
/// tensor, dQ, dK and dV written into one, give bit for bit what layout BSHD gives on the three
/// parts, for every kernel family: the SIMT f32 kernels (heads of 24), fp16 through them
/// (widened), the tensor-core kernels (f32 at bf16 precision, heads of 64), and the
/// FlashAttention-2-style kernels (bf16, heads of 64, 80, 96 and 128; f16, heads of 32 and 64).
#[test]
fn gpu_attention_in_layout_bs3hd_is_bshd_on_the_parts() {
    let Some(g) = gpu("gpu_attention_in_layout_bs3hd_is_bshd_on_the_parts") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(53);
    let (b, h, t) = (2usize, 3usize, 70usize);
    for (dt, d, mode) in [
        ("f32", 24, F32Mode::Exact),
        ("f16", 24, F32Mode::Exact),
        ("f32", 64, F32Mode::Bf16),
        ("bf16", 64, F32Mode::Bf16),
        ("bf16", 128, F32Mode::Bf16),
        ("f16", 64, F32Mode::F16),
        ("f16", 32, F32Mode::F16),
        ("bf16", 80, F32Mode::Bf16),
        ("bf16", 96, F32Mode::Bf16),
    ] {
        let case = format!("{dt}, heads of {d}, {mode:?}");
        let hd = h * d;
        let part = |rng: &mut Rng| rand_as(rng, dt, b * t * hd, -1.0, 1.0);
        let (q, k, v, dout) = (part(&mut rng), part(&mut rng), part(&mut rng), part(&mut rng));
        // X's row (b, t): Q's row, K's, V's
        let x: Vec<f64> =
            (0..b * t).flat_map(|r| [&q, &k, &v].into_iter().flat_map(move |p| p[r * hd..(r + 1) * hd].iter().copied())).collect();
        let (mut ctx, _claim) = direct_ctx(mode, 0);
        let rows = [b, t, h, d];
        let bshd = |op: &str| node(op, Some("BSHD"));
        let bs3hd = |op: &str| {
            let mut n = node(op, Some("BS3HD"));
            n.attrs.set("heads", Attr::Int(h as i64));
            n
        };
        let parts = run_both(g, &mut ctx, bshd, dt, &[&q, &k, &v], &[rows; 3], &dout, rows, b * h * t);
        let packed = run_both(g, &mut ctx, bs3hd, dt, &[&x], &[rows], &dout, rows, b * h * t);
        assert_eq!(packed[0], parts[0], "{case}: O");
        assert_eq!(packed[1], parts[1], "{case}: LSE");
        let dx = &packed[2];
        for (i, what) in ["dQ", "dK", "dV"].into_iter().enumerate() {
            let got: Vec<f64> = (0..b * t).flat_map(|r| dx[(3 * r + i) * hd..(3 * r + i + 1) * hd].iter().copied()).collect();
            assert_eq!(got, parts[2 + i], "{case}: {what}");
        }
        assert!(dx.iter().any(|&x| x != 0.0) && packed[0].iter().all(|x| x.is_finite()), "{case}: computed");
        if dt != "f32" && d != 24 {
            let (v, blocks) = flash_blocks(d);
            let k = format!("attention_flash_bwd_dkv_{v}{}_{dt}", blocks[0].1);
            assert!(rt.has_launched(&k), "{case}: {k} never launched");
        }
    }
}
