//! Parity of kernels/movement.cu with the CPU backend (backend/cpu/movement.rs): copy_W as
//! Transpose, Expand, Slice (negative steps), SliceGrad (fill then copy), Concat and ConcatGrad,
//! fill_W and trilu_W, for every width, and copy_u8 over an index space above 2^31 elements.
//! The kernels only move bits: the CPU reference runs the op on I64 tensors of the same values
//! and its result is truncated to the width; the match is exact.

use super::support::*;
use crate::backend::cpu::testutil::run as cpu;
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::{self, types};
use crate::ir::{Attr, Attrs, Node};
use crate::ops::InferIn;
use crate::tensor::Tensor;

// ---- argument lists: built here for the GPU tests and for the registry check below ----------

/// copy_W(x, y, s, n): operand 0 of `s` addresses x (the source), operand 1 y.
fn copy_args(x: u64, y: u64, s: Strides, n: i64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n)]
}
fn fill_args(y: u64, n: i64, bits: u64) -> Vec<KArg> {
    vec![KArg::Ptr(y), KArg::I64(n), KArg::U64(bits)]
}
#[allow(clippy::too_many_arguments)]
fn trilu_args(x: u64, y: u64, n: i64, rows: i64, cols: i64, upper: i32, k: i64, k_at: u64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(n), KArg::I64(rows), KArg::I64(cols), KArg::I32(upper), KArg::I64(k), KArg::Ptr(k_at)]
}

fn args_of(op: &str) -> Vec<KArg> {
    match op {
        "copy" => copy_args(1, 2, Strides::default(), 3),
        "fill" => fill_args(1, 2, 3),
        "trilu" => trilu_args(1, 2, 3, 4, 5, 1, -1, 6),
        _ => panic!("movement: no test launches {op}"),
    }
}

/// Every kernel of the family has an argument list in the tests, and it matches the registry.
#[test]
fn movement_test_argument_lists_match_the_registry() {
    check_family_args("movement", args_of);
}

/// `Strides` over `dims` with operand 0 (the source) and operand 1 (the destination) given as
/// (element strides, base offset).
fn copy_strides(dims: &[usize], src: (&[i64], i64), dst: (&[i64], i64)) -> Strides {
    let mut s = bcast(dims, &[]);
    for (k, (st, base)) in [src, dst].into_iter().enumerate() {
        assert_eq!(st.len(), dims.len());
        s.stride[k][..st.len()].copy_from_slice(st);
        s.base[k] = base;
    }
    s
}

/// copy_W on the host: `init` with y[offset 1] = x[offset 0] over the index space.
fn emulate_copy(x: &[i64], init: &[i64], s: &Strides, n: usize) -> Vec<i64> {
    let mut y = init.to_vec();
    for i in 0..n as i64 {
        let o = offsets(s, i);
        y[o[1] as usize] = x[o[0] as usize];
    }
    y
}

/// Runs copy_W over `dims` from `src` (I64 values, truncated to the width on the device) into a
/// destination of `out_elems` elements first holding `init`, and compares with `want`.
#[allow(clippy::too_many_arguments)]
fn check_copy(g: Target, w: &str, what: &str, x: &[i64], init: &[i64], s: Strides, n: usize, want: &[i64]) {
    let k = registry::kernel_name("copy", w);
    if g.is_dry() {
        assert_eq!(narrow(w, &emulate_copy(x, init, &s, n)), narrow(w, want), "{k} {what}: the host emulation of the Strides");
    }
    let (dx, dy) = (g.up(&narrow(w, x)), g.up(&narrow(w, init)));
    g.run(&k, Grid::elementwise(n as i64, 3), &copy_args(dx.ptr(), dy.ptr(), s, n as i64));
    g.same(&format!("{k} {what}"), w, &dy, &narrow(w, want));
}

#[test]
fn gpu_copy_as_transpose_expand_concat_and_plain_copy_match_cpu() {
    let g = Target::of("gpu_copy_as_transpose_expand_concat_and_plain_copy_match_cpu");
    let mut rng = Rng::new(11);
    for &w in types::WIDTHS {
        // Transpose: source strides permuted, destination contiguous (ranks 4 and 8)
        for (shape, perm) in [(&[3usize, 4, 5, 6][..], &[2usize, 0, 3, 1][..]), (&[2, 3, 2, 2, 3, 2, 2, 2], &[7, 6, 5, 4, 3, 2, 1, 0])] {
            let (xv, _) = random_bits(&mut rng, w, numel(shape));
            let out: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            let xs = contiguous(shape);
            let src: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
            let s = copy_strides(&out, (&src, 0), (&contiguous(&out), 0));
            let attrs = Attrs::default().with("perm", Attr::Ints(perm.iter().map(|&p| p as i64).collect()));
            let want = cpu("Transpose", attrs, &[&i64_tensor(shape, xv.clone())])[0].to_i64_vec().expect("i64");
            check_copy(g, w, &format!("as Transpose {shape:?} perm {perm:?}"), &xv, &vec![0; numel(&out)], s, numel(&out), &want);
        }
        // Expand: source strides 0 on the broadcast dimensions (ranks 4 and 8)
        for (shape, out) in [(&[3usize, 1, 5][..], &[2usize, 3, 4, 5][..]), (&[1, 2, 1, 3, 1, 2, 1, 2], &[2, 2, 3, 3, 2, 2, 2, 2])] {
            let (xv, _) = random_bits(&mut rng, w, numel(shape));
            let s = bcast(out, &[shape, out]);
            let want = cpu("Expand", Attrs::default(), &[&i64_tensor(shape, xv.clone()), &shape_tensor(out)])[0].to_i64_vec().expect("i64");
            check_copy(g, w, &format!("as Expand {shape:?} to {out:?}"), &xv, &vec![0; numel(out)], s, numel(out), &want);
        }
        // Concat on axis 1: one launch per input, destination strides of the output with the
        // base at the input's offset along the axis; ConcatGrad: the reverse
        let parts: [&[usize]; 3] = [&[2, 3, 4], &[2, 5, 4], &[2, 1, 4]];
        let out = [2usize, 9, 4];
        let os = contiguous(&out);
        let xs: Vec<Vec<i64>> = parts.iter().map(|p| random_bits(&mut rng, w, numel(p)).0).collect();
        let tensors: Vec<Tensor> = parts.iter().zip(&xs).map(|(p, v)| i64_tensor(p, v.clone())).collect();
        let want =
            cpu("Concat", Attrs::default().with("axis", Attr::Int(1)), &tensors.iter().collect::<Vec<_>>())[0].to_i64_vec().expect("i64");
        let k = registry::kernel_name("copy", w);
        let dy = g.zeros(numel(&out) * size_of(w));
        let mut at = 0i64;
        let mut bufs = Vec::new();
        let mut emulated = vec![0i64; numel(&out)];
        for (p, v) in parts.iter().zip(&xs) {
            let dx = g.up(&narrow(w, v));
            let s = copy_strides(p, (&contiguous(p), 0), (&os, at * os[1]));
            emulated = emulate_copy(v, &emulated, &s, numel(p));
            g.run(&k, Grid::elementwise(numel(p) as i64, 2), &copy_args(dx.ptr(), dy.ptr(), s, numel(p) as i64));
            at += p[1] as i64;
            bufs.push(dx);
        }
        assert_eq!(emulated, want, "{k} as Concat: the host emulation of the Strides");
        g.same(&format!("{k} as Concat of {parts:?} on axis 1"), w, &dy, &narrow(w, &want));
        let shapes: Vec<Tensor> = parts.iter().map(|p| shape_tensor(p)).collect();
        let dy_t = i64_tensor(&out, want.clone());
        let mut at = 0i64;
        for (i, p) in parts.iter().enumerate() {
            let mut ins = vec![&dy_t];
            ins.extend(shapes.iter());
            let attrs = Attrs::default().with("axis", Attr::Int(1)).with("index", Attr::Int(i as i64));
            let want_i = cpu("ConcatGrad", attrs, &ins)[0].to_i64_vec().expect("i64");
            let s = copy_strides(p, (&os, at * os[1]), (&contiguous(p), 0));
            check_copy(g, w, &format!("as ConcatGrad/Split part {i} {p:?} of {out:?}"), &want, &vec![0; numel(p)], s, numel(p), &want_i);
            at += p[1] as i64;
        }
        // a plain rank-1 copy, many grid-stride rounds; and one into a destination with a base
        let n = 100_003usize;
        let (xv, _) = random_bits(&mut rng, w, n);
        let s = copy_strides(&[n], (&[1], 0), (&[1], 0));
        check_copy(g, w, "rank 1 contiguous", &xv, &vec![0; n], s, n, &xv);
        let mut want = vec![0i64; n + 7];
        want[7..].copy_from_slice(&xv);
        let s = copy_strides(&[n], (&[1], 0), (&[1], 7));
        check_copy(g, w, "rank 1 into base 7", &xv, &vec![0; n + 7], s, n, &want);
    }
}

/// (start, step, count) per axis of a Slice, from the same shape rule the CPU kernel uses.
fn slice_params(shape: &[usize], starts: &Tensor, ends: &Tensor, axes: &Tensor, steps: &Tensor) -> Vec<(i64, i64, usize)> {
    let node = Node { name: "t".into(), op_type: "Slice".into(), inputs: vec![], outputs: vec![], attrs: Attrs::default() };
    fn inf(t: &Tensor) -> InferIn<'_> {
        InferIn { dtype: t.dtype(), shape: &t.shape, value: Some(t) }
    }
    let infer: Vec<Option<InferIn>> = vec![None, Some(inf(starts)), Some(inf(ends)), Some(inf(axes)), Some(inf(steps))];
    crate::ops::movement_slice_params(&node, &infer, shape).unwrap_or_else(|e| panic!("{e}"))
}

/// Slice cases: (x shape, starts, ends, axes, steps), negative steps and starts included.
type SliceCase = (&'static [usize], &'static [i64], &'static [i64], &'static [i64], &'static [i64]);
const SLICES: &[SliceCase] = &[
    (&[7, 9, 5], &[5, 1, -1], &[-100, 8, -100], &[0, 1, 2], &[-2, 3, -1]),
    (&[6, 10], &[-2], &[1], &[1], &[-3]),
    (&[4, 6, 8], &[1, 7], &[100, 0], &[0, -1], &[1, -2]),
];

#[test]
fn gpu_copy_as_slice_and_slice_grad_match_cpu() {
    let g = Target::of("gpu_copy_as_slice_and_slice_grad_match_cpu");
    let mut rng = Rng::new(12);
    for &w in types::WIDTHS {
        let k = registry::kernel_name("copy", w);
        for (case, &(shape, starts, ends, axes, steps)) in SLICES.iter().enumerate() {
            let t = |v: &[i64]| Tensor::from_i64(vec![v.len()], v.to_vec());
            let (st, en, ax, sp) = (t(starts), t(ends), t(axes), t(steps));
            let p = slice_params(shape, &st, &en, &ax, &sp);
            let counts: Vec<usize> = p.iter().map(|q| q.2).collect();
            let n = numel(&counts);
            let xs = contiguous(shape);
            // source strides times the steps, base at the starts
            let src: Vec<i64> = p.iter().zip(&xs).map(|(q, s)| q.1 * s).collect();
            let base: i64 = p.iter().zip(&xs).map(|(q, s)| q.0 * s).sum();
            let what = format!("case {case}: Slice of {shape:?} starts {starts:?} ends {ends:?} axes {axes:?} steps {steps:?}");
            let (xv, _) = random_bits(&mut rng, w, numel(shape));
            let want = cpu("Slice", Attrs::default(), &[&i64_tensor(shape, xv.clone()), &st, &en, &ax, &sp]);
            assert_eq!(want[0].shape, counts, "{what}: CPU output shape");
            let want = want[0].to_i64_vec().expect("i64");
            check_copy(
                g,
                w,
                &format!("as {what}"),
                &xv,
                &vec![0; n],
                copy_strides(&counts, (&src, base), (&contiguous(&counts), 0)),
                n,
                &want,
            );

            // SliceGrad: fill_W 0 over a destination holding garbage, then copy_W of dy into
            // the sliced positions
            let (dyv, _) = random_bits(&mut rng, w, n);
            let (_, garbage) = random_bits(&mut rng, w, numel(shape));
            let (ddy, dx) = (g.up(&narrow(w, &dyv)), g.up(&garbage));
            let kf = registry::kernel_name("fill", w);
            g.run(&kf, Grid::elementwise(numel(shape) as i64, 2), &fill_args(dx.ptr(), numel(shape) as i64, 0));
            let s = copy_strides(&counts, (&contiguous(&counts), 0), (&src, base));
            g.run(&k, Grid::elementwise(n as i64, 2), &copy_args(ddy.ptr(), dx.ptr(), s, n as i64));
            let want = cpu("SliceGrad", Attrs::default(), &[&i64_tensor(&counts, dyv.clone()), &shape_tensor(shape), &st, &en, &ax, &sp]);
            let emulated = emulate_copy(&dyv, &vec![0; numel(shape)], &s, n);
            assert_eq!(emulated, want[0].to_i64_vec().expect("i64"), "{k} as SliceGrad, {what}: the host emulation of the Strides");
            g.same(&format!("{kf} + {k} as SliceGrad, {what}"), w, &dx, &narrow(w, &want[0].to_i64_vec().expect("i64")));
        }
    }
}

#[test]
fn gpu_fill_and_trilu_match_cpu() {
    let g = Target::of("gpu_fill_and_trilu_match_cpu");
    let mut rng = Rng::new(13);
    for &w in types::WIDTHS {
        // fill: the low bits of `bits` everywhere, over a buffer holding garbage
        let k = registry::kernel_name("fill", w);
        let n = 10_007usize;
        let bits = 0x0123_4567_89AB_CDEFu64;
        let dy = g.up(&random_bits(&mut rng, w, n).1);
        g.run(&k, Grid::elementwise(n as i64, 3), &fill_args(dy.ptr(), n as i64, bits));
        g.same(&format!("{k} bits {bits:#x}"), w, &dy, &narrow(w, &vec![bits as i64; n]));

        // trilu: batches of matrices, wide, tall and square, both triangles, k on both sides,
        // passed by value and read from device memory (k_at: the by-value k is then ignored)
        let k = registry::kernel_name("trilu", w);
        for shape in [&[3usize, 5, 7][..], &[2, 8, 3], &[6, 6]] {
            let n = numel(shape);
            let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let (xv, xb) = random_bits(&mut rng, w, n);
            let dx = g.up(&xb);
            for upper in [1, 0] {
                for kk in [-10i64, -2, -1, 0, 1, 3, 10] {
                    let attrs = Attrs::default().with("upper", Attr::Int(upper as i64));
                    let want = cpu("Trilu", attrs, &[&i64_tensor(shape, xv.clone()), &Tensor::from_i64(vec![], vec![kk])]);
                    let want = narrow(w, &want[0].to_i64_vec().expect("i64"));
                    let k_dev = g.up(&kk.to_le_bytes());
                    for (by, k_val, k_at) in [("value", kk, 0), ("device", 99 - kk, k_dev.ptr())] {
                        let dy = g.zeros(n * size_of(w));
                        let args = trilu_args(dx.ptr(), dy.ptr(), n as i64, rows as i64, cols as i64, upper, k_val, k_at);
                        g.run(&k, Grid::elementwise(n as i64, 1), &args);
                        g.same(&format!("{k} {shape:?} upper {upper} k {kk} by {by}"), w, &dy, &want);
                    }
                }
            }
        }
    }
}

/// The 64-bit index paths in one launch: copy_u8 over a [2, 2^30 + 3] index space (2^31 + 6
/// elements) read interleaved and reversed (source strides -1 and -2 from a base of 2^31 + 5:
/// negative strides, offsets past 2^31, the division path) into a contiguous [2, 2^30 + 3],
/// the byte after it untouched. About 4.3 GB of device memory and as much host memory.
#[test]
fn gpu_copy_u8_above_2_31_elements() {
    let Some(g) = gpu("gpu_copy_u8_above_2_31_elements") else { return };
    let m: usize = (1 << 30) + 3;
    let n = 2 * m;
    let pattern = |i: usize| (i % 251) as u8;
    let dx = dev(g, &(0..=n).map(pattern).collect::<Vec<u8>>());
    let dy = zeros::<u8>(g, n + 1);
    // element (r, c): source n - 1 - (2c + r), destination r·m + c
    let s = copy_strides(&[2, m], (&[-1, -2], n as i64 - 1), (&[m as i64, 1], 0));
    // on cuda-emu one thread walks every element (the index math is what every thread does):
    // it runs each thread's grid-stride loop to its end before the next thread's, so 8192 x 256
    // threads would each stride through all 4 GB, a cache and TLB miss an element (100 s a
    // copy); on a GPU one thread would take half an hour
    let grid = if emulated() { Grid::new(1, 1) } else { Grid::new(8192, 256) };
    run(g, "copy_u8", grid, &copy_args(dx.ptr(), dy.ptr(), s, n as i64));
    let y = host::<u8>(&dy);
    for r in 0..2 {
        if let Some(c) = (0..m).find(|&c| y[r * m + c] != pattern(n - 1 - 2 * c - r)) {
            panic!(
                "copy_u8 of [2, {m}] interleaved and reversed: element [{r}, {c}] (offset {}): got {}, expected {}",
                r * m + c,
                y[r * m + c],
                pattern(n - 1 - 2 * c - r)
            );
        }
    }
    assert_eq!(y[n], 0, "copy_u8 wrote past its index space");
}

/// copy over byte buffers: `size` bytes per element of `s`'s index space.
fn emulate_bytes(s: &Strides, n: usize, size: usize, src: &[u8], dst: &mut [u8]) {
    for i in 0..n as i64 {
        let o = offsets(s, i);
        let (a, b) = (o[0] as usize * size, o[1] as usize * size);
        dst[b..b + size].copy_from_slice(&src[a..a + size]);
    }
}

/// Copies the dispatchers make of 16-byte vectors (ops/movement.rs `vector_copy`, `copy_v16`):
/// attention's head transpose ([2, 5, 3, 64] to [2, 3, 5, 64] and back), a Concat part at an
/// offset and an Expand, in every element width, write copy_W's bytes; a destination 8 bytes
/// off 16 stays an element copy.
#[test]
fn gpu_vector_copies_write_the_bytes_of_element_copies() {
    let g = Target::of("gpu_vector_copies_write_the_bytes_of_element_copies");
    let mut rng = Rng::new(29);
    let heads = |x: [usize; 4]| {
        let (out, xs) = ([x[0], x[2], x[1], x[3]], contiguous(&x));
        (copy_strides(&out, (&[xs[0], xs[2], xs[1], xs[3]], 0), (&contiguous(&out), 0)), numel(&x), numel(&out))
    };
    let part = copy_strides(&[2, 3, 32], (&contiguous(&[2, 3, 32]), 0), (&contiguous(&[2, 8, 32]), 3 * 32));
    let cases = [
        ("heads [2, 5, 3, 64] to [2, 3, 5, 64]", heads([2, 5, 3, 64])),
        ("heads back", heads([2, 3, 5, 64])),
        ("Concat part [2, 3, 32] at 3 of [2, 8, 32]", (part, 2 * 3 * 32, 2 * 8 * 32)),
        ("Expand [48] to [3, 48]", (copy_strides(&[3, 48], (&[0, 1], 0), (&[48, 1], 0)), 48, 3 * 48)),
    ];
    for &w in types::WIDTHS {
        let es = size_of(w);
        for (what, (s, src_elems, dst_elems)) in &cases {
            let n: usize = (0..s.rank as usize).map(|d| s.dims[d] as usize).product();
            let (_, xb) = random_bits(&mut rng, w, *src_elems);
            let dx = g.up(&xb);
            let (element, vector) = (g.zeros(dst_elems * es), g.zeros(dst_elems * es));
            let (v, count) = crate::backend::cuda::ops::movement::vector_copy(s, es, dx.ptr(), vector.ptr(), n)
                .unwrap_or_else(|| panic!("{what} in {w}: not a vector copy"));
            assert!(
                crate::backend::cuda::ops::movement::vector_copy(s, es, dx.ptr(), vector.ptr() + 8, n).is_none(),
                "{what} in {w}: a destination 8 bytes off 16 must stay an element copy"
            );
            g.run(&registry::kernel_name("copy", w), Grid::elementwise(n as i64, 4), &copy_args(dx.ptr(), element.ptr(), *s, n as i64));
            g.run("copy_v16", Grid::elementwise(count as i64, 4), &copy_args(dx.ptr(), vector.ptr(), v, count as i64));
            let mut want = vec![0u8; dst_elems * es];
            emulate_bytes(s, n, es, &xb, &mut want);
            let mut wide = vec![0u8; dst_elems * es];
            emulate_bytes(&v, count, 16, &xb, &mut wide);
            assert_eq!(wide, want, "{what} in {w}: the host emulation of the vector copy");
            g.same(&format!("copy_{w} {what}"), "u8", &element, &want);
            g.same(&format!("copy_v16 {what} ({w} elements)"), "u8", &vector, &want);
        }
    }
}
