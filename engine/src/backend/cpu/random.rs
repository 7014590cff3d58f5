//! CPU kernels of ops/random.rs, and the counter-based random stream they draw from: element i
//! of a draw is a hash of (seed, draw counter, i), so parallel kernels are deterministic.

use rayon::prelude::*;

use super::elementwise::{first, FloatElem};
use super::tensor_view::{In, Out};
use super::{CpuCtx, KernelTable, PAR_MIN};
use crate::error::Result;
use crate::ir::Node;

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

/// Uniform in [0, 1) for element `i` of the stream `key`.
#[inline]
pub fn uniform(key: u64, i: u64) -> f64 {
    (splitmix(key ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

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
    let x = first(node, inputs)?;
    let (ratio, training) = dropout_params(node, inputs, 1)?;
    let key = ctx.rng.next_key();
    fn go<T: FloatElem>(x: &In, out: &mut [Out], ratio: f64, training: bool, key: u64) -> Result<()> {
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
        let scale = T::from_f64(1.0 / (1.0 - ratio));
        let body = |(i, ((y, m), &v)): (usize, ((&mut T, &mut u8), &T))| {
            let keep = uniform(key, i as u64) >= ratio;
            *m = keep as u8;
            *y = if keep { v * scale } else { T::zero() };
        };
        if xv.len() >= PAR_MIN {
            yv.par_iter_mut().zip(mv.par_iter_mut()).zip(xv.par_iter()).enumerate().for_each(body);
        } else {
            yv.iter_mut().zip(mv.iter_mut()).zip(xv.iter()).enumerate().for_each(body);
        }
        Ok(())
    }
    crate::dispatch_float!(x.dtype, node, go::<T>(x, out, ratio, training, key))
}

fn dropout_grad(node: &Node, inputs: &[Option<In>], out: &mut [Out], _: &mut CpuCtx) -> Result<()> {
    let dy = first(node, inputs)?;
    let mask = inputs.get(1).and_then(|x| x.as_ref()).ok_or_else(|| node.err("mask missing"))?;
    let (ratio, training) = dropout_params(node, inputs, 2)?;
    let scale = if training { 1.0 / (1.0 - ratio) } else { 1.0 };
    fn go<T: FloatElem>(dy: &In, mask: &In, o: &mut Out, scale: f64) -> Result<()> {
        let s = T::from_f64(scale);
        super::broadcast::map2::<T, u8, T>(dy, mask, o, move |d, m| if m != 0 { d * s } else { T::zero() })
    }
    crate::dispatch_float!(dy.dtype, node, go::<T>(dy, mask, &mut out[0], scale))
}

pub fn register(t: &mut KernelTable) {
    t.add("Dropout", dropout);
    t.add("DropoutGrad", dropout_grad);
}
