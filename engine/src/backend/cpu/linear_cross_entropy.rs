//! CPU kernel of LinearCrossEntropy (ops/loss.rs: the LM head fused with its softmax
//! cross-entropy): the rows are walked in chunks, one chunk's logits at a time, their loss terms
//! and unit-seed gradient, then the gradient gemms into dX, dW and db by vocabulary tiles
//! (lce_tiles.rs). Rows of weight 0 are skipped.

use std::any::TypeId;

use rayon::prelude::*;

use super::bf16::MatmulPath;
use super::elementwise::{first, FloatElem};
use super::lce_stream::{self, ChunkOut, StreamRows};
use super::lce_tiles::{chunk_grads, ChunkGrads};
use super::loss::{targets, Layout};
use super::matmul::{gemm_call, Mat};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;

/// What one LinearCrossEntropy call needs besides its operands.
struct Lce<'a> {
    path: MatmulPath,
    /// (label, weight) per row, weight 0 for ignored rows.
    t: &'a [(usize, f64)],
    /// The unit-seed gradient's factor: 1/Σweights for mean (0 when every row is ignored), 1 for sum.
    scale: f64,
    /// Mean reduction with Σweights = 0: the loss is NaN (as PyTorch's).
    nan: bool,
    k: usize,
    n: usize,
    trans_b: bool,
    /// Whether dW is wanted (`weight_grad`, ops/loss.rs): else its output is empty, never written.
    weight_grad: bool,
}

/// The same slice as f32 when T is f32 (for the vectorised row primitives).
fn as_f32<T: 'static>(row: &mut [T]) -> Option<&mut [f32]> {
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| {
        // SAFETY: T is f32: the same memory, length and element type.
        unsafe { std::slice::from_raw_parts_mut(row.as_mut_ptr() as *mut f32, row.len()) }
    })
}

/// The f32 operands of a chunk when T is f32.
struct Fp32Chunk<'a> {
    x: &'a [f32],
    w: &'a [f32],
    b: Option<&'a [f32]>,
}

impl<'a> Fp32Chunk<'a> {
    fn of<T: 'static>(x: &'a [T], w: &'a [T], b: Option<&'a [T]>) -> Option<Self> {
        let view = |s: &'a [T]| {
            // SAFETY: T is f32 (checked below): the same memory, length and element type.
            unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) }
        };
        (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| Fp32Chunk { x: view(x), w: view(w), b: b.map(view) })
    }
}

/// One row of f64 logits (X·op(W), plus `bias` when given: the gemm then left it out): returns
/// its loss term −w·log softmax(row)[y] and replaces the row by its unit-seed gradient
/// g·(softmax − onehot(y)) (zeros for an ignored row, w = 0). f32 chunks go through
/// lce_stream.rs instead.
fn lce_row<T: FloatElem + 'static>(row: &mut [T], bias: Option<&[T]>, y: usize, w: f64, g: f64) -> f64 {
    if w == 0.0 {
        row.iter_mut().for_each(|v| *v = T::zero());
        return 0.0;
    }
    if let Some(b) = bias {
        row.iter_mut().zip(b).for_each(|(v, &b)| *v = *v + b);
    }
    let m = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.as_()));
    let lse = m + row.iter().map(|v| (v.as_() - m).exp()).sum::<f64>().ln();
    let term = -w * (row[y].as_() - lse);
    row.iter_mut().for_each(|v| *v = T::from_f64(g * (v.as_() - lse).exp()));
    row[y] = T::from_f64(row[y].as_() - g);
    term
}

/// g[..r·n] = X_c · op(W), the chunk's logits without the bias (zeros when k is 0).
fn chunk_logits<T: FloatElem + 'static>(a: &Lce, r: usize, x_rows: &[T], wv: &[T], g: &mut [T]) {
    let (k, n) = (a.k, a.n);
    if k == 0 {
        g[..r * n].iter_mut().for_each(|v| *v = T::zero());
        return;
    }
    let xc = Mat { ptr: x_rows.as_ptr(), rs: k as isize, cs: 1 };
    let wm = if a.trans_b { Mat { ptr: wv.as_ptr(), rs: 1, cs: k as isize } } else { Mat { ptr: wv.as_ptr(), rs: n as isize, cs: 1 } };
    // SAFETY: X_c is [r, k] row-major (x's rows or their compact copy), op(W) a [k, n] view of
    // w, the chunk [r, n] at the start of the scratch output (distinct from both).
    unsafe { gemm_call(a.path, r, n, k, g.as_mut_ptr(), xc, wm, T::one(), false) };
}

fn lce_go<T: FloatElem + 'static>(a: &Lce, x: &In, w: &In, b: Option<&In>, out: &mut [Out]) -> Result<()> {
    let (xv, wv) = (x.slice::<T>()?, w.slice::<T>()?);
    let bv = b.map(|b| b.slice::<T>()).transpose()?;
    let [lo, dxo, dwo, dbo, so] = out else {
        return Err(crate::error::Error::other("LinearCrossEntropy: expected 5 outputs"));
    };
    let (dx, dw, db, scratch) = (dxo.slice::<T>()?, dwo.slice::<T>()?, dbo.slice::<T>()?, so.slice::<T>()?);
    let (k, n, rows) = (a.k, a.n, a.t.len());
    db.iter_mut().for_each(|v| *v = T::zero());
    if rows == 0 || n == 0 || k == 0 {
        dx.iter_mut().chain(dw.iter_mut()).for_each(|v| *v = T::zero());
    }
    let chunk = scratch.len().checked_div(n).unwrap_or(rows);
    // Rows with weight 0 (ignore_index: e.g. the 85% unmasked tokens of a masked-LM batch) add
    // nothing to the loss or any gradient: only the others are computed, gathered into compact
    // chunks, and their dX rows scattered back (the ignored rows' dX is 0).
    let active: Vec<usize> = (0..rows).filter(|&i| a.t[i].1 != 0.0).collect();
    let compact = active.len() < rows;
    if compact {
        dx.iter_mut().for_each(|v| *v = T::zero());
        if active.is_empty() {
            dw.iter_mut().for_each(|v| *v = T::zero());
        }
    }
    let staged = if compact { chunk.min(active.len()) * k } else { 0 };
    let (mut xg, mut dxg) = (vec![T::zero(); staged], vec![T::zero(); staged]);
    let mut total = 0f64;
    let mut c0 = 0;
    // f32 chunks stream by vocabulary tiles (lce_stream.rs), with the gemm crate's products or
    // the bf16 kernel's; f64: logits, a row pass, then the tiled products.
    while c0 < active.len() && n > 0 {
        let r = chunk.min(active.len() - c0);
        let ids = &active[c0..c0 + r];
        let g = &mut scratch[..r * n];
        let x_rows: &[T] = if compact {
            for (dst, &i) in xg.chunks_exact_mut(k.max(1)).zip(ids) {
                dst.copy_from_slice(&xv[i * k..(i + 1) * k]);
            }
            &xg[..r * k]
        } else {
            &xv[c0 * k..(c0 + r) * k]
        };
        let dx_rows = if compact { &mut dxg[..] } else { &mut dx[c0 * k..(c0 + r) * k] };
        let f32s = (Fp32Chunk::of(x_rows, wv, bv), as_f32(&mut g[..]), as_f32(dx_rows), as_f32(&mut dw[..]), as_f32(&mut db[..]));
        if let (Some(f), Some(g32), Some(dx32), Some(dw32), Some(db32)) = f32s {
            let c = ChunkGrads { g: &[], x: f.x, w: f.w, r, n, k, trans_b: a.trans_b, path: a.path };
            let rows = StreamRows { targets: ids.iter().map(|&i| (a.t[i].0, a.t[i].1, a.t[i].1 * a.scale)).collect(), bias: f.b };
            let out = ChunkOut { dx: dx32, dw: a.weight_grad.then_some(dw32), db: db32, accumulate_dw: c0 > 0 };
            // the whole chunk by vocabulary tiles (bf16 products on the bf16 path)
            total += lce_stream::chunk(&c, g32, &rows, out);
        } else {
            // f64: logits, a row pass, the tiled products
            chunk_logits(a, r, x_rows, wv, g);
            let terms: Vec<f64> =
                g.par_chunks_mut(n).zip(ids.par_iter()).map(|(row, &i)| lce_row(row, bv, a.t[i].0, a.t[i].1, a.t[i].1 * a.scale)).collect();
            total += terms.iter().sum::<f64>();
            let c = ChunkGrads { g: &*g, x: x_rows, w: wv, r, n, k, trans_b: a.trans_b, path: a.path };
            chunk_grads(&c, dx_rows, a.weight_grad.then_some(&mut dw[..]), db, c0 > 0);
        }
        if compact {
            for (src, &i) in dxg.chunks_exact(k.max(1)).zip(ids) {
                dx[i * k..(i + 1) * k].copy_from_slice(src);
            }
        }
        c0 += r;
    }
    let loss = if a.nan { f64::NAN } else { total * a.scale };
    lo.slice::<T>()?[0] = T::from_f64(loss);
    Ok(())
}

fn linear_cross_entropy(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let arg = |i: usize, what: &str| inputs.get(i).and_then(|v| v.as_ref()).ok_or_else(|| node.err(format!("{what} missing")));
    let (w, labels) = (arg(1, "weight")?, arg(3, "labels")?);
    let (b, cw) = (inputs.get(2).and_then(|v| v.as_ref()), inputs.get(4).and_then(|v| v.as_ref()));
    let (k, n) = crate::ops::linear::linear_dims(node, w.shape)?;
    let rows = labels.shape.iter().product();
    let l = Layout {
        n: rows,
        c: n,
        inner: 1,
        ignore: node.attrs.get("ignore_index").map(|_| node.attrs.int("ignore_index", 0)).transpose()?,
        reduction: node.attrs.string("reduction", "mean")?,
        softmax: true,
    };
    let t = targets(node, &l, labels, cw)?;
    let wsum: f64 = t.iter().map(|p| p.1).sum();
    let sum = l.reduction == "sum";
    let a = Lce {
        path: ctx.matmul,
        t: &t,
        scale: if sum {
            1.0
        } else if wsum == 0.0 {
            0.0
        } else {
            1.0 / wsum
        },
        nan: !sum && wsum == 0.0,
        k,
        n,
        trans_b: node.attrs.int("transB", 0)? != 0,
        weight_grad: crate::ops::loss::lce_weight_grad(node)?,
    };
    crate::dispatch_float!(x.dtype, node, lce_go::<T>(&a, x, w, b, out))
}

pub fn register(t: &mut KernelTable) {
    t.add("LinearCrossEntropy", linear_cross_entropy);
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{data, try_run_opt};
    use super::super::CpuCtx;
    use crate::ir::{Attr, Attrs};
    use crate::ops::{lce_chunk_rows, LceBudget};
    use crate::tensor::{Data, Tensor};

    fn vals(n: usize, seed: u64) -> Vec<f64> {
        data(n, seed).into_iter().map(f64::from).collect()
    }

    fn tensor(shape: Vec<usize>, v: Vec<f64>, f64s: bool) -> Tensor {
        if f64s {
            Tensor::new(shape, Data::F64(v)).unwrap_or_else(|e| panic!("{e}"))
        } else {
            Tensor::from_f32(shape, v.into_iter().map(|x| x as f32).collect())
        }
    }

    /// (loss, dX, dW, db) in f64 from the definition: logits = X·op(W) + b, per-row softmax
    /// cross-entropy with class weights, mean or sum; gradients for a unit seed.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f64],
        w: &[f64],
        b: Option<&[f64]>,
        y: &[i64],
        cw: Option<&[f64]>,
        k: usize,
        n: usize,
        tb: bool,
        ignore: i64,
        mean: bool,
    ) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>) {
        let rows = y.len();
        let wat = |j: usize, kk: usize| if tb { w[j * k + kk] } else { w[kk * n + j] };
        let (mut loss, mut wsum) = (0.0, 0.0);
        let mut g = vec![0.0; rows * n];
        for r in 0..rows {
            let logits: Vec<f64> =
                (0..n).map(|j| b.map_or(0.0, |b| b[j]) + (0..k).map(|kk| x[r * k + kk] * wat(j, kk)).sum::<f64>()).collect();
            if y[r] == ignore {
                continue;
            }
            let t = y[r] as usize;
            let wt = cw.map_or(1.0, |c| c[t]);
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + logits.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            loss += -wt * (logits[t] - lse);
            wsum += wt;
            for j in 0..n {
                g[r * n + j] = wt * ((logits[j] - lse).exp() - if j == t { 1.0 } else { 0.0 });
            }
        }
        let scale = if mean { 1.0 / wsum } else { 1.0 };
        g.iter_mut().for_each(|v| *v *= scale);
        let dx: Vec<f64> = (0..rows * k).map(|i| (0..n).map(|j| g[(i / k) * n + j] * wat(j, i % k)).sum()).collect();
        let dw: Vec<f64> = (0..n * k)
            .map(|i| {
                let (j, kk) = if tb { (i / k, i % k) } else { (i % n, i / n) };
                (0..rows).map(|r| g[r * n + j] * x[r * k + kk]).sum()
            })
            .collect();
        let db: Vec<f64> = (0..n).map(|j| (0..rows).map(|r| g[r * n + j]).sum()).collect();
        (loss * scale, dx, dw, db)
    }

    fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
        let d = got.iter().zip(want).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale;
        assert!(d <= tol, "{what}: max relative difference {d:.2e}");
    }

    /// Several chunks (the last one partial), both weight layouts, with and
    /// without bias, ignore_index, class weights, mean and sum, f32 and f64, X of rank 3.
    #[test]
    fn linear_cross_entropy_matches_the_definition() {
        let (k, n) = (9, 1100);
        let (d0, d1) = (16, LceBudget::CPU.max_rows / 8 + 2);
        let rows = d0 * d1;
        let chunk = lce_chunk_rows(rows, n, k, 4, LceBudget::CPU);
        assert!(rows > 2 * chunk && rows % chunk != 0);
        let cases = [
            (true, true, false, true, false),
            (false, false, true, false, false),
            (true, false, true, true, true),
            (false, true, false, false, true),
            (true, true, false, true, false), // no ignored row: the uncompacted path
        ];
        for (case, (tb, bias, weighted, mean, f64s)) in cases.into_iter().enumerate() {
            let x = vals(rows * k, 1 + case as u64);
            let w: Vec<f64> = vals(n * k, 7).iter().map(|v| 2.0 * v).collect();
            let b = vals(n, 3);
            let cw: Vec<f64> = vals(n, 5).iter().map(|v| v.abs() + 0.1).collect();
            let y: Vec<i64> = (0..rows).map(|r| if case < 4 && r % 11 == 4 { -100 } else { (r * 7 % n) as i64 }).collect();
            let xt = tensor(vec![d0, d1, k], x.clone(), f64s);
            let wt = tensor(if tb { vec![n, k] } else { vec![k, n] }, w.clone(), f64s);
            let (bt, ct) = (tensor(vec![n], b.clone(), f64s), tensor(vec![n], cw.clone(), f64s));
            let yt = Tensor::from_i64(vec![rows], y.clone());
            let attrs = Attrs::default()
                .with("transB", Attr::Int(tb as i64))
                .with("ignore_index", Attr::Int(-100))
                .with("reduction", Attr::String(if mean { "mean" } else { "sum" }.into()));
            let ins = [Some(&xt), Some(&wt), bias.then_some(&bt), Some(&yt), weighted.then_some(&ct)];
            let (loss, dx, dw, db) = reference(&x, &w, bias.then_some(&b[..]), &y, weighted.then_some(&cw[..]), k, n, tb, -100, mean);
            // f32 tensors also through the bf16 kernels when this CPU has them (operands rounded
            // to bf16: about 3 significant digits): the one the CPU picks, and the avx512_bf16
            // one where that is AMX (Zen 4 runs it)
            use crate::backend::cpu::bf16::{detect, Bf16Isa, MatmulPath};
            let bf16 = detect().filter(|_| !f64s).map(MatmulPath::Bf16);
            let avx512 = (detect() == Some(Bf16Isa::Amx) && !f64s).then_some(MatmulPath::Bf16(Bf16Isa::Avx512Bf16));
            for (path, tol) in [(Some(MatmulPath::Fp32), if f64s { 1e-12 } else { 2e-5 }), (bf16, 1e-2), (avx512, 1e-2)] {
                let Some(path) = path else { continue };
                let mut ctx = CpuCtx::new(0).with_matmul(path);
                let out = try_run_opt("LinearCrossEntropy", attrs.clone(), &ins, &mut ctx).unwrap_or_else(|e| panic!("case {case}: {e}"));
                let what = |v: &str| format!("case {case} ({path:?}): {v}");
                close(&what("loss"), &out[0].to_f64_vec(), &[loss], tol);
                close(&what("dX"), &out[1].to_f64_vec(), &dx, tol);
                close(&what("dW"), &out[2].to_f64_vec(), &dw, tol);
                close(&what("db"), &out[3].to_f64_vec(), &db, tol);
                let elem = if f64s { 8 } else { 4 };
                assert_eq!(out[4].shape, vec![lce_chunk_rows(rows, n, k, elem, LceBudget::CPU), n], "case {case}: scratch");
            }
            // a frozen weight (weight_grad 0, passes/lce_weight_grad.rs): the same loss, dX and
            // db, and an empty dW
            let mut ctx = CpuCtx::new(0).with_matmul(MatmulPath::Fp32);
            let frozen = attrs.clone().with("weight_grad", Attr::Int(0));
            let out = try_run_opt("LinearCrossEntropy", frozen, &ins, &mut ctx).unwrap_or_else(|e| panic!("case {case}: {e}"));
            let tol = if f64s { 1e-12 } else { 2e-5 };
            close(&format!("case {case} frozen: loss"), &out[0].to_f64_vec(), &[loss], tol);
            close(&format!("case {case} frozen: dX"), &out[1].to_f64_vec(), &dx, tol);
            close(&format!("case {case} frozen: db"), &out[3].to_f64_vec(), &db, tol);
            assert_eq!(out[2].shape, vec![0], "case {case}: a frozen weight's dW");
        }
    }
}

#[cfg(test)]
mod bench {
    use super::super::tensor_view::{In, Out};
    use super::{lce_go, Lce};
    use crate::backend::cpu::bf16::MatmulPath;
    use crate::tensor::{DType, Tensor};

    /// The tutorial's LM head (700 rows, K 200, N 28782) through LinearCrossEntropy with several
    /// chunk sizes (`LCE_CHUNKS=128,256`), on the fp32 path and on the bf16 path when the CPU has
    /// one (`LCE_PATHS=fp32` or `bf16` for one of them), four rounds (`LCE_ROUNDS`):
    /// `cargo test --release -p ortrain-engine lce_chunk_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn lce_chunk_speed() {
        let (rows, k, n) = (700usize, 200usize, 28782usize);
        let x = Tensor::from_f32(vec![rows, k], (0..rows * k).map(|i| ((i * 7919) % 1000) as f32 / 5000.0 - 0.1).collect());
        let w = Tensor::from_f32(vec![n, k], (0..n * k).map(|i| ((i * 104_729) % 1000) as f32 / 5000.0 - 0.1).collect());
        let t: Vec<(usize, f64)> = (0..rows).map(|r| (r * 37 % n, 1.0)).collect();
        let only = std::env::var("LCE_PATHS").unwrap_or_default();
        let paths = [
            Some(MatmulPath::Fp32).filter(|_| only != "bf16"),
            crate::backend::cpu::bf16::detect().map(MatmulPath::Bf16).filter(|_| only != "fp32"),
        ];
        let rounds: usize = std::env::var("LCE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
        let mut outs: Vec<Vec<f32>> = vec![vec![0.0; 1], vec![0.0; rows * k], vec![0.0; n * k], vec![0.0; n], vec![0.0; 700 * n]];
        let chunks: Vec<usize> = std::env::var("LCE_CHUNKS")
            .ok()
            .map(|v| v.split(',').filter_map(|c| c.parse().ok()).collect())
            .unwrap_or_else(|| vec![128, 256, 234, 350]);
        for round in 0..rounds {
            for path in paths.into_iter().flatten() {
                let a = Lce { path, t: &t, scale: 1.0 / rows as f64, nan: false, k, n, trans_b: true, weight_grad: true };
                for &chunk in &chunks {
                    let shapes = [vec![], vec![rows, k], vec![n, k], vec![n], vec![chunk, n]];
                    let mut views: Vec<Out> = outs
                        .iter_mut()
                        .zip(&shapes)
                        // SAFETY: each vector holds at least numel(shape) f32s and is borrowed once.
                        .map(|(v, s)| unsafe { Out::from_raw(DType::F32, s, v.as_mut_ptr() as *mut u8) })
                        .collect();
                    let t0 = std::time::Instant::now();
                    lce_go::<f32>(&a, &In::of(&x), &In::of(&w), None, &mut views).unwrap_or_else(|e| panic!("{e}"));
                    println!("round {round}: {path:?} chunk {chunk:4}: {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
    }

    /// Where LinearCrossEntropy's time goes on the tutorial shape, over all chunks: the three
    /// products as whole-chunk parallel gemms (references), and what the kernel runs: the chunk
    /// streamed by vocabulary tiles (lce_stream.rs), on the fp32 path and on the bf16 path when
    /// the CPU has one:
    /// `cargo test --release -p ortrain-engine lce_phase_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn lce_phase_speed() {
        use super::super::matmul::{gemm_call, Mat};
        let (rows, k, n) = (700usize, 200usize, 28782usize);
        let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7919) % 1000) as f32 / 5000.0 - 0.1).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 104_729) % 1000) as f32 / 5000.0 - 0.1).collect();
        let (mut dx, mut dw, mut db) = (vec![0f32; rows * k], vec![0f32; n * k], vec![0f32; n]);
        let paths = [Some(MatmulPath::Fp32), crate::backend::cpu::bf16::detect().map(MatmulPath::Bf16)];
        for (path, chunk) in paths.into_iter().flatten().flat_map(|p| [(p, 128usize), (p, 256), (p, 234), (p, 256)]) {
            let mut g = vec![0f32; chunk * n];
            let mut t = [0f64; 4];
            let mut c0 = 0;
            while c0 < rows {
                let r = chunk.min(rows - c0);
                let gs = &mut g[..r * n];
                let (xr, dxr) = (&x[c0 * k..(c0 + r) * k], &mut dx[c0 * k..(c0 + r) * k]);
                let xc = Mat { ptr: xr.as_ptr(), rs: k as isize, cs: 1 };
                let targets: Vec<(usize, f64, f64)> = (0..r).map(|i| ((i * 37) % n, 1.0, 1e-3)).collect();
                let t0 = std::time::Instant::now();
                // SAFETY: shapes as in lce_go.
                unsafe { gemm_call(path, r, n, k, gs.as_mut_ptr(), xc, Mat { ptr: w.as_ptr(), rs: 1, cs: k as isize }, 1.0, false) };
                let t1 = std::time::Instant::now();
                let gm = Mat { ptr: gs.as_ptr(), rs: n as isize, cs: 1 };
                // SAFETY: as above.
                unsafe { gemm_call(path, r, k, n, dxr.as_mut_ptr(), gm, Mat { ptr: w.as_ptr(), rs: k as isize, cs: 1 }, 1.0, false) };
                let t2 = std::time::Instant::now();
                let gt = Mat { ptr: gs.as_ptr(), rs: 1, cs: n as isize };
                // SAFETY: as above.
                unsafe { gemm_call(path, n, k, r, dw.as_mut_ptr(), gt, xc, 1.0, c0 > 0) };
                let t3 = std::time::Instant::now();
                let c = super::ChunkGrads { g: &[], x: xr, w: &w, r, n, k, trans_b: true, path };
                let rows = super::StreamRows { targets, bias: None };
                super::lce_stream::chunk(&c, gs, &rows, super::ChunkOut { dx: dxr, dw: Some(&mut dw), db: &mut db, accumulate_dw: c0 > 0 });
                t[3] += t3.elapsed().as_secs_f64() * 1e3;
                for (acc, (a, b)) in t.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
                    *acc += (b - a).as_secs_f64() * 1e3;
                }
                c0 += r;
            }
            println!(
                "{path:?} chunk {chunk}: whole gemms: logits {:.1} ms, dX {:.1}, dW {:.1}; streamed by tiles: {:.1} ms",
                t[0], t[1], t[2], t[3]
            );
        }
    }
}
