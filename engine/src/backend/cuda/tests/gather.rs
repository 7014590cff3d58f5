//! Parity of kernels/gather.cu with the CPU backend (backend/cpu/movement.rs: Gather,
//! GatherElements and their gradients), negative indices included, and the error flag: set by an
//! out-of-range index (whose output is 0 and whose gradient is dropped), untouched otherwise, and
//! optional (a null flag). The CPU kernels fail on an out-of-range index, so the reference for
//! those cases is the CPU result on the indices with the bad ones replaced by 0, with the
//! affected outputs zeroed (forward) or their dy zeroed (gradients). Forward kernels only move
//! bits (CPU reference on I64 tensors, exact); GatherGrad sums in the CPU's order (exact too),
//! GatherElementsGrad with float atomics in any order.

use super::support::*;
use crate::backend::cpu::testutil::run as cpu;
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::loader::Loaded;
use crate::backend::cuda::ops::{kernel, DView};
use crate::backend::cuda::registry::{self, types};
use crate::ir::{Attr, Attrs, Node};
use crate::tensor::DType;

// ---- argument lists: built here for the GPU tests and for the registry check below ----------

/// gather_W(x, idx, y, n, dim, n_idx, inner, err).
#[allow(clippy::too_many_arguments)]
fn gather_args(x: u64, idx: u64, y: u64, n: i64, dim: i64, n_idx: i64, inner: i64, err: u64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(idx), KArg::Ptr(y), KArg::I64(n), KArg::I64(dim), KArg::I64(n_idx), KArg::I64(inner), KArg::Ptr(err)]
}
/// gather_elements_W(x, idx, y, s, n, axis, dim, err) and gather_elements_grad_T(dy, idx, dx, ...).
#[allow(clippy::too_many_arguments)]
fn gather_elements_args(x: u64, idx: u64, y: u64, s: Strides, n: i64, axis: i32, dim: i64, err: u64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(idx), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n), KArg::I32(axis), KArg::I64(dim), KArg::Ptr(err)]
}

/// gather_nd_W(x, idx, y, s, n, slice, tuples, batch_block, err) and gather_nd_grad_T(dy, idx, dx, ...).
#[allow(clippy::too_many_arguments)]
fn gather_nd_args(x: u64, idx: u64, y: u64, s: Strides, n: i64, slice: i64, tuples: i64, batch_block: i64, err: u64) -> Vec<KArg> {
    let i = KArg::I64;
    vec![KArg::Ptr(x), KArg::Ptr(idx), KArg::Ptr(y), KArg::Strides(s), i(n), i(slice), i(tuples), i(batch_block), KArg::Ptr(err)]
}

fn args_of(op: &str) -> Vec<KArg> {
    match op {
        "gather_nd" | "gather_nd_grad" => gather_nd_args(1, 2, 3, Strides::default(), 4, 5, 6, 7, 8),
        "gather" => gather_args(1, 2, 3, 4, 5, 6, 7, 8),
        "gather_grad_keys" => vec![KArg::Ptr(1), KArg::Ptr(2), KArg::Ptr(3), KArg::I64(4), KArg::I64(5), KArg::Ptr(6)],
        "gather_grad_small" => {
            vec![KArg::Ptr(1), KArg::Ptr(2), KArg::Ptr(3), KArg::I64(4), KArg::I64(5), KArg::I64(6), KArg::I64(7), KArg::Ptr(8)]
        }
        "gather_grad_rows" => {
            vec![
                KArg::Ptr(1),
                KArg::Ptr(2),
                KArg::Ptr(3),
                KArg::Ptr(4),
                KArg::Ptr(5),
                KArg::I64(6),
                KArg::I64(7),
                KArg::I64(8),
                KArg::I64(9),
            ]
        }
        "gather_grad_runs" => vec![KArg::Ptr(1), KArg::Ptr(2), KArg::Ptr(3), KArg::I64(4), KArg::I64(5), KArg::I64(6), KArg::I64(7)],
        "gather_elements" | "gather_elements_grad" => gather_elements_args(1, 2, 3, Strides::default(), 4, 0, 5, 6),
        _ => panic!("gather: no test launches {op}"),
    }
}

/// Every kernel of the family has an argument list in the tests, and it matches the registry.
#[test]
fn gather_test_argument_lists_match_the_registry() {
    check_family_args("gather", args_of);
}

/// Asserts the i32 error flag holds `want` (dry run: its size).
fn check_flag(g: Target, what: &str, err: &Buf, want: i32) {
    g.same(&format!("{what}: the error flag"), "i32", err, &encode("i32", &[want as f64]));
}

/// Random indices in [-dim, dim), and the same with some made out of range (dim, -dim - 1,
/// far off), with the positions made bad.
fn indices(rng: &mut Rng, n: usize, dim: usize) -> (Vec<i64>, Vec<i64>, Vec<bool>) {
    let d = dim as i64;
    let good: Vec<i64> = (0..n).map(|_| rng.int(-d, d)).collect();
    let mut bad_idx = good.clone();
    let mut bad = vec![false; n];
    for (j, v) in [(0, d), (n / 2, -d - 1), (n - 1, 1 << 40)] {
        bad_idx[j] = v;
        bad[j] = true;
    }
    (good, bad_idx, bad)
}

/// `bad_idx` with the bad indices replaced by 0 (what the CPU reference can take).
fn sanitized(bad_idx: &[i64], bad: &[bool]) -> Vec<i64> {
    bad_idx.iter().zip(bad).map(|(&v, &b)| if b { 0 } else { v }).collect()
}

/// The index in [0, dim), or None (kernels/gather.cu `checked_index`).
fn checked(id: i64, dim: usize) -> Option<usize> {
    let id = if id < 0 { id + dim as i64 } else { id };
    (0..dim as i64).contains(&id).then_some(id as usize)
}

/// gather_W on the host (kernels/gather.cu `gather_src`), from the kernel's arguments.
fn emulate_gather(x: &[i64], idx: &[i64], n: usize, dim: usize, n_idx: usize, inner: usize) -> Vec<i64> {
    (0..n)
        .map(|e| {
            let (k, t) = (e % inner, e / inner);
            let (j, outer) = (t % n_idx, t / n_idx);
            checked(idx[j], dim).map_or(0, |id| x[(outer * dim + id) * inner + k])
        })
        .collect()
}

/// gather_elements_W on the host (kernels/gather.cu `elements_src`), from the kernel's arguments.
fn emulate_elements(x: &[i64], idx: &[i64], s: &Strides, n: usize, axis: usize, dim: usize) -> Vec<i64> {
    (0..n)
        .map(|p| {
            let Some(id) = checked(idx[p], dim) else { return 0 };
            let (mut off, mut rest) = (0i64, p as i64);
            for d in (0..s.rank as usize).rev() {
                let (q, c) = (rest / s.dims[d], rest % s.dims[d]);
                rest = q;
                off += if d == axis { id as i64 } else { c } * s.stride[0][d];
            }
            x[off as usize]
        })
        .collect()
}

/// Gather cases: (x shape, axis, index shape).
const GATHERS: &[(&[usize], usize, &[usize])] =
    &[(&[3, 7, 4], 1, &[2, 5]), (&[50, 8], 0, &[3, 6]), (&[5, 6], 1, &[4]), (&[9, 3], 0, &[]), (&[2, 3, 4], 2, &[7])];

/// (outer, dim, inner) of a Gather of x on `axis`.
fn geometry(x: &[usize], axis: usize) -> (usize, usize, usize) {
    (numel(&x[..axis]), x[axis], numel(&x[axis + 1..]))
}

#[test]
fn gpu_gather_matches_cpu_and_flags_bad_indices() {
    let g = Target::of("gpu_gather_matches_cpu_and_flags_bad_indices");
    let mut rng = Rng::new(21);
    for &w in types::WIDTHS {
        let k = registry::kernel_name("gather", w);
        for (case, &(xs, axis, is)) in GATHERS.iter().enumerate() {
            let (outer, dim, inner) = geometry(xs, axis);
            let n_idx = numel(is);
            let n = outer * n_idx * inner;
            let (xv, xb) = random_bits(&mut rng, w, numel(xs));
            let dx = g.up(&xb);
            let attrs = Attrs::default().with("axis", Attr::Int(axis as i64));
            let what = format!("{k} case {case}: x {xs:?} axis {axis} indices {is:?}");
            let (good, bad_idx, bad) = indices(&mut rng, n_idx.max(3), dim);
            let (good, bad_idx, bad) = (&good[..n_idx], &bad_idx[..n_idx], &bad[..n_idx]);
            // valid (negative included): equal to the CPU, flag untouched
            let (di, dy, err) = (g.up(&narrow("u64", good)), g.zeros(n * size_of(w)), g.zeros(4));
            g.run(
                &k,
                Grid::elementwise(n as i64, 2),
                &gather_args(dx.ptr(), di.ptr(), dy.ptr(), n as i64, dim as i64, n_idx as i64, inner as i64, err.ptr()),
            );
            let want =
                cpu("Gather", attrs.clone(), &[&i64_tensor(xs, xv.clone()), &i64_tensor(is, good.to_vec())])[0].to_i64_vec().expect("i64");
            assert_eq!(emulate_gather(&xv, good, n, dim, n_idx, inner), want, "{what}: the host emulation of the arguments");
            g.same(&what, w, &dy, &narrow(w, &want));
            check_flag(g, &what, &err, 0);
            // out of range (dim, -dim - 1, 2^40; only the first when there is one index): 0 out, flag set
            let mut want = cpu("Gather", attrs.clone(), &[&i64_tensor(xs, xv.clone()), &i64_tensor(is, sanitized(bad_idx, bad))])[0]
                .to_i64_vec()
                .expect("i64");
            for (e, v) in want.iter_mut().enumerate() {
                if bad[(e / inner) % n_idx] {
                    *v = 0;
                }
            }
            let what = format!("{what}, indices {bad_idx:?}");
            assert_eq!(emulate_gather(&xv, bad_idx, n, dim, n_idx, inner), want, "{what}: the host emulation of the arguments");
            let di = g.up(&narrow("u64", bad_idx));
            for with_flag in [true, false] {
                let (dy, err) = (g.zeros(n * size_of(w)), g.zeros(4));
                let ep = if with_flag { err.ptr() } else { 0 };
                g.run(
                    &k,
                    Grid::elementwise(n as i64, 2),
                    &gather_args(dx.ptr(), di.ptr(), dy.ptr(), n as i64, dim as i64, n_idx as i64, inner as i64, ep),
                );
                g.same(&format!("{what} (flag {})", if with_flag { "given" } else { "null" }), w, &dy, &narrow(w, &want));
                if with_flag {
                    check_flag(g, &what, &err, 1);
                }
            }
        }
    }
}

/// GatherGrad through its dispatcher (ops/gather.rs: the indices radix-sorted, each row's
/// repeats summed in position order) on `dy` (values of type `t`) and indices `idx` shaped
/// `is` into x shaped `xs` on `axis`: (dx's bytes, the error flag).
fn gather_grad_on_gpu(g: &'static Loaded, t: &str, (xs, axis, is): (&[usize], usize, &[usize]), dy: &[f64], idx: &[i64]) -> (Vec<u8>, i32) {
    let dy_shape: &[usize] = &xs[..axis].iter().chain(is).chain(&xs[axis + 1..]).copied().collect::<Vec<_>>();
    let (ddy, di, ddx, err) =
        (dev(g, &encode(t, dy)), dev(g, &narrow("u64", idx)), zeros::<u8>(g, numel(xs) * size_of(t)), zeros::<i32>(g, 1));
    let dtype = match t {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => cpu_dtype(t),
    };
    let ins = [
        Some(DView { dtype, shape: dy_shape, ptr: ddy.ptr(), host: None }),
        Some(DView { dtype: DType::I64, shape: is, ptr: di.ptr(), host: None }),
    ];
    let outs = [DView { dtype, shape: xs, ptr: ddx.ptr(), host: None }];
    let node = Node {
        name: "embedding/grad".into(),
        op_type: "GatherGrad".into(),
        inputs: vec![],
        outputs: vec![],
        attrs: Attrs::default().with("axis", Attr::Int(axis as i64)),
    };
    let (mut ctx, _claim) = direct_ctx(F32Mode::Exact, err.ptr());
    kernel("GatherGrad").expect("GatherGrad")(&node, &ins, &outs, &mut ctx).unwrap_or_else(|e| panic!("GatherGrad: {e}"));
    g.synchronize().expect("sync");
    (host::<u8>(&ddx), host::<i32>(&err)[0])
}

/// GatherGrad on the GPU gives the CPU's bits in every float type (the same rows summed in the
/// same order from 0, so the same step every run): the Gather cases above, indices negative and
/// out of range (dropped, flag set; up to 32 indices, gather_grad_small), an embedding of 70000
/// rows (three sort passes) with 3000 indices (three tiles), one of them repeated 1500 times and
/// two others 64 and 33 times (summed in segments of 32), into rows of 40 (two column groups,
/// the second partial), and 80 indices on axis 1 of [3, 50, 5] (sorted, three outer slices,
/// one index 40 times).
#[test]
fn gpu_gather_grad_matches_cpu_bit_for_bit_and_flags_bad_indices() {
    let Some(g) = gpu("gpu_gather_grad_matches_cpu_bit_for_bit_and_flags_bad_indices") else { return };
    let mut rng = Rng::new(22);
    let embedding: (&[usize], usize, &[usize]) = (&[70000, 40], 0, &[30, 100]);
    // past gather_grad_small's 32 indices: sorted, with outer slices and rows of 5
    let sorted: (&[usize], usize, &[usize]) = (&[3, 50, 5], 1, &[80]);
    for &t in types::FLOATS {
        for (case, &(xs, axis, is)) in GATHERS.iter().chain([&embedding, &sorted]).enumerate() {
            let (outer, dim, inner) = geometry(xs, axis);
            let n_idx = numel(is);
            let dy_shape: Vec<usize> = xs[..axis].iter().chain(is).chain(&xs[axis + 1..]).copied().collect();
            let dy = rand_as(&mut rng, t, outer * n_idx * inner, -1.0, 1.0);
            let (mut good, bad_idx, bad) = indices(&mut rng, n_idx.max(3), dim);
            if n_idx > 32 {
                // a padding-like token: a run of half the indices (1500 spread over the tiles,
                // summed in 47 segments of 32; 40 in each of 3 outer slices); beside it in
                // sorted order runs of 64 (two whole segments) and 33 (a segment and a row),
                // their segments' partials side by side
                for (j, id) in good.iter_mut().enumerate().take(n_idx) {
                    match j {
                        _ if j % 2 == 0 => *id = 7,
                        _ if n_idx < 1000 => {}
                        _ if j < 128 => *id = 8,
                        _ if j < 128 + 66 => *id = 6 - dim as i64,
                        _ => {}
                    }
                }
            }
            let (good, bad_idx, bad) = (&good[..n_idx], &bad_idx[..n_idx], &bad[..n_idx]);
            for (idx, flagged) in [(good, false), (bad_idx, true)] {
                let what = format!("GatherGrad {t} case {case}: x {xs:?} axis {axis} indices {is:?}, out of range: {flagged}");
                // the reference drops the rows of bad indices
                let ref_dy: Vec<f64> =
                    dy.iter().enumerate().map(|(e, &v)| if flagged && bad[(e / inner) % n_idx] { 0.0 } else { v }).collect();
                let cpu_idx = if flagged { sanitized(idx, bad) } else { idx.to_vec() };
                let want = cpu(
                    "GatherGrad",
                    Attrs::default().with("axis", Attr::Int(axis as i64)),
                    &[&cpu_tensor(t, &dy_shape, &encode(t, &ref_dy)), &i64_tensor(is, cpu_idx), &shape_tensor(xs)],
                );
                let (got, flag) = gather_grad_on_gpu(g, t, (xs, axis, is), &dy, idx);
                assert_same(&what, t, &got, &cpu_bytes(t, &want[0]));
                assert_eq!(flag, flagged as i32, "{what}: the error flag");
            }
        }
    }
}

/// GatherElements cases: (x shape, index shape, axis); the index tensor is smaller than x off
/// the axis and may be larger on it.
const ELEMENTS: &[(&[usize], &[usize], usize)] = &[
    (&[4, 5, 6], &[4, 3, 6], 1),
    (&[4, 5, 6], &[3, 2, 6], 0),
    (&[4, 5, 6], &[2, 5, 9], 2),
    (&[7], &[12], 0),
    (&[3, 1, 2, 2, 1, 2, 2, 3], &[2, 1, 2, 1, 1, 2, 2, 5], 7),
];

/// `Strides` of GatherElements: the index tensor's shape, and the contiguous strides of x as
/// operand 0 (base 0).
fn elements_strides(xs: &[usize], is: &[usize]) -> Strides {
    let mut s = bcast(is, &[]);
    s.stride[0][..xs.len()].copy_from_slice(&contiguous(xs));
    s
}

#[test]
fn gpu_gather_elements_matches_cpu_and_flags_bad_indices() {
    let g = Target::of("gpu_gather_elements_matches_cpu_and_flags_bad_indices");
    let mut rng = Rng::new(23);
    for &w in types::WIDTHS {
        let k = registry::kernel_name("gather_elements", w);
        for (case, &(xs, is, axis)) in ELEMENTS.iter().enumerate() {
            let (n, dim) = (numel(is), xs[axis]);
            let s = elements_strides(xs, is);
            let (xv, xb) = random_bits(&mut rng, w, numel(xs));
            let dx = g.up(&xb);
            let attrs = Attrs::default().with("axis", Attr::Int(axis as i64));
            let (good, bad_idx, bad) = indices(&mut rng, n, dim);
            for (idx, flagged) in [(&good, false), (&bad_idx, true)] {
                let what = format!(
                    "{k} case {case}: x {xs:?} indices {is:?} axis {axis}{}",
                    if flagged { " with bad indices at 0, n/2, n-1" } else { "" }
                );
                let (di, dy, err) = (g.up(&narrow("u64", idx)), g.zeros(n * size_of(w)), g.zeros(4));
                g.run(
                    &k,
                    Grid::elementwise(n as i64, 2),
                    &gather_elements_args(dx.ptr(), di.ptr(), dy.ptr(), s, n as i64, axis as i32, dim as i64, err.ptr()),
                );
                let cpu_idx = if flagged { sanitized(idx, &bad) } else { idx.clone() };
                let mut want = cpu("GatherElements", attrs.clone(), &[&i64_tensor(xs, xv.clone()), &i64_tensor(is, cpu_idx)])[0]
                    .to_i64_vec()
                    .expect("i64");
                if flagged {
                    want.iter_mut().zip(&bad).filter(|(_, &b)| b).for_each(|(v, _)| *v = 0);
                }
                assert_eq!(emulate_elements(&xv, idx, &s, n, axis, dim), want, "{what}: the host emulation of the arguments");
                g.same(&what, w, &dy, &narrow(w, &want));
                check_flag(g, &what, &err, flagged as i32);
            }
        }
    }
}

#[test]
fn gpu_gather_elements_grad_matches_cpu_and_flags_bad_indices() {
    let g = Target::of("gpu_gather_elements_grad_matches_cpu_and_flags_bad_indices");
    let mut rng = Rng::new(24);
    for &t in types::FLOATS_F32_F64 {
        let k = registry::kernel_name("gather_elements_grad", t);
        for (case, &(xs, is, axis)) in ELEMENTS.iter().enumerate() {
            let (n, dim) = (numel(is), xs[axis]);
            let s = elements_strides(xs, is);
            let dyv: Vec<f64> = rng.f32s(n, -1.0, 1.0).into_iter().map(f64::from).collect();
            let dyb = encode(t, &dyv);
            let attrs = Attrs::default().with("axis", Attr::Int(axis as i64));
            let (good, bad_idx, bad) = indices(&mut rng, n, dim);
            for (idx, flagged) in [(&good, false), (&bad_idx, true)] {
                let what = format!(
                    "{k} case {case}: x {xs:?} indices {is:?} axis {axis}{}",
                    if flagged { " with bad indices at 0, n/2, n-1" } else { "" }
                );
                // the device gets all of dy; the reference drops the elements of bad indices
                let ref_dy: Vec<f64> = dyv.iter().zip(&bad).map(|(&v, &b)| if flagged && b { 0.0 } else { v }).collect();
                let (ddy, di, ddx, err) = (g.up(&dyb), g.up(&narrow("u64", idx)), g.zeros(numel(xs) * size_of(t)), g.zeros(4));
                g.run(
                    &k,
                    Grid::elementwise(n as i64, 2),
                    &gather_elements_args(ddy.ptr(), di.ptr(), ddx.ptr(), s, n as i64, axis as i32, dim as i64, err.ptr()),
                );
                let cpu_idx = if flagged { sanitized(idx, &bad) } else { idx.clone() };
                let want = cpu(
                    "GatherElementsGrad",
                    attrs.clone(),
                    &[&cpu_tensor(t, is, &encode(t, &ref_dy)), &i64_tensor(is, cpu_idx), &shape_tensor(xs)],
                );
                g.close(&what, t, &ddx, &cpu_bytes(t, &want[0]), if t == "f32" { 1e-6 } else { 1e-14 });
                check_flag(g, &what, &err, flagged as i32);
            }
        }
    }
}
