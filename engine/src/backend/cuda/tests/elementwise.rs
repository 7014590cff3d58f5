//! Parity of kernels/elementwise.cu with the CPU backend (backend/cpu/elementwise.rs,
//! internal.rs) through `cpu::testutil::run`: every kernel of the family, every registered
//! dtype. bf16/f16 run the f32 CPU kernel on the already-rounded inputs and the reference is
//! rounded to nearest even. Binary, three-operand and gradient kernels are checked on
//! broadcasting cases up to rank 8 with 0 strides on every operand, and on small grids so the
//! grid-stride loop runs several rounds. The CPU references run in release builds (how the GPU
//! test binary is built), where integer overflow wraps as on the device.

use super::support::*;
use crate::backend::cpu::testutil::run as cpu;
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::registry::{self, types};
use crate::ir::{Attr, Attrs};

// ---- argument lists: built here for the GPU tests and for the registry check below ----------

/// cast_rows_f32_D(x, y, rows, cols, ldx, ldy)
fn cast_rows_args(x: u64, y: u64, rows: i64, cols: i64, ldx: i64, ldy: i64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(rows), KArg::I64(cols), KArg::I64(ldx), KArg::I64(ldy)]
}
fn unary_args(x: u64, y: u64, n: i64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(n)]
}
fn is_inf_args(x: u64, y: u64, n: i64, pos: i32, neg: i32) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(n), KArg::I32(pos), KArg::I32(neg)]
}
/// Binary, compare, logic and erf_grad kernels: (a, b, y, strides of a and b, n).
fn binary_args(a: u64, b: u64, y: u64, s: Strides, n: i64) -> Vec<KArg> {
    vec![KArg::Ptr(a), KArg::Ptr(b), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n)]
}
fn where_args(c: u64, a: u64, b: u64, y: u64, s: Strides, n: i64) -> Vec<KArg> {
    vec![KArg::Ptr(c), KArg::Ptr(a), KArg::Ptr(b), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n)]
}
fn mask_select_args(c: u64, x: u64, y: u64, s: Strides, n: i64, keep: i32) -> Vec<KArg> {
    vec![KArg::Ptr(c), KArg::Ptr(x), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n), KArg::I32(keep)]
}
#[allow(clippy::too_many_arguments)]
fn min_max_grad_args(dy: u64, a: u64, b: u64, y: u64, s: Strides, n: i64, is_max: i32, which: i32) -> Vec<KArg> {
    vec![KArg::Ptr(dy), KArg::Ptr(a), KArg::Ptr(b), KArg::Ptr(y), KArg::Strides(s), KArg::I64(n), KArg::I32(is_max), KArg::I32(which)]
}
fn affine_args(x: u64, y: u64, n: i64, alpha: f64, beta: f64) -> Vec<KArg> {
    vec![KArg::Ptr(x), KArg::Ptr(y), KArg::I64(n), KArg::F64(alpha), KArg::F64(beta)]
}

/// Float unary kernels: (op, CPU op, input range).
const UNARY_FLOAT: &[(&str, &str, f64, f64)] = &[
    ("sqrt", "Sqrt", 0.0, 100.0),
    ("exp", "Exp", -10.0, 10.0),
    ("log", "Log", 0.0, 100.0),
    ("sin", "Sin", -8.0, 8.0),
    ("cos", "Cos", -8.0, 8.0),
    ("erf", "Erf", -4.0, 4.0),
    ("reciprocal", "Reciprocal", -8.0, 8.0),
    ("floor", "Floor", -50.0, 50.0),
    ("ceil", "Ceil", -50.0, 50.0),
];
const UNARY_NUM: &[(&str, &str)] = &[("neg", "Neg"), ("abs", "Abs"), ("sign", "Sign")];
/// Arithmetic kernels: (op, CPU op, Mod's `fmod` attribute or -1).
const ARITH_OPS: &[(&str, &str, i64)] = &[
    ("add", "Add", -1),
    ("sub", "Sub", -1),
    ("mul", "Mul", -1),
    ("div", "Div", -1),
    ("max", "Max", -1),
    ("min", "Min", -1),
    ("mod", "Mod", 0),
    ("fmod", "Mod", 1),
];
const COMPARE_OPS: &[(&str, &str)] =
    &[("equal", "Equal"), ("less", "Less"), ("greater", "Greater"), ("less_equal", "LessOrEqual"), ("greater_equal", "GreaterOrEqual")];
const LOGIC_OPS: &[(&str, &str)] = &[("and", "And"), ("or", "Or"), ("xor", "Xor")];

/// The argument list the tests below pass to `op` (dummy addresses and sizes).
fn args_of(op: &str) -> Vec<KArg> {
    let s = Strides::default();
    let binary = ARITH_OPS.iter().any(|o| o.0 == op)
        || COMPARE_OPS.iter().any(|o| o.0 == op)
        || LOGIC_OPS.iter().any(|o| o.0 == op)
        || op == "pow"
        || op == "erf_grad";
    let unary = UNARY_FLOAT.iter().any(|o| o.0 == op)
        || UNARY_NUM.iter().any(|o| o.0 == op)
        || op == "is_nan"
        || op == "not"
        || (op.starts_with("cast_") && types::NUMS.contains(&&op[5..]));
    match op {
        "is_inf" => is_inf_args(1, 2, 3, 1, 0),
        "where" => where_args(1, 2, 3, 4, s, 5),
        "mask_select" => mask_select_args(1, 2, 3, s, 4, 1),
        "min_max_grad" => min_max_grad_args(1, 2, 3, 4, s, 5, 1, 0),
        "affine" => affine_args(1, 2, 3, 0.5, 1.0),
        "cast_rows_f32" => cast_rows_args(1, 2, 3, 4, 5, 6),
        _ if binary => binary_args(1, 2, 3, s, 4),
        _ if unary => unary_args(1, 2, 3),
        _ => panic!("elementwise: no test launches {op}"),
    }
}

/// Every kernel of the family has an argument list in the tests, and it matches the registry.
#[test]
fn elementwise_test_argument_lists_match_the_registry() {
    check_family_args("elementwise", args_of);
}

// ---- data ----------------------------------------------------------------------------------

/// Float specials spread into the float inputs.
const SPECIALS: &[f64] = &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5];

/// n values for dtype `t`: floats uniform in [lo, hi) with `specials` at spread positions
/// (when n leaves room), integers uniform in [lo, hi).
fn values(rng: &mut Rng, t: &str, n: usize, lo: f64, hi: f64, specials: &[f64]) -> Vec<f64> {
    if !is_float(t) {
        return (0..n).map(|_| rng.int(lo as i64, hi as i64) as f64).collect();
    }
    let mut v: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)).collect();
    if n > 13 * specials.len() + 1 {
        for (i, &s) in specials.iter().enumerate() {
            v[13 * i + 1] = s;
        }
    }
    v
}

/// Values drawn from a small set (ties and equal elements for compares and min/max).
fn picks(rng: &mut Rng, n: usize, set: &[f64]) -> Vec<f64> {
    (0..n).map(|_| set[rng.int(0, set.len() as i64) as usize]).collect()
}

/// Two-operand broadcasting cases: rank 1 (the kernels' fast path, with a 0 stride too), a
/// scalar, rank 0, and uncollapsed ranks 2, 3 and 8 with 0 strides on both operands.
const CASES2: &[(&[usize], &[usize])] = &[
    (&[1000], &[1000]),
    (&[1000], &[1]),
    (&[], &[7, 9]),
    (&[], &[]),
    (&[37, 53], &[37, 53]),
    (&[4, 1, 3], &[5, 1]),
    (&[2, 1, 3, 1, 2, 1, 3, 2], &[1, 2, 1, 2, 1, 3, 1, 2]),
];

/// Runs the binary-shaped kernel `k` on a (shape sa) and b (shape sb), dtype-`t` bytes, with
/// output dtype `to`, and compares with the CPU op `cpu_op` on the same values.
#[allow(clippy::too_many_arguments)]
fn check_binary(
    g: Target,
    k: &str,
    case: usize,
    t: &str,
    to: &str,
    (sa, ab): (&[usize], &[u8]),
    (sb, bb): (&[usize], &[u8]),
    cpu_op: &str,
    attrs: Attrs,
    atol: f64,
) {
    let out = bshape(&[sa, sb]);
    let n = numel(&out);
    let (da, db, dy) = (g.up(ab), g.up(bb), g.zeros(n * size_of(to)));
    g.run(k, Grid::elementwise(n as i64, 3), &binary_args(da.ptr(), db.ptr(), dy.ptr(), bcast(&out, &[sa, sb]), n as i64));
    let want = cpu(cpu_op, attrs, &[&cpu_tensor(t, sa, ab), &cpu_tensor(t, sb, bb)]);
    g.close(&format!("{k} case {case} ({sa:?} with {sb:?})"), to, &dy, &cpu_bytes(to, &want[0]), atol);
}

fn atol(t: &str) -> f64 {
    match t {
        "f64" => 1e-13,
        "f32" | "bf16" | "f16" => 1e-6,
        _ => 0.0,
    }
}

// ---- unary ---------------------------------------------------------------------------------

#[test]
fn gpu_unary_float_kernels_match_cpu() {
    let g = Target::of("gpu_unary_float_kernels_match_cpu");
    let mut rng = Rng::new(1);
    let n = 5003usize;
    for &(op, cpu_op, lo, hi) in UNARY_FLOAT {
        for &t in types::FLOATS {
            let k = registry::kernel_name(op, t);
            let xb = encode(t, &values(&mut rng, t, n, lo, hi, SPECIALS));
            let (dx, dy) = (g.up(&xb), g.zeros(n * size_of(t)));
            g.run(&k, Grid::elementwise(n as i64, 4), &unary_args(dx.ptr(), dy.ptr(), n as i64));
            let want = cpu(cpu_op, Attrs::default(), &[&cpu_tensor(t, &[n], &xb)]);
            g.close(&k, t, &dy, &cpu_bytes(t, &want[0]), atol(t));
        }
    }
}

#[test]
fn gpu_unary_number_kernels_match_cpu() {
    let g = Target::of("gpu_unary_number_kernels_match_cpu");
    let mut rng = Rng::new(2);
    let n = 3001usize;
    for &(op, cpu_op) in UNARY_NUM {
        for &t in types::NUMS {
            let k = registry::kernel_name(op, t);
            let (lo, hi) = match t {
                "u8" => (0.0, 256.0),
                "i8" => (-128.0, 128.0),
                _ => (-1000.0, 1000.0),
            };
            let mut v = values(&mut rng, t, n, lo, hi, SPECIALS);
            if !is_float(t) {
                // the extremes (encode saturates: these are MIN, MAX, 0, 1, -1 of the type)
                v[..5].copy_from_slice(&[-1e30, 1e30, 0.0, 1.0, -1.0]);
            }
            let xb = encode(t, &v);
            let (dx, dy) = (g.up(&xb), g.zeros(n * size_of(t)));
            g.run(&k, Grid::elementwise(n as i64, 2), &unary_args(dx.ptr(), dy.ptr(), n as i64));
            let want = cpu(cpu_op, Attrs::default(), &[&cpu_tensor(t, &[n], &xb)]);
            g.close(&k, t, &dy, &cpu_bytes(t, &want[0]), 0.0);
        }
    }
}

#[test]
fn gpu_is_nan_is_inf_not_match_cpu() {
    let g = Target::of("gpu_is_nan_is_inf_not_match_cpu");
    let mut rng = Rng::new(3);
    let n = 2000usize;
    for &t in types::FLOATS {
        let xb = encode(t, &values(&mut rng, t, n, -1e6, 1e6, SPECIALS));
        let x = cpu_tensor(t, &[n], &xb);
        let dx = g.up(&xb);
        let k = registry::kernel_name("is_nan", t);
        let dy = g.zeros(n);
        g.run(&k, Grid::elementwise(n as i64, 2), &unary_args(dx.ptr(), dy.ptr(), n as i64));
        g.same(&k, "bool", &dy, &cpu_bytes("bool", &cpu("IsNaN", Attrs::default(), &[&x])[0]));
        let k = registry::kernel_name("is_inf", t);
        for (pos, neg) in [(1, 1), (1, 0), (0, 1), (0, 0)] {
            let dy = g.zeros(n);
            g.run(&k, Grid::elementwise(n as i64, 2), &is_inf_args(dx.ptr(), dy.ptr(), n as i64, pos, neg));
            let attrs = Attrs::default().with("detect_positive", Attr::Int(pos as i64)).with("detect_negative", Attr::Int(neg as i64));
            g.same(&format!("{k} detect_pos {pos} detect_neg {neg}"), "bool", &dy, &cpu_bytes("bool", &cpu("IsInf", attrs, &[&x])[0]));
        }
    }
    let xb: Vec<u8> = (0..n).map(|_| rng.int(0, 256) as u8).collect();
    let (dx, dy) = (g.up(&xb), g.zeros(n));
    g.run("not_u8", Grid::elementwise(n as i64, 2), &unary_args(dx.ptr(), dy.ptr(), n as i64));
    g.same("not_u8", "bool", &dy, &cpu_bytes("bool", &cpu("Not", Attrs::default(), &[&cpu_tensor("u8", &[n], &xb)])[0]));
}

// ---- casts ---------------------------------------------------------------------------------

/// Cast sources: NaN, infinities, signed zeros, saturation at both ends of every integer
/// destination (and just inside), bf16 ties (1 + 2^-8, 1 + 3·2^-8), f16 ties (1 + 2^-11,
/// 1 + 3·2^-11), f16 overflow (65520 rounds to inf, 65519 to 65504), an f64 that rounds twice
/// (just above 1 + 2^-8: to the f32 tie, then to even), f32 subnormals, integers that f32 rounds.
const CAST_SPECIALS: &[f64] = &[
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    0.0,
    -0.0,
    0.4,
    -0.6,
    0.5,
    1.5,
    2.5,
    -2.5,
    127.0,
    127.9,
    128.0,
    255.0,
    255.9,
    256.0,
    300.0,
    -1.0,
    -127.9,
    -128.0,
    -128.9,
    -129.0,
    -300.0,
    65504.0,
    65519.0,
    65520.0,
    70000.0,
    2147483520.0,
    2147483647.0,
    2147483647.9,
    2147483648.0,
    -2147483648.0,
    -2147483648.9,
    -2147483649.0,
    3e9,
    -3e9,
    9.2e18,
    9.223372036854775e18,
    9.3e18,
    -9.223_372_036_854_776e18,
    -9.3e18,
    1e30,
    -1e30,
    3.4e38,
    1e-8,
    -1e-8,
    1e-40,
    1.00390625,
    1.01171875,
    -1.00390625,
    1.00048828125,
    1.00146484375,
    -1.00048828125,
    1.003906250000001,
    16777217.0,
    16777219.0,
];

/// cast_rows_f32_{bf16,f16}: 37 rows of 43 columns at a source row stride of 45 rounded into
/// rows of 48 (the fused LM head's G at a row stride of whole 16-byte vectors): each row the
/// CPU Cast of its 43 values, the 5 columns after them zeros, the specials (NaN, infinities,
/// overflow, subnormals, ties) included.
#[test]
fn gpu_cast_rows_round_into_a_wider_row_stride() {
    let g = Target::of("gpu_cast_rows_round_into_a_wider_row_stride");
    let mut rng = Rng::new(31);
    let (rows, cols, ldx, ldy) = (37usize, 43usize, 45usize, 48usize);
    let mut v: Vec<f64> = CAST_SPECIALS.iter().copied().filter(|x| x.is_nan() || (*x as f32) as f64 == *x || x.is_infinite()).collect();
    while v.len() < rows * ldx {
        v.push(rng.f32(-300.0, 300.0) as f64);
    }
    let xb = encode("f32", &v);
    let dx = g.up(&xb);
    for &dst in types::HALVES {
        let dy = g.zeros(rows * ldy * size_of(dst));
        let k = format!("cast_rows_f32_{dst}");
        g.run(&k, Grid::new(rows as u32, 256), &cast_rows_args(dx.ptr(), dy.ptr(), rows as i64, cols as i64, ldx as i64, ldy as i64));
        let mut want = Vec::with_capacity(rows * ldy * size_of(dst));
        for r in 0..rows {
            let row: Vec<f64> = v[r * ldx..r * ldx + cols].to_vec();
            let x = cpu_tensor("f32", &[cols], &encode("f32", &row));
            let to = cpu_dtype(dst).onnx_code() as i64;
            want.extend(cpu_bytes(dst, &cpu("Cast", Attrs::default().with("to", Attr::Int(to)), &[&x])[0]));
            want.extend(vec![0u8; (ldy - cols) * size_of(dst)]);
        }
        g.same(&format!("{k}: rows of {cols} at stride {ldx} into stride {ldy}"), dst, &dy, &want);
    }
}

#[test]
fn gpu_casts_match_cpu() {
    let g = Target::of("gpu_casts_match_cpu");
    let mut rng = Rng::new(4);
    let n = 1500usize;
    for &src in types::NUMS {
        // the specials first (encode saturates integers, rounds 16-bit floats), then random
        let mut v: Vec<f64> = CAST_SPECIALS.to_vec();
        v.extend((0..(n - v.len()) / 2).map(|_| rng.f32(-300.0, 300.0) as f64));
        while v.len() < n {
            v.push(rng.f32(-1e10, 1e10) as f64);
        }
        let mut xb = encode(src, &v);
        if src == "i64" {
            // full-range i64 values (not representable in f64): rounding to f32/f64, wrapping
            for (i, c) in xb.chunks_exact_mut(8).enumerate().skip(n / 2) {
                if i % 2 == 0 {
                    c.copy_from_slice(&rng.next_u64().to_le_bytes());
                }
            }
        }
        let x = cpu_tensor(src, &[n], &xb);
        let dx = g.up(&xb);
        for &dst in types::CAST_TO {
            let k = format!("cast_{src}_{dst}");
            let dy = g.zeros(n * size_of(dst));
            g.run(&k, Grid::elementwise(n as i64, 2), &unary_args(dx.ptr(), dy.ptr(), n as i64));
            // 16-bit destinations: the f32 Cast rounded to nearest even (the kernel goes
            // through f32 too, so an f64 source rounds twice on both sides)
            let to = cpu_dtype(dst);
            let want = cpu("Cast", Attrs::default().with("to", Attr::Int(to.onnx_code() as i64)), &[&x]);
            g.same(&format!("{k} (source value at the element: see CAST_SPECIALS)"), dst, &dy, &cpu_bytes(dst, &want[0]));
        }
    }
}

// ---- binary --------------------------------------------------------------------------------

#[test]
fn gpu_arithmetic_kernels_match_cpu_with_broadcasting() {
    let g = Target::of("gpu_arithmetic_kernels_match_cpu_with_broadcasting");
    let mut rng = Rng::new(5);
    for &(op, cpu_op, fmod) in ARITH_OPS {
        let attrs = if fmod >= 0 { Attrs::default().with("fmod", Attr::Int(fmod)) } else { Attrs::default() };
        for &t in types::NUMS {
            let k = registry::kernel_name(op, t);
            // u8: a in [8, 16) and b in [2, 8), so no sum, difference or product wraps
            let (lo_a, lo_b) = if t == "u8" { (8.0, 5.0) } else { (0.0, 0.0) };
            for (case, &(sa, sb)) in CASES2.iter().enumerate() {
                let a = values(&mut rng, t, numel(sa), -8.0 + 2.0 * lo_a, 8.0 + lo_a, SPECIALS);
                let mut b = values(&mut rng, t, numel(sb), -3.0 + lo_b, 3.0 + lo_b, &SPECIALS[3..]);
                if !is_float(t) && op == "div" {
                    // the CPU Div fails on an integer zero divisor (the kernel gives 0: see
                    // gpu_integer_division_by_zero_and_min_by_minus_one)
                    b.iter_mut().filter(|v| **v == 0.0).for_each(|v| *v = 2.0);
                }
                let (ab, bb) = (encode(t, &a), encode(t, &b));
                check_binary(g, &k, case, t, t, (sa, &ab), (sb, &bb), cpu_op, attrs.clone(), 0.0);
            }
        }
    }
    // pow: floats (the CPU takes x·x, powi or powf; the kernel x·x or powf) and i64 (wrapping)
    for &t in types::FLOATS.iter().chain(types::I64) {
        let k = registry::kernel_name("pow", t);
        for (case, &(sa, sb)) in CASES2.iter().enumerate() {
            let (a, b) = if is_float(t) {
                let mut b = values(&mut rng, t, numel(sb), -3.0, 3.0, &[2.0, 3.0, -1.0, 0.5, 0.0, f64::NAN, -2.0]);
                b.iter_mut().step_by(5).for_each(|v| *v = v.round());
                (values(&mut rng, t, numel(sa), -4.0, 4.0, SPECIALS), b)
            } else {
                (values(&mut rng, t, numel(sa), -10.0, 11.0, &[]), values(&mut rng, t, numel(sb), -3.0, 21.0, &[]))
            };
            let (ab, bb) = (encode(t, &a), encode(t, &b));
            check_binary(g, &k, case, t, t, (sa, &ab), (sb, &bb), "Pow", Attrs::default(), atol(t));
        }
    }
}

/// The device-only behaviour (the CPU Div fails instead): an integer zero divisor gives 0, and
/// MIN / -1 wraps to MIN; Mod and fmod give 0 for both (as the CPU kernel).
#[test]
fn gpu_integer_division_by_zero_and_min_by_minus_one() {
    let g = Target::of("gpu_integer_division_by_zero_and_min_by_minus_one");
    for t in ["i64", "i32", "i8"] {
        let a = [7.0, -7.0, -1e30, 5.0, -1e30, 9.0, 0.0];
        let b = [0.0, 0.0, -1.0, -1.0, 1.0, 0.0, 0.0];
        let (ab, bb) = (encode(t, &a), encode(t, &b));
        let want_div = encode(t, &[0.0, 0.0, -1e30, -5.0, -1e30, 0.0, 0.0]);
        let want_mod = encode(t, &[0.0; 7]);
        for (op, want) in [("div", &want_div), ("mod", &want_mod), ("fmod", &want_mod)] {
            let k = registry::kernel_name(op, t);
            let (da, db, dy) = (g.up(&ab), g.up(&bb), g.zeros(7 * size_of(t)));
            g.run(&k, Grid::new(1, 32), &binary_args(da.ptr(), db.ptr(), dy.ptr(), bcast(&[7], &[&[7], &[7]]), 7));
            g.same(&format!("{k} on a = [7, -7, MIN, 5, MIN, 9, 0], b = [0, 0, -1, -1, 1, 0, 0]"), t, &dy, want);
        }
    }
}

#[test]
fn gpu_compare_and_logic_kernels_match_cpu() {
    let g = Target::of("gpu_compare_and_logic_kernels_match_cpu");
    let mut rng = Rng::new(6);
    let float_set = [-1.0, -0.5, -0.0, 0.0, 0.5, 1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    let int_set = [-2.0, -1.0, 0.0, 1.0, 2.0];
    for &(op, cpu_op) in COMPARE_OPS {
        for &t in types::NUMS {
            let k = registry::kernel_name(op, t);
            let set: &[f64] = if is_float(t) { &float_set } else { &int_set };
            for (case, &(sa, sb)) in CASES2.iter().enumerate() {
                let (ab, bb) = (encode(t, &picks(&mut rng, numel(sa), set)), encode(t, &picks(&mut rng, numel(sb), set)));
                check_binary(g, &k, case, t, "bool", (sa, &ab), (sb, &bb), cpu_op, Attrs::default(), 0.0);
            }
        }
    }
    let byte_set = [0.0, 1.0, 2.0, 255.0];
    for &(op, cpu_op) in LOGIC_OPS {
        let k = registry::kernel_name(op, "u8");
        for (case, &(sa, sb)) in CASES2.iter().enumerate() {
            let (ab, bb) = (encode("u8", &picks(&mut rng, numel(sa), &byte_set)), encode("u8", &picks(&mut rng, numel(sb), &byte_set)));
            check_binary(g, &k, case, "u8", "bool", (sa, &ab), (sb, &bb), cpu_op, Attrs::default(), 0.0);
        }
    }
}

// ---- three-operand and internal ops --------------------------------------------------------

/// Three-operand cases (condition, a, b): rank 1 with 0 strides, a scalar, ranks 4 and 8 with
/// 0 strides on every operand.
const CASES3: &[(&[usize], &[usize], &[usize])] = &[
    (&[999], &[999], &[999]),
    (&[999], &[1], &[]),
    (&[], &[3, 4], &[4]),
    (&[1, 3, 1, 5], &[4, 1, 2, 1], &[5]),
    (&[2, 1, 2, 1, 1, 3, 1, 2], &[1, 2, 2, 1, 2, 1, 1, 1], &[2, 2, 1, 3, 2, 1, 3, 2]),
];

#[test]
fn gpu_where_and_mask_select_match_cpu() {
    let g = Target::of("gpu_where_and_mask_select_match_cpu");
    let mut rng = Rng::new(7);
    let cond_set = [0.0, 1.0, 7.0];
    // bit-moving kernels: the CPU reference runs on I64 tensors of the same values
    for &w in types::WIDTHS {
        let k = registry::kernel_name("where", w);
        for (case, &(sc, sa, sb)) in CASES3.iter().enumerate() {
            let out = bshape(&[sc, sa, sb]);
            let n = numel(&out);
            let cb = encode("u8", &picks(&mut rng, numel(sc), &cond_set));
            let ((av, ab), (bv, bb)) = (random_bits(&mut rng, w, numel(sa)), random_bits(&mut rng, w, numel(sb)));
            let (dc, da, db, dy) = (g.up(&cb), g.up(&ab), g.up(&bb), g.zeros(n * size_of(w)));
            let s = bcast(&out, &[sc, sa, sb]);
            g.run(&k, Grid::elementwise(n as i64, 3), &where_args(dc.ptr(), da.ptr(), db.ptr(), dy.ptr(), s, n as i64));
            let want =
                cpu("Where", Attrs::default(), &[&cpu_tensor("u8", sc, &cb), &i64_tensor(sa, av.clone()), &i64_tensor(sb, bv.clone())]);
            let want = want[0].to_i64_vec().expect("i64");
            let emulated: Vec<i64> = (0..n as i64)
                .map(|i| {
                    let o = offsets(&s, i).map(|v| v as usize);
                    if cb[o[0]] != 0 {
                        av[o[1]]
                    } else {
                        bv[o[2]]
                    }
                })
                .collect();
            assert_eq!(emulated, want, "{k} case {case}: the host emulation of the Strides");
            g.same(&format!("{k} case {case} ({sc:?}, {sa:?}, {sb:?})"), w, &dy, &narrow(w, &want));
        }
        let k = registry::kernel_name("mask_select", w);
        for (case, &(sc, sx)) in MASK_CASES.iter().enumerate() {
            let n = numel(sx);
            let cb = encode("u8", &picks(&mut rng, numel(sc), &cond_set));
            let (xv, xb) = random_bits(&mut rng, w, n);
            let (dc, dx) = (g.up(&cb), g.up(&xb));
            for keep in [1, 0] {
                let dy = g.zeros(n * size_of(w));
                g.run(
                    &k,
                    Grid::elementwise(n as i64, 3),
                    &mask_select_args(dc.ptr(), dx.ptr(), dy.ptr(), bcast(sx, &[sc, sx]), n as i64, keep),
                );
                let attrs = Attrs::default().with("keep", Attr::Int(keep as i64));
                let want = cpu("MaskSelect", attrs, &[&cpu_tensor("u8", sc, &cb), &i64_tensor(sx, xv.clone())]);
                let want = narrow(w, &want[0].to_i64_vec().expect("i64"));
                g.same(&format!("{k} keep {keep} case {case} ({sc:?}, {sx:?})"), w, &dy, &want);
            }
        }
    }
}

/// MaskSelect(c, x) cases: the CPU output is shaped like x, so x has the full shape.
const MASK_CASES: &[(&[usize], &[usize])] =
    &[(&[999], &[999]), (&[1], &[999]), (&[3, 1, 5], &[2, 3, 4, 5]), (&[2, 1, 2, 1, 1, 3, 1, 2], &[2, 2, 2, 3, 2, 3, 3, 2])];

/// (dy or output shape, operand shapes): dy full, the others broadcast (the CPU output is
/// shaped like dy).
const GRAD_CASES: &[(&[usize], &[usize], &[usize])] = &[
    (&[999], &[999], &[999]),
    (&[999], &[1], &[]),
    (&[4, 3, 5], &[3, 1], &[4, 1, 5]),
    (&[2, 2, 2, 3, 2, 3, 3, 2], &[1, 2, 2, 1, 2, 1, 1, 1], &[2, 2, 1, 3, 2, 1, 3, 2]),
];

#[test]
fn gpu_min_max_grad_erf_grad_affine_match_cpu() {
    let g = Target::of("gpu_min_max_grad_erf_grad_affine_match_cpu");
    let mut rng = Rng::new(8);
    let tie_set = [-1.0, 0.0, 0.5, 1.0, 2.0, f64::NAN];
    for &t in types::FLOATS {
        let k = registry::kernel_name("min_max_grad", t);
        for (case, &(sd, sa, sb)) in GRAD_CASES.iter().enumerate() {
            let n = numel(sd);
            let dyb = encode(t, &values(&mut rng, t, n, -2.0, 2.0, &[]));
            let (ab, bb) = (encode(t, &picks(&mut rng, numel(sa), &tie_set)), encode(t, &picks(&mut rng, numel(sb), &tie_set)));
            let (ddy, da, db) = (g.up(&dyb), g.up(&ab), g.up(&bb));
            let s = bcast(sd, &[sd, sa, sb]);
            for (is_max, which) in [(1, 0), (1, 1), (0, 0), (0, 1)] {
                let dy = g.zeros(n * size_of(t));
                g.run(
                    &k,
                    Grid::elementwise(n as i64, 3),
                    &min_max_grad_args(ddy.ptr(), da.ptr(), db.ptr(), dy.ptr(), s, n as i64, is_max, which),
                );
                let attrs = Attrs::default().with("is_max", Attr::Int(is_max as i64)).with("which", Attr::Int(which as i64));
                let want = cpu("MinMaxGrad", attrs, &[&cpu_tensor(t, sd, &dyb), &cpu_tensor(t, sa, &ab), &cpu_tensor(t, sb, &bb)]);
                let what = format!("{k} is_max {is_max} which {which} case {case} ({sd:?}, {sa:?}, {sb:?})");
                g.close(&what, t, &dy, &cpu_bytes(t, &want[0]), 0.0);
            }
        }
        // ErfGrad(dy, x): dy full, x broadcast
        let k = registry::kernel_name("erf_grad", t);
        for (case, &(sd, sx, _)) in GRAD_CASES.iter().enumerate() {
            let dyb = encode(t, &values(&mut rng, t, numel(sd), -2.0, 2.0, &[]));
            let xb = encode(t, &values(&mut rng, t, numel(sx), -3.0, 3.0, &[]));
            check_binary(g, &k, case, t, t, (sd, &dyb), (sx, &xb), "ErfGrad", Attrs::default(), atol(t) * 0.1);
        }
        // Affine: alpha a power of two, so the device's fused multiply-add rounds as the CPU's
        // multiply then add
        let k = registry::kernel_name("affine", t);
        let n = 5003usize;
        let xb = encode(t, &values(&mut rng, t, n, -100.0, 100.0, SPECIALS));
        let dx = g.up(&xb);
        for (alpha, beta) in [(0.5, -0.75), (-2.0, 3.0), (1.0, 0.0)] {
            let dy = g.zeros(n * size_of(t));
            g.run(&k, Grid::elementwise(n as i64, 4), &affine_args(dx.ptr(), dy.ptr(), n as i64, alpha, beta));
            let attrs = Attrs::default().with("alpha", Attr::Float(alpha as f32)).with("beta", Attr::Float(beta as f32));
            let want = cpu("Affine", attrs, &[&cpu_tensor(t, &[n], &xb)]);
            g.close(&format!("{k} alpha {alpha} beta {beta}"), t, &dy, &cpu_bytes(t, &want[0]), 0.0);
        }
    }
}
