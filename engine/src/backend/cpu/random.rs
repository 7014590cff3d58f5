//! CPU kernels of ops/random.rs, and the counter-based random stream they draw from: element i
//! of a draw is a hash of (seed, draw counter, i), so parallel kernels are deterministic. The
//! per-element hash is 32-bit (murmur3's finalizer, twice, keyed by the draw's 64-bit key) so
//! that it vectorises: AVX2 has 32-bit but no 64-bit lane multiplies.

use num_traits::AsPrimitive;
use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;
use crate::simd::multiversion;
use crate::tensor::DType;

pub struct Rng {
    seed: u64,
    draws: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { seed, draws: 0 }
    }
    /// A fresh stream key for one kernel call.
    pub fn next_key(&mut self) -> u64 {
        self.draws += 1;
        splitmix(self.seed ^ splitmix(self.draws))
    }
}

#[inline]
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// murmur3's 32-bit finalizer: a bijection whose every output bit depends on every input bit.
#[inline(always)]
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

/// 32 random bits for element `i` of the stream `key` (the scalar definition the kernels'
/// `for_each_bits` follows).
#[cfg(test)]
fn bits(key: u64, i: u64) -> u32 {
    let lo = (i as u32).wrapping_mul(0x9E37_79B9) ^ key as u32;
    fmix32(fmix32(lo) ^ (key >> 32) as u32 ^ ((i >> 32) as u32).wrapping_mul(0x27D4_EB2F))
}

/// The 32-bit draw below which an element is dropped: P(drop) = ratio to within 2⁻³².
pub(super) fn drop_threshold(ratio: f64) -> u32 {
    (ratio * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// Calls `f(k, bits)` with the 32 random bits of element `start + k` of the stream `key`, for k
/// in 0..len. Within one 2³²-element block of the stream the element's high half is the same
/// for all, so the loop runs on 32-bit lanes alone (LLVM vectorises it); the bits are those of
/// `bits` either way.
#[inline(always)]
pub(super) fn for_each_bits(len: usize, start: u64, key: u64, mut f: impl FnMut(usize, u32)) {
    let mut k = 0;
    while k < len {
        let i = start + k as u64;
        // the elements up to the end of i's 2^32 block
        let run = (len - k).min(((1u64 << 32) - (i & 0xFFFF_FFFF)) as usize);
        let lo0 = i as u32;
        let hi = (key >> 32) as u32 ^ ((i >> 32) as u32).wrapping_mul(0x27D4_EB2F);
        for t in 0..run {
            let lo = lo0.wrapping_add(t as u32).wrapping_mul(0x9E37_79B9) ^ key as u32;
            f(k + t, fmix32(fmix32(lo) ^ hi));
        }
        k += run;
    }
}

/// mask[k] = 1 where element `start + k` of the stream `key` is kept, else 0.
#[inline(always)]
fn keep_body<const FMA: bool>(mask: &mut [u8], start: u64, key: u64, threshold: u32) {
    for_each_bits(mask.len(), start, key, |k, b| mask[k] = (b >= threshold) as u8);
}

multiversion!(keep_mask, keep_body, (mask: &mut [u8], start: u64, key: u64, threshold: u32) -> ());

/// f32 dropout of one chunk in one pass: the mask as `keep_body`, y = x · scale where kept, else
/// 0.
#[inline(always)]
fn dropout_f32_body<const FMA: bool>(y: &mut [f32], mask: &mut [u8], x: &[f32], start: u64, key: u64, threshold: u32, scale: f32) {
    let n = y.len().min(mask.len()).min(x.len());
    let (y, mask, x) = (&mut y[..n], &mut mask[..n], &x[..n]);
    for_each_bits(n, start, key, |k, b| {
        let keep = b >= threshold;
        mask[k] = keep as u8;
        y[k] = if keep { x[k] * scale } else { 0.0 };
    });
}

multiversion!(
    dropout_f32,
    dropout_f32_body,
    (y: &mut [f32], mask: &mut [u8], x: &[f32], start: u64, key: u64, threshold: u32, scale: f32) -> ()
);

/// z[k] = scale where element `start + k` of the stream `key` is kept, else 0: the fused
/// attention's dropout factors (the draw a Dropout of those elements would make).
#[inline(always)]
fn keep_factors_body<const FMA: bool>(z: &mut [f32], start: u64, key: u64, threshold: u32, scale: f32) {
    for_each_bits(z.len(), start, key, |k, b| z[k] = if b >= threshold { scale } else { 0.0 });
}

multiversion!(keep_factors, keep_factors_body, (z: &mut [f32], start: u64, key: u64, threshold: u32, scale: f32) -> ());

/// o = dy · scale where the mask keeps the element, else 0 (f32, same shapes).
#[inline(always)]
fn masked_scale_body<const FMA: bool>(o: &mut [f32], dy: &[f32], mask: &[u8], scale: f32) {
    for ((o, &d), &m) in o.iter_mut().zip(dy).zip(mask) {
        *o = if m != 0 { d * scale } else { 0.0 };
    }
}

multiversion!(masked_scale, masked_scale_body, (o: &mut [f32], dy: &[f32], mask: &[u8], scale: f32) -> ());

/// Elements per parallel task of the dropout kernel.
const DROPOUT_CHUNK: usize = 1 << 14;

/// (ratio, training) of a Dropout node from its optional inputs (defaults 0.5, false).
fn dropout_params(node: &Node, inputs: &[Option<In>], ratio_at: usize) -> Result<(f64, bool)> {
    let ratio = match inputs.get(ratio_at).and_then(|x| x.as_ref()) {
        Some(r) => r.to_tensor().to_f64_vec().first().copied().unwrap_or(0.5),
        None => node.attrs.float("ratio", 0.5)? as f64,
    };
    let training = match inputs.get(ratio_at + 1).and_then(|x| x.as_ref()) {
        Some(t) => t.to_tensor().to_f64_vec().first().is_some_and(|&v| v != 0.0),
        None => false,
    };
    if !(0.0..1.0).contains(&ratio) {
        return Err(node.err(format!("ratio {ratio} must be in [0, 1)")));
    }
    Ok((ratio, training))
}

fn dropout(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    dropout_of(node, first(node, inputs)?, inputs, 1, out, ctx)
}

/// DropoutAdd(x, residual, ratio, mode): Dropout's output and mask (the same draw as a Dropout
/// in its place), then the residual added to the output, as the Add it replaces.
fn dropout_add(node: &Node, inputs: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let r = inputs.get(1).and_then(|r| r.as_ref()).ok_or_else(|| node.err("the residual (input 1) is missing"))?;
    if r.shape != out[0].shape || r.dtype != out[0].dtype {
        return Err(node.err(format!("the residual {:?} must be shaped and typed like the output {:?}", r.shape, out[0].shape)));
    }
    // a 16-bit x arrives widened (widen.rs): the dropped value is rounded to its type first
    let round = dropped_rounding(node)?;
    dropout_of(node, first(node, inputs)?, inputs, 2, out, ctx)?;
    fn add<T: FloatElem>(r: &In, y: &mut Out, round: Option<Rounding>) -> Result<()> {
        let (r, y) = (r.slice::<T>()?, y.slice::<T>()?);
        let add = |y: &mut [T], r: &[T]| match round {
            Some(f) => y.iter_mut().zip(r).for_each(|(y, &r)| *y = T::from_f64(f(AsPrimitive::<f64>::as_(*y) as f32) as f64) + r),
            None => y.iter_mut().zip(r).for_each(|(y, &r)| *y = *y + r),
        };
        if y.len() >= PAR_MIN {
            y.par_chunks_mut(DROPOUT_CHUNK).zip(r.par_chunks(DROPOUT_CHUNK)).for_each(|(y, r)| add(y, r));
        } else {
            add(y, r);
        }
        Ok(())
    }
    crate::dispatch_float!(r.dtype, node, add::<T>(r, &mut out[0], round))
}

/// Dropout of `x` with (ratio, training_mode) at inputs `ratio_at` and after it.
fn dropout_of(node: &Node, x: &In, inputs: &[Option<In>], ratio_at: usize, out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let (ratio, training) = dropout_params(node, inputs, ratio_at)?;
    let key = ctx.rng.next_key();
    let threshold = drop_threshold(ratio);
    /// The kernel around `apply(y, mask, x, start)`, which fills one chunk's output and mask
    /// from element `start` of the stream on.
    fn go<T: FloatElem>(
        x: &In,
        out: &mut [Out],
        ratio: f64,
        training: bool,
        apply: impl Fn(&mut [T], &mut [u8], &[T], u64) + Sync,
    ) -> Result<()> {
        let xv = x.slice::<T>()?;
        let (y, rest) = out.split_first_mut().expect("one output at least");
        let yv = y.slice::<T>()?;
        let mut mask_buf;
        let mv: &mut [u8] = match rest.first_mut() {
            Some(m) => m.slice::<u8>()?,
            None => {
                mask_buf = vec![0u8; xv.len()];
                &mut mask_buf
            }
        };
        if !training || ratio == 0.0 {
            yv.copy_from_slice(xv);
            mv.iter_mut().for_each(|m| *m = 1);
            return Ok(());
        }
        type Chunk<'a, T> = (usize, ((&'a mut [T], &'a mut [u8]), &'a [T]));
        let chunk = |(c, ((y, m), x)): Chunk<T>| apply(y, m, x, (c * DROPOUT_CHUNK) as u64);
        if xv.len() >= PAR_MIN {
            let chunks = yv.par_chunks_mut(DROPOUT_CHUNK).zip(mv.par_chunks_mut(DROPOUT_CHUNK)).zip(xv.par_chunks(DROPOUT_CHUNK));
            chunks.enumerate().for_each(chunk);
        } else {
            yv.chunks_mut(DROPOUT_CHUNK).zip(mv.chunks_mut(DROPOUT_CHUNK)).zip(xv.chunks(DROPOUT_CHUNK)).enumerate().for_each(chunk);
        }
        Ok(())
    }
    /// Any float type: the mask, then y = x · scale where kept.
    fn generic<T: FloatElem>(x: &In, out: &mut [Out], ratio: f64, training: bool, key: u64, threshold: u32) -> Result<()> {
        let scale = T::from_f64(1.0 / (1.0 - ratio));
        go::<T>(x, out, ratio, training, |y, m, x, start| {
            keep_mask::call(m, start, key, threshold);
            for ((y, &m), &v) in y.iter_mut().zip(m.iter()).zip(x) {
                *y = if m != 0 { v * scale } else { T::zero() };
            }
        })
    }
    if x.dtype == crate::tensor::DType::F32 {
        // f32: mask and output in one vectorised pass
        let scale = (1.0 / (1.0 - ratio)) as f32;
        return go::<f32>(x, out, ratio, training, |y, m, x, start| dropout_f32::call(y, m, x, start, key, threshold, scale));
    }
    crate::dispatch_float!(x.dtype, node, generic::<T>(x, out, ratio, training, key, threshold))
}

/// A value's rounding to a 16-bit type, in f32.
type Rounding = fn(f32) -> f32;

/// The rounding to the 16-bit type of `node`'s `dropped_type` (ops/random.rs), None without one:
/// 16-bit values reach these kernels widened to f32, so the type to round a value to before an
/// f32 add or product is read from there.
fn dropped_rounding(node: &Node) -> Result<Option<Rounding>> {
    Ok(crate::ops::random::dropped_type(node)?.map(|t| -> Rounding {
        match t {
            DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
            _ => |v| half::f16::from_f32(v).to_f32(),
        }
    }))
}

fn dropout_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let mask = inputs.get(1).and_then(|x| x.as_ref()).ok_or_else(|| node.err("mask missing"))?;
    let (ratio, training) = dropout_params(node, inputs, 2)?;
    let scale = if training { 1.0 / (1.0 - ratio) } else { 1.0 };
    // DropoutAdd's gradient: dx of a 16-bit x from dy rounded to x's type (an f32 dy is not yet)
    if let Some(round) = dropped_rounding(node)? {
        let s = scale as f32;
        return super::broadcast::map2::<f32, u8, f32>(dy, mask, &mut out[0], move |d, m| if m != 0 { round(d) * s } else { 0.0 });
    }
    fn go<T: FloatElem>(dy: &In, mask: &In, o: &mut Out, scale: f64) -> Result<()> {
        if dy.dtype == crate::tensor::DType::F32 && dy.shape == o.shape && mask.shape == o.shape {
            let (d, m, s) = (dy.slice::<f32>()?, mask.slice::<u8>()?, scale as f32);
            let ov = o.slice::<f32>()?;
            if ov.len() >= PAR_MIN {
                let chunks = ov.par_chunks_mut(DROPOUT_CHUNK).zip(d.par_chunks(DROPOUT_CHUNK).zip(m.par_chunks(DROPOUT_CHUNK)));
                chunks.for_each(|(o, (d, m))| masked_scale::call(o, d, m, s));
            } else {
                masked_scale::call(ov, d, m, s);
            }
            return Ok(());
        }
        let s = T::from_f64(scale);
        super::broadcast::map2::<T, u8, T>(dy, mask, o, move |d, m| if m != 0 { d * s } else { T::zero() })
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, mask, &mut out[0], scale))
}

/// DropoutKey() -> a fresh key of the step's stream, as an int64 [1].
fn dropout_key(node: &Node, _: &[Option<In>], out: &mut [Out], ctx: &mut CpuCtx) -> Result<()> {
    let key = out.first_mut().ok_or_else(|| node.err("DropoutKey has one output"))?.slice::<i64>()?;
    let [k] = key else { return Err(node.err(format!("the key holds {} values, expected 1", key.len()))) };
    *k = ctx.rng.next_key() as i64;
    Ok(())
}

pub fn register(t: &mut KernelTable) {
    t.add("Dropout", dropout);
    t.add("DropoutKey", dropout_key);
    t.add("DropoutGrad", dropout_grad);
    t.add("DropoutAdd", dropout_add);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(n: usize, key: u64, ratio: f64) -> Vec<u8> {
        let mut m = vec![0u8; n];
        for (c, chunk) in m.chunks_mut(DROPOUT_CHUNK).enumerate() {
            keep_mask::call(chunk, (c * DROPOUT_CHUNK) as u64, key, drop_threshold(ratio));
        }
        m
    }

    /// The drop rate is the ratio, masks of different draws are independent (both drop an
    /// element with probability ratio²), the bits are uniform, and every instruction-set path
    /// gives the same mask as the scalar hash.
    #[test]
    fn dropout_masks_drop_the_ratio_independently() {
        let n = 1 << 20;
        for ratio in [0.1, 0.2, 0.5, 0.9] {
            let (a, b) = (mask(n, Rng::new(7).next_key(), ratio), mask(n, Rng::new(8).next_key(), ratio));
            let dropped = |m: &[u8]| m.iter().filter(|&&v| v == 0).count() as f64 / n as f64;
            let both = a.iter().zip(&b).filter(|(&x, &y)| x == 0 && y == 0).count() as f64 / n as f64;
            // 4.5 standard deviations of a binomial over 2^20 draws
            let tol = |p: f64| 4.5 * (p * (1.0 - p) / n as f64).sqrt();
            assert!((dropped(&a) - ratio).abs() < tol(ratio), "ratio {ratio}: dropped {}", dropped(&a));
            assert!((both - ratio * ratio).abs() < tol(ratio * ratio), "ratio {ratio}: both {both}");
        }
        let key = 0x0123_4567_89AB_CDEF;
        let mut buckets = [0u32; 16];
        for i in 0..n as u64 {
            buckets[(bits(key, i) >> 28) as usize] += 1;
        }
        let expected = n as f64 / 16.0;
        let chi2: f64 = buckets.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum();
        assert!(chi2 < 40.0, "top 4 bits not uniform: chi2 {chi2} over 15 degrees of freedom");
        let m = mask(1000, key, 0.3);
        let scalar: Vec<u8> = (0..1000).map(|i| (bits(key, i) >= drop_threshold(0.3)) as u8).collect();
        assert_eq!(m, scalar);
        // a run that crosses a 2^32 block boundary, and one inside a later block
        for start in [(1u64 << 32) - 5, (3u64 << 32) + 17] {
            let mut m = vec![0u8; 40];
            keep_mask::call(&mut m, start, key, drop_threshold(0.3));
            let scalar: Vec<u8> = (0..40).map(|i| (bits(key, start + i) >= drop_threshold(0.3)) as u8).collect();
            assert_eq!(m, scalar, "start {start}");
        }
        // indices past 2^32 do not repeat the first 2^32
        assert_ne!((0..64).map(|i| bits(key, i)).collect::<Vec<_>>(), (0..64).map(|i| bits(key, i + (1 << 32))).collect::<Vec<_>>());
    }

    /// Dropout and its gradient on f32 (the vectorised one-pass paths) and f64 (the generic
    /// ones) give y = x · 1/(1 − ratio) where the stream's mask keeps x, else 0, and dx = dy the
    /// same way; sizes across the parallel chunks and one that runs on a single thread.
    #[test]
    fn dropout_and_its_gradient_follow_the_mask_on_every_path() {
        use super::super::testutil::run;
        use crate::ir::{Attrs, ValueId};
        use crate::tensor::{DType, Data, Tensor};
        for (n, ratio) in [(3 * DROPOUT_CHUNK + 11, 0.2f64), (1000, 0.5)] {
            let xs: Vec<f64> = (0..n).map(|i| (i % 97) as f64 / 7.0 - 6.0).collect();
            let ratio_t = Tensor::scalar_f32(ratio as f32);
            let training = Tensor::new(vec![], Data::Bool(vec![1])).unwrap_or_else(|e| panic!("{e}"));
            for f64s in [false, true] {
                let x = if f64s {
                    Tensor::new(vec![n], Data::F64(xs.clone())).unwrap_or_else(|e| panic!("{e}"))
                } else {
                    Tensor::from_f32(vec![n], xs.iter().map(|&v| v as f32).collect())
                };
                // the node with its mask output, as the importer makes it
                let node = Node {
                    name: "d".into(),
                    op_type: "Dropout".into(),
                    inputs: vec![None; 3],
                    outputs: vec![ValueId(0), ValueId(1)],
                    attrs: Attrs::default(),
                };
                let (mut y_t, mut m_t) = (Tensor::zeros(x.dtype(), vec![n]), Tensor::zeros(DType::Bool, vec![n]));
                let shape = vec![n];
                // SAFETY: each tensor holds n elements of its type and is borrowed only here.
                let mut outs = unsafe {
                    [
                        Out::from_raw(x.dtype(), &shape, y_t.as_bytes_mut().as_mut_ptr()),
                        Out::from_raw(DType::Bool, &shape, m_t.as_bytes_mut().as_mut_ptr()),
                    ]
                };
                let ins = [Some(In::of(&x)), Some(In::of(&ratio_t)), Some(In::of(&training))];
                dropout(&node, &ins, &mut outs, &mut CpuCtx::new(42)).unwrap_or_else(|e| panic!("{e}"));
                let key = CpuCtx::new(42).rng.next_key();
                let mask = mask(n, key, ratio_t.to_f64_vec()[0]);
                assert_eq!(m_t.as_bytes(), &mask[..], "n {n}, f64 {f64s}: mask");
                let scale = 1.0 / (1.0 - ratio_t.to_f64_vec()[0]);
                let y = y_t.to_f64_vec();
                for (i, (&v, &m)) in xs.iter().zip(&mask).enumerate() {
                    let want = if m == 0 {
                        0.0
                    } else if f64s {
                        v * scale
                    } else {
                        (v as f32 * scale as f32) as f64
                    };
                    assert_eq!(y[i], want, "n {n}, f64 {f64s}: element {i}");
                }
                let dy = x.clone();
                let dx = run("DropoutGrad", Attrs::default(), &[&dy, &m_t, &ratio_t, &training]);
                assert_eq!(dx[0].to_f64_vec(), y, "n {n}, f64 {f64s}: the gradient masks and scales as the forward");
            }
        }
    }

    /// DropoutAdd's gradient for a 16-bit x: DropoutGrad with its `dropped_type` gives, from an
    /// f32 dy, exactly the Cast to x's type followed by the plain DropoutGrad (dy rounded first,
    /// then the product rounded), and from a dy of that type the plain one; any other dy or code
    /// is an error naming the attribute.
    #[test]
    fn dropout_grad_with_a_dropped_type_is_the_cast_then_the_gradient() {
        use super::super::testutil::{run, try_run};
        use crate::ir::{Attr, Attrs};
        use crate::ops::random::DROPPED_TYPE;
        use crate::tensor::{DType, Data, Tensor};
        let n = 3 * DROPOUT_CHUNK + 5;
        // values between 16-bit neighbours, so that rounding dy first shows
        let dy: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618_034).sin() * (1.0 + 1.0 / 3.0)).collect();
        let dy32 = Tensor::from_f32(vec![n], dy);
        let m = Tensor::new(vec![n], Data::Bool((0..n).map(|i| (i % 3 != 0) as u8).collect())).unwrap_or_else(|e| panic!("{e}"));
        let (ratio, training) = (Tensor::scalar_f32(0.1), Tensor::new(vec![], Data::Bool(vec![1])).unwrap_or_else(|e| panic!("{e}")));
        for t in [DType::BF16, DType::F16] {
            let attrs = Attrs::default().with(DROPPED_TYPE, Attr::Int(t.onnx_code() as i64));
            let to = Attrs::default().with("to", Attr::Int(t.onnx_code() as i64));
            let dy_t = run("Cast", to, &[&dy32]).remove(0);
            let want = run("DropoutGrad", Attrs::default(), &[&dy_t, &m, &ratio, &training]).remove(0);
            let got = run("DropoutGrad", attrs.clone(), &[&dy32, &m, &ratio, &training]).remove(0);
            assert_eq!(got.dtype(), t);
            assert_eq!(got.as_bytes(), want.as_bytes(), "{t:?}: from f32 dy");
            // rounding only the product (dy unrounded) would differ: the test can fail
            let once: Vec<f32> =
                dy32.to_f64_vec().iter().zip(m.as_bytes()).map(|(&d, &k)| if k != 0 { d as f32 / 0.9 } else { 0.0 }).collect();
            let once =
                run("Cast", Attrs::default().with("to", Attr::Int(t.onnx_code() as i64)), &[&Tensor::from_f32(vec![n], once)]).remove(0);
            assert_ne!(got.as_bytes(), once.as_bytes(), "{t:?}: dy must be rounded before the product");
            let same = run("DropoutGrad", attrs.clone(), &[&dy_t, &m, &ratio, &training]).remove(0);
            assert_eq!(same.as_bytes(), want.as_bytes(), "{t:?}: from dy of that type");
            let dy64 = Tensor::new(vec![n], Data::F64(dy32.to_f64_vec())).unwrap_or_else(|e| panic!("{e}"));
            let err = try_run("DropoutGrad", attrs, &[&dy64, &m, &ratio, &training]).expect_err("f64 dy refused").to_string();
            assert!(err.contains(DROPPED_TYPE) && err.contains("F64"), "{err}");
        }
        let bad = Attrs::default().with(DROPPED_TYPE, Attr::Int(DType::F32.onnx_code() as i64));
        let err = try_run("DropoutGrad", bad, &[&dy32, &m, &ratio, &training]).expect_err("f32 code refused").to_string();
        assert!(err.contains(DROPPED_TYPE), "{err}");
    }
}
