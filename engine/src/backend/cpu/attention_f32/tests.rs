//! The fast f32 kernels against the f64 reference (backend/cpu/attention.rs) and what the
//! dropout does.

use super::super::testutil::{data, try_run_opt};
use super::super::CpuCtx;
use crate::ir::{Attr, Attrs};
use crate::tensor::{Data, Tensor};

/// Values in [-1, 1) from a fixed sequence (f32 values: both runs see the same).
fn noise(n: usize, seed: u64) -> Vec<f64> {
    data(n, seed).into_iter().map(f64::from).collect()
}

fn f32_of(shape: &[usize], v: &[f64]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), v.iter().map(|&x| x as f32).collect())
}

fn f64_of(shape: &[usize], v: &[f64]) -> Tensor {
    // through f32 first: both runs see the same values
    Tensor::new(shape.to_vec(), Data::F64(v.iter().map(|&x| x as f32 as f64).collect())).expect("f64 tensor")
}

/// One case: the shapes of Q, Kt (or K), V, the mask and the key padding, and the node's
/// attributes.
struct Case {
    name: &'static str,
    q: Vec<usize>,
    kt: Vec<usize>,
    v: Vec<usize>,
    mask: Option<(Vec<usize>, Vec<f64>)>,
    kp: Option<Tensor>,
    attrs: Attrs,
    /// The dropout's stream key (with attribute `dropout`).
    key: Option<i64>,
}

/// `ins` with the key padding (or its absence) and the dropout key appended.
fn extra<'t>(mut ins: Vec<Option<&'t Tensor>>, kp: Option<&'t Tensor>, key: Option<&'t Tensor>) -> Vec<Option<&'t Tensor>> {
    if kp.is_some() || key.is_some() {
        ins.push(kp);
    }
    if key.is_some() {
        ins.push(key);
    }
    ins
}

fn run(op: &str, attrs: &Attrs, ins: &[Option<&Tensor>]) -> Vec<Vec<f64>> {
    let out = try_run_opt(op, attrs.clone(), ins, &mut CpuCtx::new(0)).unwrap_or_else(|e| panic!("{op}: {e}"));
    out.iter().map(|t| t.to_f64_vec()).collect()
}

fn close(case: &str, what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{case}: {what} sizes");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{case}: {what}[{i}] is {g}, the f64 reference {w}");
    }
}

/// The f32 kernels against the f64 reference on the same (f32-representable) inputs: O, LSE
/// and the three gradients.
fn check(c: &Case) {
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let (q, kt, v) = (noise(numel(&c.q), 1), noise(numel(&c.kt), 2), noise(numel(&c.v), 3));
    let (m32, m64) = match &c.mask {
        Some((shape, values)) => (Some(f32_of(shape, values)), Some(f64_of(shape, values))),
        None => (None, None),
    };
    let t32 = [f32_of(&c.q, &q), f32_of(&c.kt, &kt), f32_of(&c.v, &v)];
    let t64 = [f64_of(&c.q, &q), f64_of(&c.kt, &kt), f64_of(&c.v, &v)];
    let key = c.key.map(|k| Tensor::from_i64(vec![1], vec![k]));
    let with = |t: &[Tensor; 3], m: &Option<Tensor>| -> Vec<Vec<f64>> {
        let ins = extra(vec![Some(&t[0]), Some(&t[1]), Some(&t[2]), m.as_ref()], c.kp.as_ref(), key.as_ref());
        run("Attention", &c.attrs, &ins)
    };
    let (f, r) = (with(&t32, &m32), with(&t64, &m64));
    close(c.name, "O", &f[0], &r[0], 2e-5);
    close(c.name, "LSE", &f[1], &r[1], 2e-5);
    let o_shape: Vec<usize> = if c.attrs.string("layout", "BHSD").expect("layout") == "BSHD" {
        vec![c.q[0], c.q[1], c.q[2], c.v[3]]
    } else {
        let mut s = c.q[..c.q.len() - 1].to_vec();
        s.push(*c.v.last().expect("V's rank"));
        s
    };
    let lse_shape: Vec<usize> = if o_shape.len() == 4 && c.attrs.string("layout", "BHSD").expect("layout") == "BSHD" {
        vec![c.q[0], c.q[2], c.q[1]]
    } else {
        c.q[..c.q.len() - 1].to_vec()
    };
    let dout = noise(numel(&o_shape), 4);
    let grads = |t: &[Tensor; 3], m: &Option<Tensor>, fwd: &[Vec<f64>], f32s: bool| -> Vec<Vec<f64>> {
        let make = |s: &[usize], v: &[f64]| if f32s { f32_of(s, v) } else { f64_of(s, v) };
        let (d, o) = (make(&o_shape, &dout), make(&o_shape, &fwd[0]));
        let lse = f32_of(&lse_shape, &fwd[1]);
        let ins = vec![Some(&d), Some(&t[0]), Some(&t[1]), Some(&t[2]), m.as_ref(), Some(&o), Some(&lse)];
        run("AttentionGrad", &c.attrs, &extra(ins, c.kp.as_ref(), key.as_ref()))
    };
    // both from the f32 forward's O and LSE, so that only the gradients' arithmetic differs
    let (gf, gr) = (grads(&t32, &m32, &f, true), grads(&t64, &m64, &f, false));
    for (i, what) in ["dQ", "dKt", "dV"].iter().enumerate() {
        close(c.name, what, &gf[i], &gr[i], 1e-4);
    }
}

fn causal(t: usize, s: usize, hide: f64) -> Vec<f64> {
    (0..t * s).map(|i| if i % s > i / s { hide } else { 0.0 }).collect()
}

/// Batch 2 × 2 heads of 140 queries and keys of 8 under the causal finfo.min mask, key
/// padding keeping the flat flags `kept` of the 2 × 140 keys (finfo.min for the others), with
/// `attrs` and the dropout's `key`.
fn padded_causal(name: &'static str, kept: std::ops::Range<usize>, attrs: Attrs, key: Option<i64>) -> Case {
    let flags: Vec<u8> = (0..2 * 140).map(|i| u8::from(kept.contains(&i))).collect();
    Case {
        name,
        q: vec![2, 2, 140, 8],
        kt: vec![2, 2, 8, 140],
        v: vec![2, 2, 140, 8],
        mask: Some((vec![1, 1, 140, 140], causal(140, 140, f32::MIN as f64))),
        kp: Some(Tensor::new(vec![2, 1, 1, 140], Data::Bool(flags)).expect("flags")),
        attrs: attrs.with("padding_value", Attr::Float(f32::MIN)),
        key,
    }
}

fn attrs(scale: f32, guard: bool) -> Attrs {
    Attrs::default().with("scale", Attr::Float(scale)).with("nan_guard", Attr::Int(guard as i64))
}

#[test]
fn blocks_match_the_f64_reference_with_and_without_masks() {
    let fmin = f32::MIN as f64;
    check(&Case {
        name: "no mask, 129 rows, K and V shared by the heads",
        q: vec![2, 3, 129, 16],
        kt: vec![2, 1, 16, 129],
        v: vec![2, 1, 129, 8],
        mask: None,
        kp: None,
        attrs: attrs(0.25, false),
        key: None,
    });
    check(&Case {
        name: "causal finfo.min, 150 rows",
        q: vec![2, 2, 150, 16],
        kt: vec![2, 2, 16, 150],
        v: vec![2, 2, 150, 16],
        mask: Some((vec![1, 1, 150, 150], causal(150, 150, fmin))),
        kp: None,
        attrs: attrs(0.25, true),
        key: None,
    });
    // keys 0..5 of batch 0 padded: its queries 0..4 see no key (equal weights over all)
    check(&padded_causal("causal with key padding at both ends", 5..140 + 130, attrs(0.5, true), None));
    // −∞ above the diagonal, row 3 all −∞: NaN without the guard
    let mut m = causal(70, 90, f64::NEG_INFINITY);
    m[3 * 90..4 * 90].iter_mut().for_each(|x| *x = f64::NEG_INFINITY);
    check(&Case {
        name: "−inf mask, 70 queries × 90 keys, a row with no key",
        q: vec![1, 2, 70, 8],
        kt: vec![1, 2, 8, 90],
        v: vec![1, 2, 90, 4],
        mask: Some((vec![70, 90], m)),
        kp: None,
        attrs: attrs(0.3, false),
        key: None,
    });
}

#[test]
fn heads_inside_the_rows_read_in_place() {
    // BSHD: Q [B, T, H, D], K [B, S, H, D]; a per-batch mask of finite and hidden values
    let (b, t, s, h, d) = (2, 100, 120, 3, 8);
    let mask: Vec<f64> = noise(b * t * s, 9).iter().map(|&x| if x > 0.6 { f32::MIN as f64 } else { x * 4.0 }).collect();
    check(&Case {
        name: "BSHD",
        q: vec![b, t, h, d],
        kt: vec![b, s, h, d],
        v: vec![b, s, h, d],
        mask: Some((vec![b, 1, t, s], mask)),
        kp: None,
        attrs: attrs(0.35, true).with("layout", Attr::String("BSHD".into())),
        key: None,
    });
}

/// A dropout on the probabilities: the fast kernels keep and scale what the reference does,
/// forward and backward, in BHSD with a causal mask and key padding and in BSHD.
#[test]
fn dropout_blocks_match_the_f64_reference() {
    let with_dropout = attrs(0.5, true).with("dropout", Attr::Float(0.2));
    check(&padded_causal("dropout 0.2, causal finfo.min with key padding", 3..140 + 120, with_dropout, Some(0x1234_5678_9abc_def0)));
    let (b, t, s, h, d) = (2, 70, 90, 3, 8);
    check(&Case {
        name: "dropout 0.5, BSHD",
        q: vec![b, t, h, d],
        kt: vec![b, s, h, d],
        v: vec![b, s, h, d],
        mask: None,
        kp: None,
        attrs: attrs(0.35, false).with("layout", Attr::String("BSHD".into())).with("dropout", Attr::Float(0.5)),
        key: Some(-7),
    });
}

/// What the dropout does, seen through V = I and Q = 0 (every probability 1/S, so O = Z / S):
/// each element kept with probability 1 − r and then scaled by 1/(1 − r), rows and keys
/// differing, another key another mask; ratio 0 or no attribute changes nothing.
#[test]
fn dropout_drops_the_ratio_and_scales_what_it_keeps() {
    let (bh, t, s) = (4, 64, 64);
    let q = Tensor::from_f32(vec![bh, t, 8], vec![0.0; bh * t * 8]);
    let kt = Tensor::from_f32(vec![bh, 8, s], data(bh * 8 * s, 5));
    let v = Tensor::from_f32(vec![bh, s, s], (0..bh * s * s).map(|i| f32::from(i % s == (i / s) % s)).collect());
    let o = |ratio: f32, key: i64| {
        let k = Tensor::from_i64(vec![1], vec![key]);
        let a = attrs(1.0, false).with("dropout", Attr::Float(ratio));
        run("Attention", &a, &[Some(&q), Some(&kt), Some(&v), None, None, Some(&k)]).swap_remove(0)
    };
    let ratio = 0.3;
    let (a, b) = (o(ratio, 11), o(ratio, 12));
    let kept = 1.0 / (1.0 - ratio as f64) / s as f64;
    for x in a.iter().chain(&b) {
        assert!(*x == 0.0 || (x - kept).abs() < 1e-6, "O = Z / S is 0 or 1/((1 - r) S), got {x}");
    }
    let dropped = a.iter().filter(|&&x| x == 0.0).count() as f64 / a.len() as f64;
    assert!((dropped - ratio as f64).abs() < 0.02, "dropped {dropped}, ratio {ratio}");
    let both = a.iter().zip(&b).filter(|(x, y)| **x == 0.0 && **y == 0.0).count() as f64 / a.len() as f64;
    assert!((both - 0.09).abs() < 0.015, "two keys' masks are independent: both drop {both}, expected 0.09");
    assert_ne!(a[..s], a[s..2 * s], "rows get their own masks");
    let plain = run("Attention", &attrs(1.0, false), &[Some(&q), Some(&kt), Some(&v)]).swap_remove(0);
    assert!(plain.iter().all(|x| (x - 1.0 / s as f64).abs() < 1e-6));
    assert_eq!(o(0.0, 11), plain, "ratio 0: no dropout");
}
