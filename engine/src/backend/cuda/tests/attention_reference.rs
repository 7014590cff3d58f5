//! The f64 reference the attention kernel tests (flash_attention.rs, key_padding_attention.rs,
//! attention_dropout.rs) check against: the unfused graph's arithmetic (scores plus the mask,
//! softmax, the probabilities' dropout, its gradient), and their error measure.

/// Sizes of an attention test in layout BSHD: batch, heads, queries, keys, head size.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub b: usize,
    pub h: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
}

/// An f64 reference of the unfused attention on BSHD tensors (Q and dO [b, t, h, d], K and V
/// [b, s, h, d]): O, LSE [b, h, t], dQ, dK, dV of softmax(scale · Q·Kᵀ + M) with M at (batch row,
/// query, key) `mask(bi, i, j)` (-inf: a key the query does not see), and its gradient.
pub fn attention_reference(n: AttnDims, scale: f64, ins: [&[f64]; 4], mask: impl Fn(usize, usize, usize) -> f64) -> [Vec<f64>; 5] {
    attention_reference_dropped(n, scale, ins, mask, |_, _, _| 1.0)
}

/// The same with the probabilities' dropout: probability (query i, key j) of head matrix
/// bh = batch row · h + head multiplied by `keep(bh, i, j)` (0, or 1 / (1 − ratio) where kept)
/// before the product with V: O = (P∘Z)·V, dV = (P∘Z)ᵀ·dO, dS = P∘(Z∘dP − Σ dO·O).
pub fn attention_reference_dropped(
    n: AttnDims,
    scale: f64,
    [q, k, v, dout]: [&[f64]; 4],
    mask: impl Fn(usize, usize, usize) -> f64,
    keep: impl Fn(usize, usize, usize) -> f64,
) -> [Vec<f64>; 5] {
    let AttnDims { b, h, t, s, d } = n;
    let (mut o, mut lse, mut dq, mut dk, mut dv) =
        (vec![0.0; q.len()], vec![0.0; b * h * t], vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let row = |bi: usize, i: usize, hi: usize, rows: usize| ((bi * rows + i) * h + hi) * d;
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..t {
                let qi = row(bi, i, hi, t);
                let x: Vec<f64> =
                    (0..s).map(|j| scale * (0..d).map(|e| q[qi + e] * k[row(bi, j, hi, s) + e]).sum::<f64>() + mask(bi, i, j)).collect();
                let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = x.iter().map(|z| (z - m).exp()).sum();
                let p: Vec<f64> = x.iter().map(|z| (z - m).exp() / sum).collect();
                lse[(bi * h + hi) * t + i] = m + sum.ln();
                let z: Vec<f64> = (0..s).map(|j| keep(bi * h + hi, i, j)).collect();
                for (j, &pj) in p.iter().enumerate() {
                    for e in 0..d {
                        o[qi + e] += pj * z[j] * v[row(bi, j, hi, s) + e];
                    }
                }
                let delta: f64 = (0..d).map(|e| dout[qi + e] * o[qi + e]).sum();
                for (j, &pj) in p.iter().enumerate() {
                    let kj = row(bi, j, hi, s);
                    let dp: f64 = (0..d).map(|e| dout[qi + e] * v[kj + e]).sum();
                    let ds = pj * (z[j] * dp - delta);
                    for e in 0..d {
                        dq[qi + e] += scale * ds * k[kj + e];
                        dk[kj + e] += scale * ds * q[qi + e];
                        dv[kj + e] += pj * z[j] * dout[qi + e];
                    }
                }
            }
        }
    }
    [o, lse, dq, dk, dv]
}

/// The largest error over the largest reference value (a non-finite result: infinite).
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let err = got.iter().zip(want).fold(0.0f64, |m, (g, w)| if g.is_finite() { m.max((g - w).abs()) } else { f64::INFINITY });
    err / super::support::max_abs(want).max(1e-30)
}
