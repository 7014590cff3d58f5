//! activation.cu: every activation and its gradient, for every float dtype, against the CPU
//! kernels (engine/src/backend/cpu/activation.rs) run in f64 on the inputs already rounded to
//! the kernel's dtype, the reference then rounded to that dtype.

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::types::FLOATS;
use crate::ir::{Attr, Attrs};

/// One activation: the kernel op, the CPU op, the (alpha, beta) the kernel takes, the CPU
/// attributes that mean the same, and whether the gradient kernel reads the output y (else x).
struct Act {
    op: &'static str,
    cpu: &'static str,
    alpha: f32,
    beta: f32,
    from_output: bool,
}

// alpha 0.1 for LeakyRelu; HardSigmoid with alpha 0.25 (not the default 0.2) so that a*x + b is
// exact and its clamp boundaries (x = ±2, exactly representable in every dtype) take the same
// branch in f32 and in the f64 reference.
const ACTS: &[Act] = &[
    Act { op: "relu", cpu: "Relu", alpha: 0.0, beta: 0.0, from_output: true },
    Act { op: "leaky_relu", cpu: "LeakyRelu", alpha: 0.1, beta: 0.0, from_output: false },
    Act { op: "tanh", cpu: "Tanh", alpha: 0.0, beta: 0.0, from_output: true },
    Act { op: "sigmoid", cpu: "Sigmoid", alpha: 0.0, beta: 0.0, from_output: true },
    Act { op: "gelu", cpu: "Gelu", alpha: 0.0, beta: 0.0, from_output: false },
    Act { op: "gelu_tanh", cpu: "Gelu", alpha: 0.0, beta: 0.0, from_output: false },
    Act { op: "softplus", cpu: "Softplus", alpha: 0.0, beta: 0.0, from_output: false },
    Act { op: "hard_sigmoid", cpu: "HardSigmoid", alpha: 0.25, beta: 0.5, from_output: false },
    Act { op: "hard_swish", cpu: "HardSwish", alpha: 0.0, beta: 0.0, from_output: false },
];

fn attrs(a: &Act) -> Attrs {
    match a.op {
        "leaky_relu" => Attrs::default().with("alpha", Attr::Float(a.alpha)),
        "hard_sigmoid" => Attrs::default().with("alpha", Attr::Float(a.alpha)).with("beta", Attr::Float(a.beta)),
        "gelu_tanh" => Attrs::default().with("approximate", Attr::String("tanh".into())),
        _ => Attrs::default(),
    }
}

/// `<op>_T(const T* x, T* y, i64 n, f32 alpha, f32 beta)`
fn act_args(x: u64, y: u64, n: usize, alpha: f32, beta: f32) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(n as i64), KArg::F32(alpha), KArg::F32(beta)]
}

/// `<op>_grad_T(const T* dy, const T* s, T* dx, i64 n, f32 alpha, f32 beta)`
fn act_grad_args(dy: u64, s: u64, dx: u64, n: usize, alpha: f32, beta: f32) -> Vec<KArg> {
    vec![KArg::Ptr(dy), KArg::Ptr(s), KArg::Ptr(dx), KArg::I64(n as i64), KArg::F32(alpha), KArg::F32(beta)]
}

/// Inputs: the branch points and edges (0, ±3 for HardSwish, ±2 for HardSigmoid, 21 and 25
/// past Softplus's threshold of 20, -6) then uniform values in [-4, 4) (Softplus's f64
/// reference, ln(1 + e^x), loses digits for x far below 0, so the range stops at -6).
fn inputs(rng: &mut Rng, dtype: &str, n: usize) -> Vec<f64> {
    let special = [0.0, 1.0, -1.0, 3.0, -3.0, 2.0, -2.0, 21.0, 25.0, -6.0, 0.5, -0.75];
    let mut x: Vec<f64> = special.iter().map(|&v| round_to(dtype, v)).collect();
    x.extend(rand_as(rng, dtype, n - special.len(), -4.0, 4.0));
    x
}

const N: usize = 4099;

#[test]
fn activation_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for a in ACTS {
        for t in FLOATS {
            let (k, kg) = (format!("{}_{t}", a.op), format!("{}_grad_{t}", a.op));
            check(&k, &act_args(0, 0, N, a.alpha, a.beta));
            check(&kg, &act_grad_args(0, 0, 0, N, a.alpha, a.beta));
            checked.extend([k, kg]);
        }
    }
    assert_covers("activation", &checked);
}

#[test]
fn gpu_activations_and_gradients_match_the_cpu_kernels() {
    let Some(g) = gpu("gpu_activations_and_gradients_match_the_cpu_kernels") else { return };
    let mut rng = Rng::new(11);
    // 4 blocks of 256 threads for 4099 elements: the grid-stride loop runs 5 times (twice over
    // the 16-byte vectors of the 16-bit types, then once over their 3-element tail)
    let grid = Grid::elementwise(N as i64, 4);
    for t in FLOATS {
        let x = inputs(&mut rng, t, N);
        let dy = rand_as(&mut rng, t, N, -2.0, 2.0);
        let (dxb, ddy) = (dev_as(g, t, &x), dev_as(g, t, &dy));
        for a in ACTS {
            // forward
            let k = format!("{}_{t}", a.op);
            let y = zeros_as(g, t, N);
            run(g, &k, grid, &act_args(dxb.ptr(), y.ptr(), N, a.alpha, a.beta));
            let want = testutil::run(a.cpu, attrs(a), &[&t64(&[N], &x)])[0].to_f64_vec();
            let want_r = rounded(t, &want);
            assert_close(&format!("{k} (forward, {N} elements; input i is x[i])"), &host_as(&y, t), &want_r, rtol(t), atol(t));
            // one element in, the operands are not 16-byte aligned: element by element instead of
            // 16-byte vectors, the same bits
            let (y1, e) = (zeros_as(g, t, N), float_size(t) as u64);
            run(g, &k, grid, &act_args(dxb.ptr() + e, y1.ptr() + e, N - 1, a.alpha, a.beta));
            assert_eq!(host_as(&y1, t)[1..], host_as(&y, t)[1..], "{k}: unaligned operands give other bits");

            // gradient, reading the forward output (the reference's, rounded) or the input
            let kg = format!("{}_grad_{t}", a.op);
            let s = if a.from_output { want_r } else { x.clone() };
            let ds = dev_as(g, t, &s);
            let dx = zeros_as(g, t, N);
            run(g, &kg, grid, &act_grad_args(ddy.ptr(), ds.ptr(), dx.ptr(), N, a.alpha, a.beta));
            let grad_op = format!("{}Grad", a.cpu);
            let want = testutil::run(&grad_op, attrs(a), &[&t64(&[N], &dy), &t64(&[N], &s)])[0].to_f64_vec();
            assert_close(
                &format!("{kg} (backward from {}, {N} elements)", if a.from_output { "y" } else { "x" }),
                &host_as(&dx, t),
                &rounded(t, &want),
                rtol(t),
                atol(t),
            );
            let dx1 = zeros_as(g, t, N);
            run(g, &kg, grid, &act_grad_args(ddy.ptr() + e, ds.ptr() + e, dx1.ptr() + e, N - 1, a.alpha, a.beta));
            assert_eq!(host_as(&dx1, t)[1..], host_as(&dx, t)[1..], "{kg}: unaligned operands give other bits");
        }
    }
}
