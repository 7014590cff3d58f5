//! The work of a Conv-family dispatch as data: the geometry of a convolution and the list of
//! im2col/col2im launches and cuBLAS calls that Conv, ConvGradX and ConvGradW queue (conv.rs
//! runs the list). Kept apart from the launches so that a test can run the same list on the host
//! (a mirror of kernels/conv.cu and of the gemm's row-major contract) against the CPU kernels:
//! the strides, offsets, transposes and chunking are checked without a GPU.
//!
//! Layouts: x [N, C, in_plane], the column matrix [S, C·kk, ohw] per chunk of S samples (a
//! group's rows are one block), W [M, C/group, kk], y [N, M, ohw].
//! - Conv: Y[s, g] = W_g · col[s, g] (one strided-batched gemm per group, W at stride 0), then
//!   the bias as a rank-1 update b · 1ᵀ with beta 1.
//! - ConvGradX: col[s, g] = W_gᵀ · dY[s, g], then col2im into dx.
//! - ConvGradW: P[s, g] = dY[s, g] · col[s, g]ᵀ, then dW (+)= 1ᵀ · P over the chunk's samples
//!   (beta 1 after the first chunk).
//!
//! A 1×1, stride-1, unpadded convolution uses the input (or writes dx) directly.

use crate::backend::cuda::abi::Win2d;
use crate::backend::cuda::blas::{F32Mode, Gemm, GemmType};
use crate::error::Result;
use crate::ir::Node;

/// Bytes of scratch (column matrix and, for ConvGradW, per-sample partial products) per chunk.
pub(super) const COL_BUDGET: usize = 256 << 20;

/// Per-sample geometry of a convolution.
pub(super) struct Geo {
    pub n: usize,
    pub c: usize,
    pub m: usize,
    pub group: usize,
    /// Output channels per group.
    pub mg: usize,
    /// Kernel taps.
    pub kk: usize,
    /// im2col rows per group (channels per group · kk).
    pub rows: usize,
    pub ohw: usize,
    pub in_plane: usize,
    /// 1×1 kernel, stride 1, no padding: the input planes are the column matrix.
    pub direct: bool,
    pub win: Win2d,
}

/// One queued operation.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Call {
    /// `im2col_T` (im2col true) or `col2im_T` from `src` to `dst` over `n` elements.
    Rearrange {
        im2col: bool,
        src: u64,
        dst: u64,
        n: usize,
    },
    Gemm {
        g: Gemm,
        a: u64,
        b: u64,
        c: u64,
    },
}

/// Which op of the family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Forward,
    GradX,
    GradW,
}

impl Geo {
    /// The geometry of input shape `x` and weight shape `w`.
    pub fn new(node: &Node, x: &[usize], w: &[usize]) -> Result<Geo> {
        let (group, win) = crate::ops::conv_geometry_of(node, x, w)?;
        let w2 = win.as_2d();
        let direct = w2.kernel == [1, 1] && w2.strides == [1, 1] && w2.pad_begin == [0, 0] && w2.pad_end == [0, 0];
        let kk = w2.kernel_size();
        Ok(Geo {
            n: x[0],
            c: x[1],
            m: w[0],
            group,
            mg: w[0] / group,
            kk,
            rows: x[1] / group * kk,
            ohw: w2.out_size(),
            in_plane: w2.in_size(),
            direct,
            win: Win2d::new(&win, x[1]),
        })
    }

    /// Elements of one sample's column matrix (all groups), 0 when direct.
    pub fn col_sample(&self) -> usize {
        if self.direct {
            0
        } else {
            self.c * self.kk * self.ohw
        }
    }

    /// Scratch elements per sample for `kind`: the column matrix, and ConvGradW's partials.
    fn scratch_sample(&self, kind: Kind) -> usize {
        self.col_sample() + if kind == Kind::GradW { self.m * self.rows } else { 0 }
    }

    /// Samples per chunk within `budget` bytes of scratch, and the scratch elements it takes.
    pub fn chunking(&self, kind: Kind, es: usize, budget: usize) -> (usize, usize) {
        let per = (budget / (self.scratch_sample(kind) * es).max(1)).clamp(1, self.n.max(1));
        (per, per * self.scratch_sample(kind))
    }

    /// Where group `gi` of the chunk's column matrix starts, and the stride between samples:
    /// in the input chunk at `x0` (direct) or the column matrix at `col`.
    fn source(&self, x0: u64, col: u64, gi: usize, es: usize) -> (u64, usize) {
        let at = (gi * self.rows * self.ohw * es) as u64;
        if self.direct {
            (x0 + at, self.c * self.in_plane)
        } else {
            (col + at, self.col_sample())
        }
    }
}

fn batched(
    t: GemmType,
    mode: F32Mode,
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    batch: usize,
    strides: [usize; 3],
) -> Gemm {
    let mut g = Gemm::contiguous(batch, m, n, k, ta, tb, t);
    g.f32_mode = mode;
    [g.stride_a, g.stride_b, g.stride_c] = strides;
    g
}

/// The operation list of one dispatch. `ops`: Forward (x, w, bias or 0, y), GradX (dy, w, dx),
/// GradW (dy, x, dw); `scratch` holds `chunking(kind, ..).1` elements; `ones` at least `per`
/// (and, for the bias, `ohw`) ones.
#[allow(clippy::too_many_arguments)]
pub(super) fn calls(g: &Geo, kind: Kind, t: GemmType, mode: F32Mode, per: usize, ops: &[u64], scratch: u64, ones: u64) -> Vec<Call> {
    let es = t.size();
    let off = |base: u64, elems: usize| base + (elems * es) as u64;
    let mut v = Vec::new();
    let col = scratch;
    let part = off(scratch, per * g.col_sample());
    for (chunk, s0) in (0..g.n).step_by(per.max(1)).enumerate() {
        let s = per.min(g.n - s0);
        let x_of = |base: u64| off(base, s0 * g.c * g.in_plane);
        let y_of = |base: u64, gi: usize| off(base, (s0 * g.m + gi * g.mg) * g.ohw);
        match kind {
            Kind::Forward => {
                let x0 = x_of(ops[0]);
                if !g.direct {
                    v.push(Call::Rearrange { im2col: true, src: x0, dst: col, n: s * g.col_sample() });
                }
                for gi in 0..g.group {
                    let (src, stride) = g.source(x0, col, gi, es);
                    let gm = batched(t, mode, (g.mg, g.ohw, g.rows), (false, false), s, [0, stride, g.m * g.ohw]);
                    v.push(Call::Gemm { g: gm, a: off(ops[1], gi * g.mg * g.rows), b: src, c: y_of(ops[3], gi) });
                }
            }
            Kind::GradX => {
                let dx0 = x_of(ops[2]);
                for gi in 0..g.group {
                    let (dst, stride) = g.source(dx0, col, gi, es);
                    let gm = batched(t, mode, (g.rows, g.ohw, g.mg), (true, false), s, [0, g.m * g.ohw, stride]);
                    v.push(Call::Gemm { g: gm, a: off(ops[1], gi * g.mg * g.rows), b: y_of(ops[0], gi), c: dst });
                }
                if !g.direct {
                    v.push(Call::Rearrange { im2col: false, src: col, dst: dx0, n: s * g.c * g.in_plane });
                }
            }
            Kind::GradW => {
                let x0 = x_of(ops[1]);
                if !g.direct {
                    v.push(Call::Rearrange { im2col: true, src: x0, dst: col, n: s * g.col_sample() });
                }
                let part_sample = g.m * g.rows;
                for gi in 0..g.group {
                    let (src, stride) = g.source(x0, col, gi, es);
                    let gm = batched(t, mode, (g.mg, g.rows, g.ohw), (false, true), s, [g.m * g.ohw, stride, part_sample]);
                    v.push(Call::Gemm { g: gm, a: y_of(ops[0], gi), b: src, c: off(part, gi * g.mg * g.rows) });
                }
                let mut sum = Gemm::contiguous(1, 1, part_sample, s, false, false, t);
                sum.beta = if chunk == 0 { 0.0 } else { 1.0 };
                v.push(Call::Gemm { g: sum, a: ones, b: part, c: ops[2] });
            }
        }
    }
    if kind == Kind::Forward && ops[2] != 0 && g.n > 0 {
        // Y[s] (m × ohw) += b (m × 1) · 1ᵀ (1 × ohw), every sample
        let mut gm = Gemm::contiguous(g.n, g.m, g.ohw, 1, false, false, t);
        (gm.stride_a, gm.stride_b, gm.beta) = (0, 0, 1.0);
        v.push(Call::Gemm { g: gm, a: ops[2], b: ones, c: ops[3] });
    }
    v
}

#[cfg(test)]
mod tests {
    //! The operation lists run on the host, in f64: a mirror of kernels/conv.cu's im2col/col2im
    //! and the gemm's row-major contract (blas.rs `Gemm`), against the CPU Conv kernels.
    use super::*;
    use crate::backend::cpu::testutil::run;
    use crate::ir::{Attr, Attrs};
    use crate::tensor::{Data, Tensor};

    /// Host buffers at distinct fake device addresses.
    struct Mem(Vec<(u64, Vec<f64>)>);

    impl Mem {
        fn add(&mut self, v: Vec<f64>) -> u64 {
            let base = (self.0.len() as u64 + 1) << 40;
            self.0.push((base, v));
            base
        }
        fn at(&self, addr: u64) -> (usize, usize) {
            let i = ((addr >> 40) - 1) as usize;
            (i, ((addr - self.0[i].0) / 8) as usize)
        }
        fn read(&self, addr: u64, k: usize) -> f64 {
            let (i, o) = self.at(addr);
            self.0[i].1[o + k]
        }
        fn write(&mut self, addr: u64, k: usize, v: f64) {
            let (i, o) = self.at(addr);
            self.0[i].1[o + k] = v;
        }
        fn get(&self, addr: u64) -> Vec<f64> {
            self.0[self.at(addr).0].1.clone()
        }
    }

    /// kernels/conv.cu's im2col (true) or col2im, element by element.
    fn rearrange(mem: &mut Mem, w: &Win2d, im2col: bool, src: u64, dst: u64, n: usize) {
        let (ohw, kk) = (w.out_h * w.out_w, w.k_h * w.k_w);
        let source = |i: i64, k: i64, pad: i64, dil: i64, stride: i64, out: i64| {
            let t = i + pad - k * dil;
            (t >= 0 && t % stride == 0 && t / stride < out).then_some(t / stride)
        };
        for e in 0..n as i64 {
            if im2col {
                let (o, r) = (e % ohw, e / ohw);
                let (tap, sc) = (r % kk, r / kk);
                let (oi, oj, ki, kj) = (o / w.out_w, o % w.out_w, tap / w.k_w, tap % w.k_w);
                let ih = oi * w.stride_h + ki * w.dil_h - w.pad_h;
                let iw = oj * w.stride_w + kj * w.dil_w - w.pad_w;
                let inside = ih >= 0 && ih < w.in_h && iw >= 0 && iw < w.in_w;
                let v = if inside { mem.read(src, ((sc * w.in_h + ih) * w.in_w + iw) as usize) } else { 0.0 };
                mem.write(dst, e as usize, v);
            } else {
                let (iw, t) = (e % w.in_w, e / w.in_w);
                let (ih, sc) = (t % w.in_h, t / w.in_h);
                let mut acc = 0.0;
                for ki in 0..w.k_h {
                    let Some(oi) = source(ih, ki, w.pad_h, w.dil_h, w.stride_h, w.out_h) else { continue };
                    for kj in 0..w.k_w {
                        if let Some(oj) = source(iw, kj, w.pad_w, w.dil_w, w.stride_w, w.out_w) {
                            acc += mem.read(src, (sc * kk * ohw + (ki * w.k_w + kj) * ohw + oi * w.out_w + oj) as usize);
                        }
                    }
                }
                mem.write(dst, e as usize, acc);
            }
        }
    }

    /// blas.rs `Gemm`: C[b] = alpha · op(A[b]) · op(B[b]) + beta · C[b], row-major with leading
    /// dimensions and batch strides in elements (beta 0: C is not read).
    fn gemm(mem: &mut Mem, g: &Gemm, a: u64, b: u64, c: u64) {
        for bi in 0..g.batch {
            for i in 0..g.m {
                for j in 0..g.n {
                    let mut s = 0.0;
                    for r in 0..g.k {
                        let av = if g.trans_a {
                            mem.read(a, bi * g.stride_a + r * g.lda + i)
                        } else {
                            mem.read(a, bi * g.stride_a + i * g.lda + r)
                        };
                        let bv = if g.trans_b {
                            mem.read(b, bi * g.stride_b + j * g.ldb + r)
                        } else {
                            mem.read(b, bi * g.stride_b + r * g.ldb + j)
                        };
                        s += av * bv;
                    }
                    let at = bi * g.stride_c + i * g.ldc + j;
                    let old = if g.beta == 0.0 { 0.0 } else { g.beta * mem.read(c, at) };
                    mem.write(c, at, g.alpha * s + old);
                }
            }
        }
    }

    fn run_calls(mem: &mut Mem, geo: &Geo, list: &[Call]) {
        for call in list {
            match call {
                Call::Rearrange { im2col, src, dst, n } => rearrange(mem, &geo.win, *im2col, *src, *dst, *n),
                Call::Gemm { g, a, b, c } => gemm(mem, g, *a, *b, *c),
            }
        }
    }

    fn f64s(shape: &[usize], v: &[f64]) -> Tensor {
        Tensor::new(shape.to_vec(), Data::F64(v.to_vec())).expect("tensor")
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f64 - 500.0) / 250.0).collect()
    }

    fn close(what: &str, got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * scale, "{what}: element {i}: {g} vs {w}");
        }
    }

    /// Conv, ConvGradX and ConvGradW through the operation lists match the CPU kernels, for
    /// strided/padded/dilated, grouped, direct (1×1) and 1-D convolutions, in one chunk and in
    /// chunks of 1 and 2 samples (a remainder included), with and without a bias.
    #[test]
    fn operation_lists_compute_the_cpu_convolution_and_its_gradients() {
        let ints = |v: &[i64]| Attr::Ints(v.to_vec());
        let cases: Vec<(Vec<usize>, Vec<usize>, Attrs)> = vec![
            (
                vec![3, 4, 7, 6],
                vec![6, 2, 3, 3],
                Attrs::default()
                    .with("group", Attr::Int(2))
                    .with("pads", ints(&[1, 0, 2, 1]))
                    .with("strides", ints(&[2, 1]))
                    .with("dilations", ints(&[1, 2])),
            ),
            (vec![3, 4, 5, 5], vec![6, 2, 1, 1], Attrs::default().with("group", Attr::Int(2))),
            (
                vec![3, 2, 9],
                vec![3, 2, 3],
                Attrs::default().with("dilations", ints(&[2])).with("auto_pad", Attr::String("SAME_UPPER".into())),
            ),
        ];
        for (xs, ws, attrs) in cases {
            let node = Node { name: "c".into(), op_type: "Conv".into(), inputs: vec![], outputs: vec![], attrs: attrs.clone() };
            let geo = Geo::new(&node, &xs, &ws).expect("geometry");
            let numel = |s: &[usize]| s.iter().product::<usize>();
            let (x, w, b) = (values(numel(&xs), 1), values(numel(&ws), 2), values(ws[0], 3));
            let (xt, wt, bt) = (f64s(&xs, &x), f64s(&ws, &w), f64s(&[ws[0]], &b));
            let y_t = run("Conv", attrs.clone(), &[&xt, &wt, &bt]).remove(0);
            let (ys, want_y) = (y_t.shape.clone(), y_t.to_f64_vec());
            let dy = values(numel(&ys), 4);
            let dyt = f64s(&ys, &dy);
            let shape_of = |s: &[usize]| Tensor::from_i64(vec![s.len()], s.iter().map(|&d| d as i64).collect());
            let want_dx = run("ConvGradX", attrs.clone(), &[&dyt, &wt, &shape_of(&xs)])[0].to_f64_vec();
            let want_dw = run("ConvGradW", attrs.clone(), &[&dyt, &xt, &shape_of(&ws)])[0].to_f64_vec();
            for budget in [COL_BUDGET, 1, 2 * 8 * geo.scratch_sample(Kind::GradW)] {
                let case = format!("x {xs:?} w {ws:?} budget {budget}");
                for kind in [Kind::Forward, Kind::GradX, Kind::GradW] {
                    let (per, scratch_elems) = geo.chunking(kind, 8, budget);
                    let mut mem = Mem(Vec::new());
                    let scratch = mem.add(vec![f64::NAN; scratch_elems.max(1)]);
                    let ones = mem.add(vec![1.0; per.max(geo.ohw)]);
                    let (ops, out) = match kind {
                        Kind::Forward => {
                            let ops = vec![mem.add(x.clone()), mem.add(w.clone()), mem.add(b.clone()), mem.add(vec![f64::NAN; dy.len()])];
                            (ops.clone(), ops[3])
                        }
                        Kind::GradX => {
                            let ops = vec![mem.add(dy.clone()), mem.add(w.clone()), mem.add(vec![f64::NAN; x.len()])];
                            (ops.clone(), ops[2])
                        }
                        Kind::GradW => {
                            let ops = vec![mem.add(dy.clone()), mem.add(x.clone()), mem.add(vec![f64::NAN; w.len()])];
                            (ops.clone(), ops[2])
                        }
                    };
                    let list = calls(&geo, kind, GemmType::F64, F32Mode::Exact, per, &ops, scratch, ones);
                    run_calls(&mut mem, &geo, &list);
                    let want = match kind {
                        Kind::Forward => &want_y,
                        Kind::GradX => &want_dx,
                        Kind::GradW => &want_dw,
                    };
                    close(&format!("{case}: {kind:?} in chunks of {per}"), &mem.get(out), want);
                }
            }
        }
    }
}
