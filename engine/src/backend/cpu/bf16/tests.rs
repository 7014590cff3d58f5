//! bf16 GEMM tests: rounding, vector packers against the scalar one, both kernels (AMX through
//! its software tile model) against an f64 reference on bf16-rounded inputs over odd sizes, every
//! transpose combination and alpha/beta; the AMX hardware test; and an `#[ignore]` speed table.

use super::amx::{self, Amx, Emu, Hw};
use super::avx512::Avx512Bf16;
use super::driver::{self, Kernel, Problem};
use super::pack::{self, round_bf16, Lines, PackJob, PanelLayout};
use super::round_bits as bf16_bits;
use super::{detect, MatRef};
use crate::backend::cpu::testutil::data;

fn have_bf16() -> bool {
    let ok = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16");
    if !ok {
        eprintln!("skipped: this CPU has no avx512_bf16");
    }
    ok
}

#[test]
fn rounding_is_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3F80);
    assert_eq!(bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80); // tie, even stays
    assert_eq!(bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82); // tie, odd rounds up
    assert_eq!(bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(bf16_bits(f32::from_bits(0x3F80_7FFF)), 0x3F80);
    assert_eq!(bf16_bits(-2.0), 0xC000);
    assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
    assert_eq!(bf16_bits(f32::MAX), 0x7F80); // rounds to infinity
    assert!(round_bf16(f32::NAN).is_nan());
    assert_eq!(round_bf16(3.0), 3.0);
}

#[test]
fn vector_packers_match_the_scalar_one() {
    if !have_bf16() {
        return;
    }
    for &(lines, kc) in &[(1, 1), (14, 2), (13, 33), (16, 32), (17, 65), (32, 31), (40, 256), (3, 1000)] {
        let x = data(lines * kc, (lines * 1000 + kc) as u64);
        // both storage orders of the same lines × kc operand, and a strided one
        let views = [
            Lines { ptr: x.as_ptr(), ls: kc as isize, ks: 1 },
            Lines { ptr: x.as_ptr(), ls: 1, ks: lines as isize },
            Lines { ptr: x.as_ptr(), ls: 1, ks: 0 },
        ];
        for lines_pad in [lines, lines.next_multiple_of(16) + 3] {
            for kp_pad in [kc.div_ceil(2), kc.div_ceil(2).next_multiple_of(16)] {
                let layouts = [PanelLayout { si: 1, sp: lines_pad }, PanelLayout { si: kp_pad, sp: 1 }];
                for (v, lay) in views.iter().flat_map(|v| layouts.iter().map(move |l| (v, l))) {
                    let n = lines_pad * kp_pad;
                    let (mut want, mut got) = (vec![7u32; n], vec![9u32; n]);
                    // pairs in two ranges, as the row-order walk packs them
                    let cut = (kp_pad / 2).next_multiple_of(16).min(kp_pad);
                    let job =
                        |dst: &mut Vec<u32>, pairs| PackJob { src: *v, lines, kc, dst: dst.as_mut_ptr(), lay: *lay, lines_pad, pairs };
                    // SAFETY: the views cover lines × kc of x; the buffers hold every index.
                    unsafe {
                        pack::pack_scalar(&job(&mut want, 0..kp_pad));
                        pack::pack(&job(&mut got, 0..cut));
                        pack::pack(&job(&mut got, cut..kp_pad));
                    }
                    assert_eq!(want, got, "lines {lines} kc {kc} view {v:?} layout {lay:?} pads {lines_pad} {kp_pad}");
                }
            }
        }
    }
}

/// An m×k (or k×n) operand stored as given or transposed; returns storage and view strides.
fn operand(rows: usize, cols: usize, transposed: bool, seed: u64) -> (Vec<f32>, isize, isize) {
    let v = data(rows * cols, seed);
    if transposed {
        (v, 1, rows as isize)
    } else {
        (v, cols as isize, 1)
    }
}

/// Runs one case through `kern` and checks it against f64 on bf16-rounded inputs.
#[allow(clippy::too_many_arguments)]
fn check<K: Kernel>(kern: &K, m: usize, n: usize, k: usize, ta: bool, tb: bool, alpha: f32, beta: f32, par: bool) {
    let (a, ars, acs) = operand(m, k, ta, 1 + m as u64);
    let (b, brs, bcs) = operand(k, n, tb, 2 + n as u64);
    let ldc = n + 3;
    let c0: Vec<f32> = if beta == 0.0 { vec![f32::NAN; m * ldc] } else { data(m * ldc, 3) };
    let mut c = c0.clone();
    let g = Problem {
        m,
        n,
        k,
        alpha,
        a: MatRef { ptr: a.as_ptr(), rs: ars, cs: acs },
        b: MatRef { ptr: b.as_ptr(), rs: brs, cs: bcs },
        beta,
        c: c.as_mut_ptr(),
        ldc,
    };
    // SAFETY: operands and C are sized for their views; the CPU has avx512_bf16 (checked).
    unsafe { driver::run(kern, &g, par) };
    let at = |v: &[f32], rs: isize, cs: isize, i: usize, j: usize| round_bf16(v[(i as isize * rs + j as isize * cs) as usize]) as f64;
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut sa) = (0.0f64, 0.0f64);
            for kk in 0..k {
                let p = at(&a, ars, acs, i, kk) * at(&b, brs, bcs, kk, j);
                s += p;
                sa += p.abs();
            }
            let base = if beta == 0.0 { 0.0 } else { beta as f64 * c0[i * ldc + j] as f64 };
            let want = alpha as f64 * s + base;
            let tol = 2e-5 * (alpha.abs() as f64 * sa + base.abs()) + 1e-30;
            let got = c[i * ldc + j] as f64;
            assert!(
                (got - want).abs() <= tol,
                "m {m} n {n} k {k} ta {ta} tb {tb} alpha {alpha} beta {beta}: C[{i},{j}] = {got}, want {want} (tol {tol:.2e})"
            );
        }
        // the padding columns of C are untouched
        for j in n..ldc {
            assert!(c[i * ldc + j].to_bits() == c0[i * ldc + j].to_bits(), "C[{i},{j}] past n was written");
        }
    }
}

const SIZES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 17, 33),
    (17, 1, 5),
    (14, 32, 2),
    (15, 33, 3),
    (33, 17, 1),
    (29, 47, 255),
    (13, 100, 257),
    (100, 35, 513),
    (70, 300, 200), // the LM-head forward, 1/10 × 1/96
    (200, 300, 70), // its weight gradient
    (70, 20, 2879), // its input gradient (many k steps)
];

const SCALES: &[(f32, f32)] = &[(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25), (1.0, 1.0)];

/// Every size × transpose combination × alpha/beta pair through `kern`.
fn check_all<K: Kernel>(kern: &K, sizes: &[(usize, usize, usize)], scales: &[(f32, f32)]) {
    for &(m, n, k) in sizes {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for &(alpha, beta) in scales {
                check(kern, m, n, k, ta, tb, alpha, beta, true);
            }
        }
    }
}

#[test]
fn avx512_bf16_gemm_matches_reference() {
    if have_bf16() {
        check_all(&Avx512Bf16, SIZES, SCALES);
    }
}

#[test]
fn avx512_bf16_gemm_block_edges() {
    if !have_bf16() {
        return;
    }
    // two column blocks (n > 4096), two k blocks (packed A + B past the 8 MiB budget), two row
    // blocks (m > 4096); single-threaded and parallel
    for &(m, n, k) in &[(20, 4100, 300), (1000, 40, 5000), (4100, 20, 30)] {
        check(&Avx512Bf16, m, n, k, false, true, 1.0, 0.0, true);
        check(&Avx512Bf16, m, n, k, true, false, 0.5, 1.0, false);
    }
}

#[test]
fn k_zero_scales_c_by_beta() {
    let mut c = vec![2.0f32; 6];
    let g = Problem {
        m: 2,
        n: 3,
        k: 0,
        alpha: 1.0,
        a: MatRef { ptr: [].as_ptr(), rs: 0, cs: 1 },
        b: MatRef { ptr: [].as_ptr(), rs: 3, cs: 1 },
        beta: 0.5,
        c: c.as_mut_ptr(),
        ldc: 3,
    };
    // SAFETY: k = 0 reads neither operand; C holds 2 × 3 floats.
    unsafe { driver::run(&Avx512Bf16, &g, false) };
    assert_eq!(c, vec![1.0; 6]);
}

#[test]
fn amx_kernel_logic_matches_reference_on_the_tile_model() {
    if !have_bf16() {
        return;
    }
    check_all(&Amx::<Emu>::new(), &[(1, 1, 1), (33, 33, 33), (40, 70, 100), (17, 5, 300), (64, 64, 32)], SCALES);
    check_all(&Amx::<Emu>::new(), SIZES, &SCALES[..1]);
}

#[test]
fn amx_hardware_matches_reference() {
    if !have_bf16() {
        return;
    }
    let required = std::env::var("ORTRAIN_REQUIRE_AMX").is_ok_and(|v| v == "1");
    match amx::status() {
        amx::Status::Usable => check_all(&Amx::<Hw>::new(), SIZES, SCALES),
        // on a CPU with AMX a refused permission or a failed trial is a failure, not a skip
        amx::Status::Unusable(why) => panic!("this CPU has AMX, but it is not used: {why}"),
        other if required => panic!("ORTRAIN_REQUIRE_AMX=1, but AMX is {other:?}"),
        amx::Status::OsDisabled => {
            eprintln!("skipped: this CPU has AMX, but the OS does not enable its tile state; the AMX kernel is compiled, not run")
        }
        amx::Status::Absent => eprintln!("skipped: this CPU has no AMX (amx_bf16 + amx_tile); the AMX kernel is compiled, not run"),
    }
}

#[test]
fn detection_is_consistent() {
    match detect() {
        Some(super::Bf16Isa::Amx) => assert!(amx::available()),
        Some(super::Bf16Isa::Avx512Bf16) => assert!(is_x86_feature_detected!("avx512bf16")),
        None => eprintln!("no bf16 instruction set detected (or ORTRAIN_CPU_BF16=off)"),
    }
}

/// A kernel that does nothing: the driver's time with it is packing and loop overhead.
struct PackOnly;

impl Kernel for PackOnly {
    type Task = ();
    const MR: usize = super::avx512::MR;
    const NARROW: bool = true;
    const KP_ALIGN: usize = 1;
    fn a_layout(kp_pad: usize) -> PanelLayout {
        Avx512Bf16::a_layout(kp_pad)
    }
    unsafe fn begin(&self) {}
    unsafe fn run(&self, _: &mut (), _: &super::driver::Block) {}
}

/// GFLOP/s of the bf16 GEMM against the `gemm` crate in f32 on the tutorial's LM-head shapes,
/// with the operand layouts the matmul kernels pass (rayon's global pool, medians of 7 runs,
/// interleaved). `cargo test --release -p ortrain-engine bf16_gemm_speed -- --ignored --nocapture`
#[test]
#[ignore]
fn bf16_gemm_speed() {
    let Some(isa) = detect() else {
        eprintln!("skipped: no bf16 instruction set on this CPU");
        return;
    };
    let t: usize = std::env::var("BF16_BENCH_ROWS").ok().and_then(|t| t.parse().ok()).unwrap_or(700);
    let (e, v) = (200usize, 28782usize);
    let x = data(t * e, 1); // activations [700, 200]
    let w = data(e * v, 2); // LM-head weight, transposed [200, 28782]
    let dy = data(t * v, 3); // output gradient [700, 28782]
                             // (name, m, n, k, A view, B view)
    let shapes: [(&str, usize, usize, usize, MatRef, MatRef); 3] = [
        (
            "forward  X·Wt  700×28782×200",
            t,
            v,
            e,
            MatRef { ptr: x.as_ptr(), rs: e as isize, cs: 1 },
            MatRef { ptr: w.as_ptr(), rs: v as isize, cs: 1 },
        ),
        (
            "grad W  Xᵀ·dY  200×28782×700",
            e,
            v,
            t,
            MatRef { ptr: x.as_ptr(), rs: 1, cs: e as isize },
            MatRef { ptr: dy.as_ptr(), rs: v as isize, cs: 1 },
        ),
        (
            "grad X dY·Wtᵀ  700×200×28782",
            t,
            e,
            v,
            MatRef { ptr: dy.as_ptr(), rs: v as isize, cs: 1 },
            MatRef { ptr: w.as_ptr(), rs: 1, cs: v as isize },
        ),
    ];
    let threads: usize = std::env::var("BF16_BENCH_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    let reps: usize = std::env::var("BF16_BENCH_REPS").ok().and_then(|t| t.parse().ok()).unwrap_or(7);
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads).build() else {
        return;
    };
    println!("{threads} threads, bf16 path {}, median of {reps}", isa.name());
    println!("{:32} {:>10} {:>10} {:>6} {:>14}", "shape (m×n×k)", "bf16", "f32 gemm", "ratio", "bf16 pack ms");
    for (name, m, n, k, a, b) in shapes {
        let mut c = vec![0f32; m * n];
        let flops = 2.0 * (m * n * k) as f64;
        let (ap, bp) = (a.ptr as usize, b.ptr as usize);
        let (mut tb, mut tf, mut tp) = (vec![], vec![], vec![]);
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            // SAFETY: views cover the operands; c holds m × n floats.
            pool.install(|| unsafe { super::gemm(isa, m, n, k, 1.0, a, b, 0.0, c.as_mut_ptr(), n, true) });
            tb.push(t0.elapsed().as_secs_f64());
            let cp = c.as_mut_ptr() as usize;
            let t0 = std::time::Instant::now();
            pool.install(|| {
                let g = Problem { m, n, k, alpha: 1.0, a, b, beta: 0.0, c: cp as *mut f32, ldc: n };
                // SAFETY: as above; the CPU has avx512_bf16 (detected).
                unsafe { driver::run(&PackOnly, &g, true) }
            });
            tp.push(t0.elapsed().as_secs_f64());
            let t0 = std::time::Instant::now();
            // SAFETY: as above.
            pool.install(|| unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    ap as *const f32,
                    a.cs,
                    a.rs,
                    bp as *const f32,
                    b.cs,
                    b.rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(0),
                )
            });
            tf.push(t0.elapsed().as_secs_f64());
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let (gb, gf) = (flops / med(&mut tb) / 1e9, flops / med(&mut tf) / 1e9);
        println!("{name:32} {gb:10.1} {gf:10.1} {:6.2} {:14.1}", gb / gf, med(&mut tp) * 1e3);
    }
    // the micro-kernel alone on L1-resident panels, one thread
    let kp = 128;
    let (pa, pb, mut c) = (vec![0x3F80_3F80u32; 14 * kp], vec![0x3F80_3F80u32; 32 * kp], vec![0f32; 14 * 32]);
    let blk = super::driver::Block {
        kp,
        a: pa.as_ptr(),
        a_rs: 1,
        b: pb.as_ptr(),
        width: 32,
        c: c.as_mut_ptr(),
        ldc: 32,
        rows: 14,
        cols: 32,
        alpha: 1.0,
        beta: 1.0,
    };
    let t0 = std::time::Instant::now();
    for _ in 0..20000 {
        // SAFETY: panels and C sized for the block.
        unsafe { Avx512Bf16.run(&mut (), &blk) };
    }
    println!(
        "avx512_bf16 micro-kernel (14 × 32), L1-resident, 1 thread: {:.1} GFLOP/s",
        2.0 * (14 * 32 * 2 * kp * 20000) as f64 / t0.elapsed().as_secs_f64() / 1e9
    );
    if amx::available() {
        // the AMX kernel's 32 × 32 block over the same depth: A as 32 rows at stride kp
        let pa = vec![0x3F80_3F80u32; 32 * kp];
        let mut c = vec![0f32; 32 * 32];
        let blk = super::driver::Block { a: pa.as_ptr(), a_rs: kp, rows: 32, c: c.as_mut_ptr(), ..blk };
        let kernel = Amx::<Hw>::new();
        // SAFETY: amx::available(): the CPU has AMX, tile state enabled and permitted.
        let mut task = unsafe { kernel.begin() };
        let t0 = std::time::Instant::now();
        for _ in 0..20000 {
            // SAFETY: panels and C sized for the block.
            unsafe { kernel.run(&mut task, &blk) };
        }
        println!(
            "AMX micro-kernel (32 × 32), L1-resident, 1 thread: {:.1} GFLOP/s",
            2.0 * (32 * 32 * 2 * kp * 20000) as f64 / t0.elapsed().as_secs_f64() / 1e9
        );
    }
}
