//! Python entry points of engine::optim: fused Adam/AdamW and SGD steps over lists of
//! parameter tensors given by address, and the global gradient norm and scaling of clipping.

use ortrain_engine::optim::{self, AdamHyper, LambHyper, SgdHyper};
use pyo3::prelude::*;

#[derive(Clone, Copy)]
struct Addr(usize);
// SAFETY: plain integers; the Python caller keeps the tensors alive for the call.
unsafe impl Send for Addr {}

/// # Safety
/// `a` must address `n` f32 values valid for writes, not aliased during the call.
unsafe fn f32s<'a>(a: Addr, n: usize) -> &'a mut [f32] {
    // SAFETY: forwarded from the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(a.0 as *mut f32, n) }
}

/// (param, grad, first moment, second moment, numel, step) as addresses that may cross threads.
fn moment_tensors(tensors: Vec<(usize, usize, usize, usize, usize, u64)>) -> Vec<(Addr, Addr, Addr, Addr, usize, u64)> {
    tensors.into_iter().map(|(p, g, m, v, n, s)| (Addr(p), Addr(g), Addr(m), Addr(v), n, s)).collect()
}

/// Adam/AdamW over tensors given as (param, grad, exp_avg, exp_avg_sq, numel, step), all in one
/// parallel pass. `fresh[i]` (optional, one flag per tensor): the moments were just created for
/// this first update and may be uninitialised memory; they are written as if they had been
/// zeros. `keep[i]` (optional, an address or 0): numel f32 that receive the parameter's values
/// from before the update.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (tensors, lr, beta1, beta2, eps, weight_decay, decoupled, maximize, fresh=None, keep=None))]
fn adam_step(
    py: Python<'_>,
    tensors: Vec<(usize, usize, usize, usize, usize, u64)>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    decoupled: bool,
    maximize: bool,
    fresh: Option<Vec<bool>>,
    keep: Option<Vec<usize>>,
) -> PyResult<()> {
    let fresh = fresh.unwrap_or_else(|| vec![false; tensors.len()]);
    let keep: Vec<Addr> = keep.unwrap_or_else(|| vec![0; tensors.len()]).into_iter().map(Addr).collect();
    if fresh.len() != tensors.len() || keep.len() != tensors.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "adam_step: {} fresh flags and {} keep addresses for {} tensors",
            fresh.len(),
            keep.len(),
            tensors.len()
        )));
    }
    let t = moment_tensors(tensors);
    py.detach(move || {
        let all = t
            .into_iter()
            .zip(fresh)
            .zip(keep)
            .map(|(((p, g, m, v, n, step), from_zero), k)| {
                let h = AdamHyper { lr, beta1, beta2, eps, weight_decay, decoupled, maximize, step };
                // SAFETY: the caller passes distinct live f32 tensors of n elements each, and
                // keep addresses (0 for none) of n f32 each, distinct from all of them.
                let (p, g, m, v) = unsafe { (f32s(p, n), f32s(g, n), f32s(m, n), f32s(v, n)) };
                // SAFETY: as above.
                let keep = (k.0 != 0).then(|| unsafe { f32s(k, n) });
                optim::AdamTensor { p, g, m, v, h, from_zero, keep }
            })
            .collect();
        // all tensors' chunks in one parallel pass
        optim::adam_many(all);
    });
    Ok(())
}

/// SGD over tensors given as (param, grad, momentum_buffer or 0, numel, first_step).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sgd_step(
    py: Python<'_>,
    tensors: Vec<(usize, usize, usize, usize, bool)>,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: bool,
    maximize: bool,
) {
    let t: Vec<(Addr, Addr, Addr, usize, bool)> = tensors.into_iter().map(|(p, g, b, n, f)| (Addr(p), Addr(g), Addr(b), n, f)).collect();
    py.detach(move || {
        let h = SgdHyper { lr, momentum, dampening, weight_decay, nesterov, maximize };
        for (p, g, b, n, first) in t {
            // SAFETY: the caller passes distinct live f32 tensors of n elements each (b may be 0).
            unsafe {
                let buf = if b.0 == 0 { None } else { Some(f32s(b, n)) };
                optim::sgd(f32s(p, n), f32s(g, n), buf, first, &h);
            }
        }
    });
}

/// LAMB over tensors given as (param, grad, exp_avg, exp_avg_sq, numel, step).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn lamb_step(
    py: Python<'_>,
    tensors: Vec<(usize, usize, usize, usize, usize, u64)>,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    bias_correction: bool,
    ratio_min: f32,
    ratio_max: f32,
) {
    let t = moment_tensors(tensors);
    py.detach(move || {
        for (p, g, m, v, n, step) in t {
            let h = LambHyper { lr, beta1, beta2, eps, weight_decay, bias_correction, ratio_min, ratio_max, step };
            // SAFETY: the caller passes distinct live f32 tensors of n elements each.
            unsafe { optim::lamb(f32s(p, n), f32s(g, n), f32s(m, n), f32s(v, n), &h) };
        }
    });
}

/// f32 tensors given as (address, numel) as addresses that may cross threads.
fn addressed(tensors: Vec<(usize, usize)>) -> Vec<(Addr, usize)> {
    tensors.into_iter().map(|(a, n)| (Addr(a), n)).collect()
}

/// The L2 norm of f32 tensors given as (address, numel), seen as one vector, as
/// torch.nn.utils.clip_grad_norm_ computes it (each tensor's norm as an f32, then the norm of
/// those), in one parallel pass over all of them.
#[pyfunction]
fn global_norm(py: Python<'_>, tensors: Vec<(usize, usize)>) -> f32 {
    let t = addressed(tensors);
    py.detach(move || {
        // SAFETY: the caller passes live f32 tensors of n elements (only read here).
        let views: Vec<&[f32]> = t.into_iter().map(|(a, n)| &*unsafe { f32s(a, n) }).collect();
        optim::global_norm(&views)
    })
}

/// Scales f32 tensors given as (address, numel) in place, in one parallel pass.
#[pyfunction]
fn scale(py: Python<'_>, tensors: Vec<(usize, usize)>, factor: f32) {
    let t = addressed(tensors);
    py.detach(move || {
        // SAFETY: the caller passes distinct live f32 tensors of n elements.
        let views: Vec<&mut [f32]> = t.into_iter().map(|(a, n)| unsafe { f32s(a, n) }).collect();
        optim::scale_many(views, factor)
    });
}

/// torch.nn.utils.clip_grad_norm_ (L2) over f32 tensors given as (address, numel): their global
/// norm, then each scaled in place by torch's coefficient (optim::clip_coefficient) unless it is
/// exactly 1 (a product by 1 changes no value) or, with `skip_nonfinite`, the norm is not finite.
/// One call: the norm and the scaling without a return to Python between them. Returns the norm.
#[pyfunction]
fn clip_by_global_norm(py: Python<'_>, tensors: Vec<(usize, usize)>, max_norm: f64, skip_nonfinite: bool) -> f32 {
    let t = addressed(tensors);
    py.detach(move || {
        let total = {
            // SAFETY: the caller passes live f32 tensors of n elements (only read in this block).
            let views: Vec<&[f32]> = t.iter().map(|&(a, n)| &*unsafe { f32s(a, n) }).collect();
            optim::global_norm(&views)
        };
        let coef = optim::clip_coefficient(total, max_norm);
        if coef != 1.0 && (!skip_nonfinite || total.is_finite()) {
            // SAFETY: as above, distinct tensors; the read views are gone.
            let views: Vec<&mut [f32]> = t.into_iter().map(|(a, n)| unsafe { f32s(a, n) }).collect();
            optim::scale_many(views, coef);
        }
        total
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(clip_by_global_norm, m)?)?;
    m.add_function(wrap_pyfunction!(sgd_step, m)?)?;
    m.add_function(wrap_pyfunction!(lamb_step, m)?)?;
    m.add_function(wrap_pyfunction!(global_norm, m)?)?;
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    Ok(())
}
