//! dropout.cu: the keep masks equal, bit for bit, to the host Philox reference
//! (`philox::dropout_keep`, itself checked against Random123's known answers), y = x·mask/(1 -
//! ratio), the mask-less and in-place launches, and the backward against the CPU kernel
//! (engine/src/backend/cpu/random.rs DropoutGrad, in f64; the f32-dy one for a 16-bit dx bit
//! for bit). The CPU Dropout draws other masks
//! (SplitMix64), so the forward is checked against the identity, not against the CPU op.

use super::support::*;
use crate::backend::cpu::testutil;
use crate::backend::cuda::launch::{Grid, KArg};
use crate::backend::cuda::philox::dropout_keep;
use crate::backend::cuda::registry::types::{FLOATS, HALVES};
use crate::ir::{Attr, Attrs};
use crate::ops::random::DROPPED_TYPE;
use crate::tensor::{DType, Data, Tensor};

/// The rate's operands every kernel ends with: (ratio_at, ratio_type, training_at, err);
/// `DEVICE_NONE` for the constants before them.
#[derive(Clone, Copy)]
struct OnDevice {
    ratio_at: u64,
    ratio_type: i32,
    training_at: u64,
    err: u64,
}
const DEVICE_NONE: OnDevice = OnDevice { ratio_at: 0, ratio_type: 0, training_at: 0, err: 0 };

impl OnDevice {
    fn args(self) -> [KArg; 4] {
        [KArg::Ptr(self.ratio_at), KArg::I32(self.ratio_type), KArg::Ptr(self.training_at), KArg::Ptr(self.err)]
    }
}

/// `dropout_T(const T* x, T* y, u8* mask, i64 n, f32 ratio, u64 seed, u64 offset, rate)`
#[allow(clippy::too_many_arguments)]
fn fwd_args(x: u64, y: u64, mask: u64, n: usize, ratio: f32, seed: u64, offset: u64) -> Vec<KArg> {
    fwd_args_on(x, y, mask, n, ratio, seed, offset, DEVICE_NONE)
}

#[allow(clippy::too_many_arguments)]
fn fwd_args_on(x: u64, y: u64, mask: u64, n: usize, ratio: f32, seed: u64, offset: u64, dev: OnDevice) -> Vec<KArg> {
    let mut a =
        vec![KArg::Ptr(x), KArg::Ptr(y), KArg::Ptr(mask), KArg::I64(n as i64), KArg::F32(ratio), KArg::U64(seed), KArg::U64(offset)];
    a.extend(dev.args());
    a
}

/// `dropout_slot_T(const T* x, T* y, u8* mask, i64 n, f32 ratio, const u64* seed, u64 salt, rate)`
fn slot_args(x: u64, y: u64, mask: u64, n: usize, ratio: f32, seed: u64, salt: u64) -> Vec<KArg> {
    let mut a = vec![KArg::Ptr(x), KArg::Ptr(y), KArg::Ptr(mask), KArg::I64(n as i64), KArg::F32(ratio), KArg::Ptr(seed), KArg::U64(salt)];
    a.extend(DEVICE_NONE.args());
    a
}

/// `dropout_grad_T(const T* dy, const u8* mask, T* dx, i64 n, f32 scale, rate)`
fn bwd_args(dy: u64, mask: u64, dx: u64, n: usize, scale: f32) -> Vec<KArg> {
    bwd_args_on(dy, mask, dx, n, scale, DEVICE_NONE)
}

fn bwd_args_on(dy: u64, mask: u64, dx: u64, n: usize, scale: f32, dev: OnDevice) -> Vec<KArg> {
    let mut a = vec![KArg::Ptr(dy), KArg::Ptr(mask), KArg::Ptr(dx), KArg::I64(n as i64), KArg::F32(scale)];
    a.extend(dev.args());
    a
}

/// Not a multiple of 4 (the last Philox group is partial).
const N: usize = 100_003;
const RATIO: f32 = 0.3;
/// Both key words non-zero.
const SEED: u64 = 0x0123_4567_89AB_CDEF;
/// The counter's high word changes inside the launch (group 5 is counter 2^32).
const OFFSET: u64 = (1 << 32) - 5;

/// One thread per group of 4 elements, at most 16 blocks of 256: the grid-stride loop runs.
fn grid() -> Grid {
    Grid::elementwise(N.div_ceil(4) as i64, 16)
}

#[test]
fn dropout_argument_lists_match_the_registry() {
    let mut checked = Vec::new();
    for t in FLOATS {
        check(&format!("dropout_{t}"), &fwd_args(1, 1, 1, N, RATIO, SEED, OFFSET));
        check(&format!("dropout_{t}"), &fwd_args(1, 1, 0, N, RATIO, SEED, OFFSET));
        check(&format!("dropout_slot_{t}"), &slot_args(1, 1, 1, N, RATIO, 1, SEED));
        check(&format!("dropout_grad_{t}"), &bwd_args(1, 1, 1, N, 2.0));
        // DropoutAdd's: the residual after x (exec_fusions.rs runs them against the unfused step)
        let mut with_residual = |k: String, mut args: Vec<KArg>| {
            args.insert(1, KArg::Ptr(1));
            check(&k, &args);
            checked.push(k);
        };
        with_residual(format!("dropout_add_{t}"), fwd_args(1, 1, 1, N, RATIO, SEED, OFFSET));
        with_residual(format!("dropout_add_slot_{t}"), slot_args(1, 1, 1, N, RATIO, 1, SEED));
        if HALVES.contains(t) {
            // a 16-bit branch into an f32 stream: the same arguments, res and y f32
            with_residual(format!("dropout_add_wide_{t}"), fwd_args(1, 1, 1, N, RATIO, SEED, OFFSET));
            with_residual(format!("dropout_add_wide_slot_{t}"), slot_args(1, 1, 1, N, RATIO, 1, SEED));
            // and its gradient: dy f32, dx 16-bit
            check(&format!("dropout_grad_wide_{t}"), &bwd_args(1, 1, 1, N, 2.0));
            checked.push(format!("dropout_grad_wide_{t}"));
        }
        checked.extend([format!("dropout_{t}"), format!("dropout_slot_{t}"), format!("dropout_grad_{t}")]);
    }
    checked.extend(super::random_draws::draw_kernels_checked()); // the family's random draws
                                                                 // DropoutKey's (attention_dropout.rs runs it): out, the seed slot (null: none), the key or salt
    check("dropout_key_i64", &[KArg::Ptr(1), KArg::Ptr(0), KArg::U64(SEED)]);
    checked.push("dropout_key_i64".into());
    assert_covers("dropout", &checked);
}

#[test]
fn gpu_dropout_masks_are_philox_and_the_gradient_matches_the_cpu_kernel() {
    let Some(g) = gpu("gpu_dropout_masks_are_philox_and_the_gradient_matches_the_cpu_kernel") else { return };
    let mut rng = Rng::new(51);
    let want_mask: Vec<u8> = (0..N as u64).map(|i| dropout_keep(SEED, OFFSET, i, RATIO) as u8).collect();
    let kept = want_mask.iter().filter(|&&m| m == 1).count() as f64 / N as f64;
    assert!((kept - 0.7).abs() < 0.01, "the reference keeps {kept} of the elements, not about 0.7");
    let case = format!("n {N}, ratio {RATIO}, seed {SEED:#x}, offset {OFFSET:#x}");
    for t in FLOATS {
        let k = format!("dropout_{t}");
        let x = rand_as(&mut rng, t, N, -2.0, 2.0);
        let (dxb, y, mask) = (dev_as(g, t, &x), zeros_as(g, t, N), zeros::<u8>(g, N));
        run(g, &k, grid(), &fwd_args(dxb.ptr(), y.ptr(), mask.ptr(), N, RATIO, SEED, OFFSET));
        let got_mask = host::<u8>(&mask);
        if let Some(i) = (0..N).find(|&i| got_mask[i] != want_mask[i]) {
            panic!("{k} {case}: mask element {i} is {}, philox::dropout_keep says {}", got_mask[i], want_mask[i]);
        }
        // y = x / (1 - ratio) where kept (the scale computed in the compute type), else 0
        let scale = 1.0 / (1.0 - RATIO as f64);
        let want: Vec<f64> = x.iter().zip(&want_mask).map(|(&v, &m)| if m == 1 { round_to(t, v * scale) } else { 0.0 }).collect();
        let got = host_as(&y, t);
        assert_close(&format!("{k} y {case}"), &got, &want, rtol(t), 0.0);

        // no mask: the same y
        let y2 = zeros_as(g, t, N);
        run(g, &k, grid(), &fwd_args(dxb.ptr(), y2.ptr(), 0, N, RATIO, SEED, OFFSET));
        assert_eq!(host_as(&y2, t), got, "{k} {case}: y without a mask output differs");
        // in place (y aliases x): the same y
        run(g, &k, grid(), &fwd_args(dxb.ptr(), dxb.ptr(), 0, N, RATIO, SEED, OFFSET));
        assert_eq!(host_as(&dxb, t), got, "{k} {case}: y in place differs");

        // backward from the kernel's mask: training (scale 1 / (1 - 0.5) = 2, exact in f32) and
        // not training (scale 1), against DropoutGrad(dy, mask, ratio, training_mode)
        let kg = format!("dropout_grad_{t}");
        let dy = rand_as(&mut rng, t, N, -1.0, 1.0);
        let ddy = dev_as(g, t, &dy);
        let mask_t = Tensor::new(vec![N], Data::Bool(got_mask.clone())).expect("mask");
        for (training, scale) in [(true, 2.0f32), (false, 1.0)] {
            let dx = zeros_as(g, t, N);
            run(g, &kg, Grid::elementwise(N as i64, 16), &bwd_args(ddy.ptr(), mask.ptr(), dx.ptr(), N, scale));
            let mode = Tensor::new(vec![], Data::Bool(vec![training as u8])).expect("mode");
            let want = testutil::run("DropoutGrad", Attrs::default(), &[&t64(&[N], &dy), &mask_t, &Tensor::scalar_f32(0.5), &mode])[0]
                .to_f64_vec();
            assert_close(&format!("{kg} scale {scale} (training {training}), n {N}"), &host_as(&dx, t), &rounded(t, &want), rtol(t), 0.0);
        }
        if HALVES.contains(t) {
            // DropoutAdd's gradient out of an f32 stream: f32 dy (not 16-bit values), dx in t,
            // bit for bit the CPU's DropoutGrad with that dropped_type
            let kw = format!("dropout_grad_wide_{t}");
            let dy = rand_as(&mut rng, "f32", N, -1.0, 1.0);
            let ddy = dev_as(g, "f32", &dy);
            let half = if *t == "bf16" { DType::BF16 } else { DType::F16 };
            let attrs = Attrs::default().with(DROPPED_TYPE, Attr::Int(half.onnx_code() as i64));
            // the scale as the dispatcher computes it (f64, then f32)
            for (training, scale) in [(true, (1.0 / (1.0 - RATIO as f64)) as f32), (false, 1.0)] {
                let dx = zeros_as(g, t, N);
                run(g, &kw, Grid::elementwise(N as i64, 16), &bwd_args(ddy.ptr(), mask.ptr(), dx.ptr(), N, scale));
                let mode = Tensor::new(vec![], Data::Bool(vec![training as u8])).expect("mode");
                let dy_t = Tensor::from_f32(vec![N], dy.iter().map(|&v| v as f32).collect());
                let want =
                    testutil::run("DropoutGrad", attrs.clone(), &[&dy_t, &mask_t, &Tensor::scalar_f32(RATIO), &mode])[0].to_f64_vec();
                let got = host_as(&dx, t);
                if let Some(i) = (0..N).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                    panic!("{kw} scale {scale} (training {training}): element {i} is {}, the CPU's {}", got[i], want[i]);
                }
            }
        }
    }
}

/// The variant a CUDA graph records reads the seed from device memory and mixes the salt in as
/// the dispatcher does on the host (ops/random.rs): the same masks as `dropout_T` with the
/// host-mixed key, so a step draws the same masks replayed from a graph or launched directly.
#[test]
fn gpu_dropout_with_the_seed_in_device_memory_draws_the_host_keyed_masks() {
    let Some(g) = gpu("gpu_dropout_with_the_seed_in_device_memory_draws_the_host_keyed_masks") else { return };
    use crate::backend::cuda::ops::random_key;
    let mut rng = Rng::new(52);
    let salt = 0x5A17_u64;
    for seed in [SEED, 7, u64::MAX] {
        let slot = dev(g, &[seed]);
        let key = random_key(seed, salt);
        for t in FLOATS {
            let x = rand_as(&mut rng, t, N, -2.0, 2.0);
            let dx = dev_as(g, t, &x);
            let (y1, m1, y2, m2) = (zeros_as(g, t, N), zeros::<u8>(g, N), zeros_as(g, t, N), zeros::<u8>(g, N));
            run(g, &format!("dropout_{t}"), grid(), &fwd_args(dx.ptr(), y1.ptr(), m1.ptr(), N, RATIO, key, 0));
            run(g, &format!("dropout_slot_{t}"), grid(), &slot_args(dx.ptr(), y2.ptr(), m2.ptr(), N, RATIO, slot.ptr(), salt));
            assert_eq!(host::<u8>(&m2), host::<u8>(&m1), "dropout_slot_{t} seed {seed:#x}: masks differ from dropout_{t} keyed {key:#x}");
            assert_eq!(host_as(&y2, t), host_as(&y1, t), "dropout_slot_{t} seed {seed:#x}: outputs differ");
        }
    }
}

/// A ratio and a training_mode computed in the step are read on the device (the rate's
/// operands): a ratio read in any float type draws the masks and outputs of the same ratio
/// given as a constant (the constant argument then unused), training_mode 0 keeps everything
/// (y = x, mask all 1, dx = dy where kept), and a ratio read outside [0, 1) gives NaN, mask 0
/// and sets the error flag, which the session reports after the step.
#[test]
fn gpu_dropout_reads_a_ratio_and_training_mode_computed_on_the_device() {
    let Some(g) = gpu("gpu_dropout_reads_a_ratio_and_training_mode_computed_on_the_device") else { return };
    const N: usize = 10_001;
    const R: f64 = 0.25; // exact in every float type
    let grid = || Grid::elementwise(N.div_ceil(4) as i64, 8);
    let bgrid = || Grid::elementwise(N as i64, 8);
    let mut rng = Rng::new(53);
    let (off, on) = (dev(g, &[0u8]), dev(g, &[1u8]));
    for t in FLOATS {
        let k = format!("dropout_{t}");
        let kg = format!("dropout_grad_{t}");
        let x = rand_as(&mut rng, t, N, -2.0, 2.0);
        let dx = dev_as(g, t, &x);
        let dy = dev_as(g, t, &rand_as(&mut rng, t, N, -1.0, 1.0));
        // the constant launches the device-read ones must match
        let (y_c, m_c, g_c) = (zeros_as(g, t, N), zeros::<u8>(g, N), zeros_as(g, t, N));
        run(g, &k, grid(), &fwd_args(dx.ptr(), y_c.ptr(), m_c.ptr(), N, R as f32, SEED, OFFSET));
        run(g, &kg, bgrid(), &bwd_args(dy.ptr(), m_c.ptr(), g_c.ptr(), N, (1.0 / (1.0 - R)) as f32));
        let (want_y, want_m, want_g) = (host_as(&y_c, t), host::<u8>(&m_c), host_as(&g_c, t));
        let flag = zeros::<i32>(g, 1);
        for (code, rt) in FLOATS.iter().enumerate() {
            let ratio = dev_as(g, rt, &[R]);
            let on_dev = OnDevice { ratio_at: ratio.ptr(), ratio_type: code as i32, training_at: 0, err: flag.ptr() };
            let (y, m, d) = (zeros_as(g, t, N), zeros::<u8>(g, N), zeros_as(g, t, N));
            // constant arguments that would give other results if they were used
            run(g, &k, grid(), &fwd_args_on(dx.ptr(), y.ptr(), m.ptr(), N, 0.9, SEED, OFFSET, on_dev));
            run(g, &kg, bgrid(), &bwd_args_on(dy.ptr(), m.ptr(), d.ptr(), N, 7.0, on_dev));
            let what = format!("{k} with a {rt} ratio {R} read on the device");
            assert_eq!(host::<u8>(&m), want_m, "{what}: masks differ from the constant ratio's");
            assert_eq!(host_as(&y, t), want_y, "{what}: outputs differ from the constant ratio's");
            assert_eq!(host_as(&d, t), want_g, "{kg} with a {rt} ratio read on the device: dx differs from the constant's");
            // training_mode 1 on the device: the constant ratio's launch
            let trains = OnDevice { ratio_at: ratio.ptr(), ratio_type: code as i32, training_at: on.ptr(), err: flag.ptr() };
            run(g, &k, grid(), &fwd_args_on(dx.ptr(), y.ptr(), m.ptr(), N, 0.9, SEED, OFFSET, trains));
            assert_eq!(host_as(&y, t), want_y, "{what}, training_mode 1 on the device: outputs differ");
        }
        assert_eq!(host::<i32>(&flag), vec![0], "{k}: valid ratios set the error flag");
        // training_mode 0 on the device: nothing dropped, x through unscaled, dx = dy
        let idle = OnDevice { ratio_at: 0, ratio_type: 0, training_at: off.ptr(), err: flag.ptr() };
        let (y, m, d) = (zeros_as(g, t, N), zeros::<u8>(g, N), zeros_as(g, t, N));
        run(g, &k, grid(), &fwd_args_on(dx.ptr(), y.ptr(), m.ptr(), N, RATIO, SEED, OFFSET, idle));
        run(g, &kg, bgrid(), &bwd_args_on(dy.ptr(), m.ptr(), d.ptr(), N, 2.0, idle));
        assert_eq!(host_as(&y, t), host_as(&dx, t), "{k}, training_mode 0 on the device: y is not x");
        assert!(host::<u8>(&m).iter().all(|&v| v == 1), "{k}, training_mode 0 on the device: a mask element is 0");
        assert_eq!(host_as(&d, t), host_as(&dy, t), "{kg}, training_mode 0 on the device: dx is not dy");
        // ratios outside [0, 1): NaN, mask 0, the flag set
        for bad in [1.0, -0.5, f64::NAN] {
            let flag = zeros::<i32>(g, 1);
            let ratio = dev_as(g, "f32", &[bad]);
            let on_dev = OnDevice { ratio_at: ratio.ptr(), ratio_type: 0, training_at: 0, err: flag.ptr() };
            run(g, &k, grid(), &fwd_args_on(dx.ptr(), y.ptr(), m.ptr(), N, RATIO, SEED, OFFSET, on_dev));
            assert!(host_as(&y, t).iter().all(|v| v.is_nan()), "{k}, ratio {bad} read on the device: y is not all NaN");
            assert!(host::<u8>(&m).iter().all(|&v| v == 0), "{k}, ratio {bad} read on the device: a mask element is 1");
            assert_eq!(host::<i32>(&flag), vec![1], "{k}, ratio {bad} read on the device: the error flag is not set");
        }
    }
}
