//! CPU kernels of ops/activation.rs.

use rayon::prelude::*;

use super::broadcast::{map1, map2};
use super::elementwise::{ab, first, FloatElem};
use super::tensor_view::{In, Out};
use super::vmath;
use super::{CpuCtx, KernelTable};
use crate::error::Result;
use crate::ir::Node;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

fn params(node: &Node) -> Result<(f64, f64, bool)> {
    let alpha = node.attrs.float("alpha", if node.op_type.starts_with("HardSigmoid") { 0.2 } else { 0.01 })? as f64;
    let beta = node.attrs.float("beta", 0.5)? as f64;
    let tanh = node.attrs.string("approximate", "none")? == "tanh";
    Ok((alpha, beta, tanh))
}

/// An f32 activation by its vectorised kernel (vmath.rs: libm's tanh and exp are scalar, ~20 ns
/// an element), in parallel by blocks.
fn f32_blocks(x: &In, o: &mut Out, kernel: fn(&mut [f32], &[f32])) -> Result<()> {
    const BLOCK: usize = 1 << 14;
    let xs = x.slice::<f32>()?;
    o.slice::<f32>()?.par_chunks_mut(BLOCK).zip(xs.par_chunks(BLOCK)).for_each(|(o, x)| kernel(o, x));
    Ok(())
}

/// GELU's tanh approximation over f32 runs, by blocks of `SUB` elements: the tanh argument
/// √(2/π)·(x + 0.044715·x³) into a buffer, then the vectorised tanh, then `finish(i, t)` per
/// element (the loops around the tanh auto-vectorise).
fn gelu_tanh_blocks(x: &[f32], o: &mut [f32], finish: impl Fn(usize, f32, f32) -> f32 + Sync) {
    const BLOCK: usize = 1 << 14;
    const SUB: usize = 1024;
    let (k, c) = (SQRT_2_OVER_PI as f32, 0.044715f32);
    o.par_chunks_mut(BLOCK).zip(x.par_chunks(BLOCK)).enumerate().for_each(|(b, (o, x))| {
        let (mut u, mut t) = ([0f32; SUB], [0f32; SUB]);
        for (s, (o, x)) in o.chunks_mut(SUB).zip(x.chunks(SUB)).enumerate() {
            let n = x.len();
            for (u, &v) in u[..n].iter_mut().zip(x) {
                *u = k * (v + c * v * v * v);
            }
            vmath::tanh_slice::call(&mut t[..n], &u[..n]);
            let at = b * BLOCK + s * SUB;
            for (i, (o, (&v, &t))) in o.iter_mut().zip(x.iter().zip(&t[..n])).enumerate() {
                *o = finish(at + i, v, t);
            }
        }
    });
}

/// y = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
fn gelu_tanh_f32(x: &[f32], y: &mut [f32]) {
    gelu_tanh_blocks(x, y, |_, v, t| 0.5 * v * (1.0 + t));
}

/// dx = dy·(0.5·(1 + t) + 0.5·x·(1 - t²)·√(2/π)·(1 + 3·0.044715·x²)), t the forward's tanh.
fn gelu_tanh_grad_f32(dy: &[f32], x: &[f32], dx: &mut [f32]) {
    let (k, c3) = (SQRT_2_OVER_PI as f32, 3.0 * 0.044715f32);
    gelu_tanh_blocks(x, dx, |i, x, t| dy[i] * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + c3 * x * x)));
}

/// The derivative of the tanh-approximated GELU at x.
fn gelu_tanh_slope<T: FloatElem>(x: T) -> T {
    let (one, half) = (T::one(), T::from_f64(0.5));
    let (k, c, c3) = (T::from_f64(SQRT_2_OVER_PI), T::from_f64(0.044715), T::from_f64(3.0 * 0.044715));
    let t = (k * (x + c * x * x * x)).tanh();
    half * (one + t) + half * x * (one - t * t) * k * (one + c3 * x * x)
}

/// dx ← GeluGrad(dx, x) with the tanh approximation, in place: the second half of
/// MatMulGeluGrad (backend/cpu/matmul.rs), dx holding the product.
pub(super) fn gelu_tanh_grad_in_place(node: &Node, x: &In, dx: &mut Out) -> Result<()> {
    if x.dtype == crate::tensor::DType::F32 {
        let d = dx.slice::<f32>()?;
        let product = d.to_vec();
        gelu_tanh_grad_f32(&product, x.slice::<f32>()?, d);
        return Ok(());
    }
    fn go<T: FloatElem>(x: &In, dx: &mut Out) -> Result<()> {
        for (d, &x) in dx.slice::<T>()?.iter_mut().zip(x.slice::<T>()?) {
            *d = *d * gelu_tanh_slope(x);
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, dx))
}

/// o ← GELU(x) with the tanh approximation: Gelu's kernel, and a Linear's GELU
/// (backend/cpu/linear.rs).
pub(super) fn gelu_tanh(node: &Node, x: &In, o: &mut Out) -> Result<()> {
    if x.dtype == crate::tensor::DType::F32 {
        gelu_tanh_f32(x.slice::<f32>()?, o.slice::<f32>()?);
        return Ok(());
    }
    fn go<T: FloatElem>(x: &In, o: &mut Out) -> Result<()> {
        let (k, c, one, half) = (T::from_f64(SQRT_2_OVER_PI), T::from_f64(0.044715), T::one(), T::from_f64(0.5));
        map1::<T, T>(x, o, move |v| half * v * (one + (k * (v + c * v * v * v)).tanh()))
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, o))
}

fn forward(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let x = first(node, inputs)?;
    let (alpha, beta, tanh) = params(node)?;
    fn go<T: FloatElem>(op: &str, x: &In, o: &mut Out, alpha: f64, beta: f64) -> Result<()> {
        let (a, b) = (T::from_f64(alpha), T::from_f64(beta));
        let (zero, one, half) = (T::zero(), T::one(), T::from_f64(0.5));
        match op {
            "Relu" => map1::<T, T>(x, o, |v| if v > zero { v } else { zero }),
            "LeakyRelu" => map1::<T, T>(x, o, move |v| if v >= zero { v } else { a * v }),
            "Tanh" if x.dtype == crate::tensor::DType::F32 => f32_blocks(x, o, vmath::tanh_slice::call),
            "Tanh" => map1::<T, T>(x, o, |v| v.tanh()),
            "Sigmoid" if x.dtype == crate::tensor::DType::F32 => f32_blocks(x, o, vmath::sigmoid_slice::call),
            "Sigmoid" => map1::<T, T>(x, o, move |v| one / (one + (-v).exp())),
            // the tanh approximation is `gelu_tanh`
            "Gelu" => {
                let r = T::from_f64(std::f64::consts::FRAC_1_SQRT_2);
                map1::<T, T>(x, o, move |v| half * v * (one + (v * r).erf()))
            }
            "Softplus" => map1::<T, T>(x, o, move |v| if v > T::from_f64(20.0) { v } else { (one + v.exp()).ln() }),
            "HardSigmoid" => map1::<T, T>(x, o, move |v| (a * v + b).max(zero).min(one)),
            _ => {
                let s = T::from_f64(1.0 / 6.0);
                map1::<T, T>(x, o, move |v| v * (v * s + half).max(zero).min(one))
            }
        }
    }
    let op = node.op_type.as_str();
    if op == "Gelu" && tanh {
        return gelu_tanh(node, x, &mut out[0]);
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(op, x, &mut out[0], alpha, beta))
}

fn backward(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let (dy, s) = ab(node, inputs)?;
    let (alpha, beta, tanh) = params(node)?;
    fn go<T: FloatElem>(op: &str, dy: &In, s: &In, o: &mut Out, alpha: f64, beta: f64, tanh: bool) -> Result<()> {
        let (a, b) = (T::from_f64(alpha), T::from_f64(beta));
        let (zero, one, half) = (T::zero(), T::one(), T::from_f64(0.5));
        match op {
            "ReluGrad" => map2::<T, T, T>(dy, s, o, |d, y| if y > zero { d } else { zero }),
            "LeakyReluGrad" => map2::<T, T, T>(dy, s, o, move |d, x| if x >= zero { d } else { a * d }),
            "TanhGrad" => map2::<T, T, T>(dy, s, o, move |d, y| d * (one - y * y)),
            "SigmoidGrad" => map2::<T, T, T>(dy, s, o, move |d, y| d * y * (one - y)),
            "GeluGrad" if tanh => map2::<T, T, T>(dy, s, o, |d, x| d * gelu_tanh_slope(x)),
            "GeluGrad" => {
                let r = T::from_f64(std::f64::consts::FRAC_1_SQRT_2);
                let p = T::from_f64(1.0 / (2.0 * std::f64::consts::PI).sqrt());
                map2::<T, T, T>(dy, s, o, move |d, x| d * (half * (one + (x * r).erf()) + x * p * (-(x * x) * half).exp()))
            }
            "SoftplusGrad" => map2::<T, T, T>(dy, s, o, move |d, x| d / (one + (-x).exp())),
            "HardSigmoidGrad" => map2::<T, T, T>(dy, s, o, move |d, x| {
                let v = a * x + b;
                if v > zero && v < one {
                    d * a
                } else {
                    zero
                }
            }),
            _ => {
                let three = T::from_f64(3.0);
                let third = T::from_f64(1.0 / 3.0);
                map2::<T, T, T>(dy, s, o, move |d, x| {
                    if x < -three {
                        zero
                    } else if x > three {
                        d
                    } else {
                        d * (x * third + half)
                    }
                })
            }
        }
    }
    let op = node.op_type.as_str();
    if op == "GeluGrad" && tanh && dy.dtype == crate::tensor::DType::F32 && s.dtype == dy.dtype && s.shape == dy.shape {
        gelu_tanh_grad_f32(dy.slice::<f32>()?, s.slice::<f32>()?, out[0].slice::<f32>()?);
        return Ok(());
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(op, dy, s, &mut out[0], alpha, beta, tanh))
}

pub fn register(t: &mut KernelTable) {
    for op in ["Relu", "LeakyRelu", "Tanh", "Sigmoid", "Gelu", "Softplus", "HardSigmoid", "HardSwish"] {
        t.add(op, forward);
    }
    for op in ["ReluGrad", "LeakyReluGrad", "TanhGrad", "SigmoidGrad", "GeluGrad", "SoftplusGrad", "HardSigmoidGrad", "HardSwishGrad"] {
        t.add(op, backward);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised f32 GELU-tanh and its gradient against the formula in f64, over more than
    /// one block (a partial last sub-block included) and arguments where tanh saturates.
    #[test]
    fn gelu_tanh_f32_matches_the_formula() {
        let n = (1 << 14) + 1000 + 7;
        let x: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.3711).sin() * 7.0).collect();
        let dy: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.917).cos()).collect();
        let (mut y, mut dx) = (vec![0f32; n], vec![0f32; n]);
        gelu_tanh_f32(&x, &mut y);
        gelu_tanh_grad_f32(&dy, &x, &mut dx);
        for i in 0..n {
            let v = x[i] as f64;
            let t = (SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)).tanh();
            let want_y = 0.5 * v * (1.0 + t);
            let want_dx = dy[i] as f64 * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v));
            assert!((y[i] as f64 - want_y).abs() <= 1e-6 * (1.0 + want_y.abs()), "y at {i} (x {v}): {} vs {want_y}", y[i]);
            assert!((dx[i] as f64 - want_dx).abs() <= 2e-6 * (1.0 + want_dx.abs()), "dx at {i} (x {v}): {} vs {want_dx}", dx[i]);
        }
    }
}
