//! The CUDA executor against the CPU executor: small graphs built here, exported to ONNX and
//! imported into a Session (so the graph passes and autodiff run as for a user's model), then
//! one training step (forward, seeded backward) on each backend; outputs and every weight
//! gradient must agree. Without a GPU the plans are still checked to have a CUDA kernel for
//! every step (so a missing kernel fails in CI, not on the rare GPU run), the models are
//! checked to run the op types they are meant to cover, and their CPU half runs. The models
//! themselves are in tests/exec_models.rs.

use std::collections::HashMap;

use super::exec_models::*;
use super::gpu_run::GpuRun;
pub(super) use super::gpu_run::LEGACY;
use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::blas::F32Mode;
use crate::exec::cuda as cexec;
use crate::session::{Session, SessionOptions, Sig};

pub(super) fn session(m: &Model) -> Session {
    session_for(m, crate::session::Target::Cuda)
}

pub(super) fn session_for(m: &Model, target: crate::session::Target) -> Session {
    session_with(m, target, MatmulPrecision::Fp32)
}

/// A CPU session of `m` with no graph pass: the unfused reference (CPU sessions fuse the
/// attention themselves).
pub(super) fn unfused_session(m: &Model) -> Session {
    let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &HashMap::new(), 17).expect("export");
    let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
    let options = SessionOptions { unfused: true, ..Default::default() };
    Session::from_onnx_with(&bytes, None, &names, &vec![true; names.len()], None, crate::session::Target::Cpu, options).expect("import")
}

pub(super) fn session_with(m: &Model, target: crate::session::Target, precision: MatmulPrecision) -> Session {
    // the attention fusion and the autocast pass are opt-in; every test here wants them (no
    // test reads the variable expecting it unset; autocast changes bf16/fp16 sessions only)
    std::env::set_var(crate::passes::ENV_ENABLE, "fuse_attention,autocast");
    let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &HashMap::new(), 17).expect("export");
    let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
    let options = SessionOptions { matmul_precision: precision, ..Default::default() };
    Session::from_onnx_with(&bytes, None, &names, &vec![true; names.len()], None, target, options).expect("import")
}

pub(super) fn weight_data(m: &Model) -> Vec<Vec<f32>> {
    m.weights
        .iter()
        .map(|(name, _)| {
            let v = m.graph.find(name).expect("weight");
            let t = m.graph.weights.iter().find(|(w, _)| *w == v).and_then(|(_, t)| t.clone()).expect("data");
            t.to_f64_vec().into_iter().map(|x| x as f32).collect()
        })
        .collect()
}

/// (outputs, gradients) of one step on the CPU.
pub(super) fn cpu_step(
    s: &Session,
    x: &[u8],
    sig: &Sig,
    mut weights: Vec<Vec<f32>>,
    seeds: &mut [Vec<f32>],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let wptrs: Vec<*mut u8> = weights.iter_mut().map(|w| w.as_mut_ptr() as *mut u8).collect();
    // SAFETY: every pointer holds its value's planned f32 data and outlives the calls.
    let mut pending = unsafe { s.forward(&[(sig.clone(), x)], &wptrs, true, 1, &[]) }.expect("cpu forward");
    let outs: Vec<Vec<f32>> = (0..s.outputs.len())
        .map(|k| {
            let (p, _, shape) = s.output_ptr(&mut pending, k).expect("output");
            let n: usize = shape.iter().product();
            // SAFETY: the output holds n f32 values while `pending` lives.
            unsafe { std::slice::from_raw_parts(p as *const f32, n) }.to_vec()
        })
        .collect();
    let mut grads: Vec<Vec<f32>> = weights.iter().map(|w| vec![0.0; w.len()]).collect();
    let sptrs: Vec<*mut u8> = seeds.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
    let gptrs: Vec<*mut u8> = grads.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
    // SAFETY: as above, for seeds and gradients.
    unsafe { s.backward(pending, &wptrs, &sptrs, &gptrs) }.expect("cpu backward");
    (outs, grads)
}

pub(super) fn download_f32(g: &crate::backend::cuda::loader::Loaded, addr: u64, n: usize) -> Vec<f32> {
    g.synchronize().expect("sync");
    let mut v = vec![0f32; n];
    // SAFETY: addr holds n f32 values of a live device buffer (the arena or a bound buffer).
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, addr) }.expect("download");
    v
}

/// (outputs, gradients) of one step on the GPU, through the CUDA executor.
pub(super) fn gpu_step(s: &Session, x: &[u8], sig: &Sig, weights: &[Vec<f32>], seeds: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    gpu_step_in(s, x, sig, weights, seeds, F32Mode::Exact, LEGACY)
}

/// As `gpu_step`, with the session's f32 matmuls in `mode` and the phases queued on `stream`.
pub(super) fn gpu_step_in(
    s: &Session,
    x: &[u8],
    sig: &Sig,
    weights: &[Vec<f32>],
    seeds: &[Vec<f32>],
    mode: F32Mode,
    stream: cudarc::driver::sys::CUstream,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    assert!(s.grads.iter().all(Option::is_some), "every weight has a gradient");
    GpuRun::new(s, std::slice::from_ref(sig), weights, seeds, mode, stream).step(&[x])
}

fn compare(name: &str, m: &Model) {
    let mut rng = Rng::new(5);
    let s = session(m);
    let x = m.input_bytes(&mut rng);
    let sig = m.sig();
    let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
    let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let weights = weight_data(m);
    let (co, cg) = cpu_step(&s, &x, &sig, weights.clone(), &mut seeds);
    let (go, gg) = gpu_step(&s, &x, &sig, &weights, &seeds);
    let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    for (k, (c, g)) in co.iter().zip(&go).enumerate() {
        assert_close(&format!("{name}: output {k}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    for ((wname, _), (c, g)) in m.weights.iter().zip(cg.iter().zip(&gg)) {
        assert_close(&format!("{name}: gradient of {wname}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    println!("{name}: {} outputs and {} gradients match ({})", co.len(), cg.len(), plan.describe(&s.graph).lines().last().unwrap_or(""));
}

#[test]
fn every_test_model_has_a_cuda_kernel_for_every_step() {
    for (name, m) in models() {
        let s = session(&m);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let missing = cexec::missing_kernels(&s.graph, &plan);
        assert!(missing.is_empty(), "{name}: no CUDA kernel for {missing:?}");
    }
}

#[test]
fn gpu_train_step_matches_the_cpu_executor() {
    let Some(_) = gpu("gpu_train_step_matches_the_cpu_executor") else { return };
    for (name, m) in models() {
        compare(name, &m);
    }
}

/// Two threads stepping their own models at once on the same (legacy) stream get bit for bit
/// what each gets alone: every phase claims the runtime's shared scratch (claim.rs), so their
/// kernels do not interleave on it. Before the claim, one thread's LM head read the other's
/// logits chunk (found by cuda-emu, running two of these tests at once).
#[test]
fn gpu_two_threads_stepping_at_once_get_what_each_gets_alone() {
    let Some(_) = gpu("gpu_two_threads_stepping_at_once_get_what_each_gets_alone") else { return };
    two_threads_step_as_alone(false);
}

/// The same with each thread on a stream of its own (as two PyTorch streams), which the GPU may
/// run at the same time: a claim on another stream than the last one makes the new stream wait
/// for the previous one (claim.rs), so the shared scratch is still used by one phase at a time.
/// cuda-emu runs the work of two streams in a random order where nothing orders them.
#[test]
fn gpu_two_threads_on_their_own_streams_get_what_each_gets_alone() {
    let Some(_) = gpu("gpu_two_threads_on_their_own_streams_get_what_each_gets_alone") else { return };
    two_threads_step_as_alone(true);
}

fn two_threads_step_as_alone(own_streams: bool) {
    use cudarc::driver::result::stream;
    // each thread builds its model and session, then all step together
    let stepper = |seed: u64, start: Option<&std::sync::Barrier>, steps: usize| {
        let mut rng = Rng::new(seed);
        let m = lm_head(&mut rng, true);
        let s = session(&m);
        let sig = m.sig();
        let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
        let x = m.input_bytes(&mut rng);
        let seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let on = if own_streams {
            runtime_or_reason().unwrap_or_else(|e| panic!("{e}")).bind().expect("bind");
            stream::create(stream::StreamKind::NonBlocking).expect("stream")
        } else {
            LEGACY
        };
        if let Some(b) = start {
            b.wait();
        }
        // the streams are not destroyed: the runtime's claims may still name them (claim.rs)
        (0..steps).map(|_| gpu_step_in(&s, &x, &sig, &weight_data(&m), &seeds, F32Mode::Exact, on)).collect::<Vec<Step>>()
    };
    let alone = [31, 37].map(|seed| stepper(seed, None, 1).remove(0));
    let start = std::sync::Barrier::new(2);
    let together: Vec<Vec<Step>> = std::thread::scope(|scope| {
        let threads = [31, 37].map(|seed| {
            let (stepper, start) = (&stepper, &start);
            scope.spawn(move || stepper(seed, Some(start), 8))
        });
        threads.into_iter().map(|t| t.join().expect("a stepping thread panicked")).collect()
    });
    let bits = |s: &Step| [&s.0, &s.1].map(|vs| vs.iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()).collect::<Vec<_>>());
    for (k, (one, runs)) in alone.iter().zip(&together).enumerate() {
        for (r, run) in runs.iter().enumerate() {
            assert!(bits(run) == bits(one), "thread {k}, step {r}: outputs or gradients differ from the same step run alone");
        }
    }
}

/// At bf16 or f16 matmul precision, f32 attention with heads of 64 and 128 runs on the
/// tensor-core kernels (kernels/attention_mma.cu, products in that 16-bit type; 150 rows: three
/// 64-row tiles, the last partial, and the causal mask's upper tiles skipped): outputs and weight
/// gradients within that type's precision of the CPU executor's exact f32, for both exporter
/// forms.
#[test]
fn gpu_tensor_core_attention_matches_the_cpu_executor() {
    let Some(_) = gpu("gpu_tensor_core_attention_matches_the_cpu_executor") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = Rng::new(17);
    // (matmul precision, kernel instance, tolerance: bf16 keeps 8 bits, f16 11)
    for (mode, instance, tol) in [(F32Mode::Bf16, "f32", 3e-2), (F32Mode::F16, "f32f16", 4e-3)] {
        for hd in [64, 128] {
            for torchlib in [true, false] {
                let m = self_attention_of(&mut rng, torchlib, 150, hd);
                let name = format!("{mode:?}, heads of {hd}, torchlib={torchlib}");
                let s = session(&m);
                let x = m.input_bytes(&mut rng);
                let sig = m.sig();
                let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
                let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
                let cpu = cpu_step(&s, &x, &sig, weight_data(&m), &mut seeds);
                let gpu = gpu_step_in(&s, &x, &sig, &weight_data(&m), &seeds, mode, LEGACY);
                assert_step_close(&name, &m, &gpu, &cpu, tol);
                for kind in ["fwd", "bwd_dq", "bwd_dkv"] {
                    let k = format!("attention_mma_{kind}_d{hd}_{instance}");
                    assert!(rt.has_launched(&k), "{name}: {k} never launched");
                }
                println!("{name}: output and {} gradients within {tol:e} of the largest value", cpu.1.len());
            }
        }
    }
}

/// A bf16 or fp16 session with the autocast pass: Q, Kᵀ, V, the mask and the fused attention's
/// output are 16-bit tensors in the plan. Without a GPU: every step has a CUDA kernel. On a GPU,
/// heads of 64 run the tensor-core kernels on the 16-bit tensors as they are, heads of 32 the f32
/// kernels on widened copies (ops/widen.rs): outputs and weight gradients within the 16-bit
/// type's precision of the CPU executor's (which widens every 16-bit kernel call to f32).
#[test]
fn sixteen_bit_attention_runs_on_sixteen_bit_tensors_and_matches_the_cpu_executor() {
    let mut rng = Rng::new(23);
    for (precision, dtype) in [(MatmulPrecision::Bf16, crate::tensor::DType::BF16), (MatmulPrecision::Fp16, crate::tensor::DType::F16)] {
        for hd in [64, 32] {
            let m = self_attention_of(&mut rng, true, 70, hd);
            let s = session_with(&m, crate::session::Target::Cuda, precision);
            let sig = m.sig();
            let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
            let attention = plan.steps.iter().map(|n| &s.graph.nodes[n.0]).find(|n| n.op_type == "Attention").expect("a fused attention");
            let q = attention.input(0).expect("q");
            assert_eq!(plan.dtype(q), Some(dtype), "{precision:?}, heads of {hd}: Q's type in the plan");
            half_step_matches(
                &format!("{precision:?}, heads of {hd}"),
                "sixteen_bit_attention_runs_on_sixteen_bit_tensors_and_matches_the_cpu_executor",
                &m,
                &s,
                &plan,
                &mut rng,
                precision,
            );
        }
    }
}

/// Every output and weight gradient of a step (`got`: outputs, gradients) within `rtol` of the
/// largest value of `want`'s (`assert_close_scaled`), named `{label}: output k` and
/// `{label}: gradient of <weight>`.
pub(super) type Step = (Vec<Vec<f32>>, Vec<Vec<f32>>);
pub(super) fn assert_step_close(label: &str, m: &Model, got: &Step, want: &Step, rtol: f64) {
    let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    for (k, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert_close_scaled(&format!("{label}: output {k}"), &f(g), &f(w), rtol);
    }
    for ((wname, _), (g, w)) in m.weights.iter().zip(got.1.iter().zip(&want.1)) {
        assert_close_scaled(&format!("{label}: gradient of {wname}"), &f(g), &f(w), rtol);
    }
}

/// One train step of the bf16 session `s` of `m` (plan `plan`): a CUDA kernel for every step;
/// on the CPU, outputs and weight gradients within 3e-2 (of the largest value) of the fp32
/// session's, as the CPU widens every 16-bit kernel call; on a GPU (`test` names the skip),
/// the same within 3e-2 of the CPU's.
pub(super) fn bf16_step_matches(label: &str, test: &str, m: &Model, s: &Session, plan: &crate::plan::Plan, rng: &mut Rng) {
    half_step_matches(label, test, m, s, plan, rng, MatmulPrecision::Bf16)
}

/// bf16_step_matches for a session of `precision` (Bf16 or Fp16; 3e-2 both: the fp16 session's
/// f32 parts differ from the fp32 session's by more than f16's rounding).
pub(super) fn half_step_matches(
    label: &str,
    test: &str,
    m: &Model,
    s: &Session,
    plan: &crate::plan::Plan,
    rng: &mut Rng,
    precision: MatmulPrecision,
) {
    let mode = if precision == MatmulPrecision::Fp16 { F32Mode::F16 } else { F32Mode::Bf16 };
    let missing = cexec::missing_kernels(&s.graph, plan);
    assert!(missing.is_empty(), "{label}: no CUDA kernel for {missing:?}");
    let sig = m.sig();
    let x = m.input_bytes(rng);
    let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let cpu = cpu_step(s, &x, &sig, weight_data(m), &mut seeds);
    let exact = session_with(m, crate::session::Target::Cuda, MatmulPrecision::Fp32);
    let exact = cpu_step(&exact, &x, &sig, weight_data(m), &mut seeds.clone());
    assert_step_close(&format!("{label}: CPU {precision:?}"), m, &cpu, &exact, 3e-2);
    let Some(_) = gpu(test) else { return };
    let gpu = gpu_step_in(s, &x, &sig, &weight_data(m), &seeds, mode, LEGACY);
    assert_step_close(label, m, &gpu, &cpu, 3e-2);
    println!("{label}: {precision:?} outputs and {} gradients within 3e-2 of the largest value", cpu.1.len());
}

/// 16-bit plans (the autocast pass) of models whose kernels need more than a 16-bit instance:
/// - `qkv_select`, three of four stacked parts taken by Gathers: their three GatherGrads get
///   bf16 gradients, which `gather_grad_rows_bf16` sums in f32 (it once failed to find a
///   `gather_grad_bf16`); `qkv_split`, the tutorial's q/k/v (all three parts), whose Gathers
///   selects_to_split makes one Split: one bf16 Concat for the gradient;
/// - `conv_net`: bf16 Convs, whose weight and bias gradients sum by products with the runtime's
///   ones, which must be bf16 ones (they were f32 ones read as bf16 pairs: 0, 1, 0, 1, …).
///
/// Without a GPU: the plans have those 16-bit steps, a kernel for every step, and the CPU's
/// bf16 step follows the f32 one. On a GPU: the same step within bf16's precision of the CPU
/// executor's.
#[test]
fn sixteen_bit_gathers_and_convs_match_the_cpu_executor() {
    let mut rng = Rng::new(29);
    let cases = [
        ("qkv_select", qkv_select(&mut rng, 4), "GatherGrad", 3),
        ("qkv_split", qkv_select(&mut rng, 3), "Concat", 1),
        ("conv_net", conv_net(&mut rng), "ConvGradW", 1),
    ];
    for (name, m, op, count) in cases {
        let s = session_with(&m, crate::session::Target::Cuda, MatmulPrecision::Bf16);
        let sig = m.sig();
        let plan = s.plan(std::slice::from_ref(&sig), true).expect("plan");
        let bf16 = |n: &&crate::ir::Node| n.op_type == op && n.input(0).is_some_and(|v| plan.dtype(v) == Some(crate::tensor::DType::BF16));
        let steps = plan.steps.iter().map(|n| &s.graph.nodes[n.0]).filter(bf16).count();
        assert_eq!(steps, count, "{name}: {op} steps on bf16 tensors");
        bf16_step_matches(name, "sixteen_bit_gathers_and_convs_match_the_cpu_executor", &m, &s, &plan, &mut rng);
    }
}

/// `pow_mixed`'s exponents reach the CUDA plan with their own types (int64, int32, float64),
/// which the Pow dispatcher casts to the base's type before `pow_f32` reads them; the GPU half
/// is `gpu_train_step_matches_the_cpu_executor`.
#[test]
fn pow_exponents_keep_their_types_in_the_cuda_plan() {
    let m = pow_mixed(&mut Rng::new(5));
    let s = session(&m);
    let plan = s.plan(&[m.sig()], true).expect("plan");
    let mut exponents: Vec<_> = plan
        .steps
        .iter()
        .map(|n| &s.graph.nodes[n.0])
        .filter(|n| n.op_type == "Pow" && ["square", "cube", "square_f64"].contains(&n.name.as_str()))
        .map(|n| (plan.dtype(n.input(0).expect("base")), plan.dtype(n.input(1).expect("exponent"))))
        .collect();
    exponents.sort_by_key(|(_, e)| format!("{e:?}"));
    use crate::tensor::DType::{F32, F64, I32, I64};
    assert_eq!(exponents, vec![(Some(F32), Some(F64)), (Some(F32), Some(I32)), (Some(F32), Some(I64))]);
}

/// The test models together run every op type of the CUDA kernel table that has no other
/// train-step coverage here (forward, and backward where the op has a gradient).
#[test]
fn test_models_cover_every_dispatcher_family() {
    let mut seen = std::collections::BTreeSet::new();
    for (name, m) in models() {
        let s = session(&m);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        seen.extend(plan.steps.iter().map(|n| s.graph.nodes[n.0].op_type.clone()));
    }
    let want = [
        "Expand",
        "Slice",
        "SliceGrad",
        "Concat",
        "ConcatGrad",
        "Split",
        "Trilu",
        "Cast",
        "CastLike",
        "Mod",
        "MinMaxGrad",
        "ErfGrad",
        "IsNaN",
        "IsInf",
        "MaskSelect",
        "Affine",
        "Where",
        "Gather",
        "GatherGrad",
        "GatherElements",
        "GatherElementsGrad",
        "LinearCrossEntropy",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceGrad",
        "Conv",
        "ConvGradX",
        "ConvGradW",
        "ConvGradB",
        "BatchNormalization",
        "BatchNormGrad",
        "MaxPool",
        "MaxPoolGrad",
        "AveragePool",
        "AveragePoolGrad",
        "GlobalAveragePool",
        "GlobalAveragePoolGrad",
        "CumSum",
        "GatherND",
        "GatherNDGrad",
        "MatMulGeluGrad",
    ];
    let missing: Vec<&str> = want.iter().copied().filter(|o| !seen.contains(*o)).collect();
    assert!(missing.is_empty(), "no test model runs {missing:?}; steps seen: {seen:?}");
}

/// Hugging Face's causal masks fill with finfo.min (f32::MIN), not -inf. The tensor-core
/// kernels skip those tiles too in rows that already have a real score, where every exp is
/// exactly 0: a train step with the finfo.min mask gives the -inf mask's outputs and
/// gradients bit for bit (heads of 64 and 128, 150 rows: the upper tiles of three 64-row
/// tiles skipped, the diagonal ones computed with both kinds of masked scores).
#[test]
fn gpu_finfo_min_causal_masks_train_bit_for_bit_like_infinite_ones() {
    let mut runs = Vec::new();
    for hd in [64, 128] {
        for fill in [f32::NEG_INFINITY, f32::MIN] {
            let m = self_attention_masked(&mut Rng::new(37), true, 150, hd, fill);
            let s = session_with(&m, crate::session::Target::Cuda, MatmulPrecision::Bf16);
            let attention = s.graph.nodes.iter().filter(|n| n.op_type == "Attention").collect::<Vec<_>>();
            assert_eq!(attention.len(), 1, "heads of {hd}, fill {fill}: fused");
            // the mask stays f32 (rounded to bf16, finfo.min would become -inf)
            let plan = s.plan(&[m.sig()], true).expect("plan");
            let mask = attention[0].inputs.get(3).copied().flatten().expect("the causal mask");
            assert_eq!(plan.dtype(mask), Some(crate::tensor::DType::F32), "heads of {hd}, fill {fill}: the mask's type");
            runs.push((hd, fill, m, s));
        }
    }
    let Some(_) = gpu("gpu_finfo_min_causal_masks_train_bit_for_bit_like_infinite_ones") else { return };
    for pair in runs.chunks(2) {
        let [(hd, _, mi, si), (_, _, mf, sf)] = pair else { unreachable!("pairs") };
        let x = mi.input_bytes(&mut Rng::new(41));
        let sig = mi.sig();
        let plan = si.plan(std::slice::from_ref(&sig), true).expect("plan");
        let seeds: Vec<Vec<f32>> = si.outputs.iter().map(|&o| Rng::new(43).f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let (oi, gi) = gpu_step_in(si, &x, &sig, &weight_data(mi), &seeds, F32Mode::Bf16, LEGACY);
        let (of, gf) = gpu_step_in(sf, &x, &mf.sig(), &weight_data(mf), &seeds, F32Mode::Bf16, LEGACY);
        let bits = |v: &[Vec<f32>]| v.iter().map(|t| t.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()).collect::<Vec<_>>();
        assert_eq!(bits(&of), bits(&oi), "heads of {hd}: outputs with the finfo.min mask");
        assert_eq!(bits(&gf), bits(&gi), "heads of {hd}: weight gradients with the finfo.min mask");
        println!("heads of {hd}: finfo.min and -inf causal masks give the same bits");
    }
}

/// An fp16 session's fused LM head over 4096 rows and 8192 classes with the mean: its
/// unit-seed gradient G is about softmax/4096 ≈ 3e-8 per entry, under f16's smallest
/// subnormal, and the loss scale multiplies it only afterwards. Its two products must not
/// round G to f16 (they run at TF32): the weight gradient and the loss within 1e-2 of the CPU
/// executor's exact f32 (rounded to f16, G's softmax part was all zeros: dW 0.7 off).
#[test]
fn gpu_fp16_lm_head_keeps_its_small_softmax_gradient() {
    let mut rng = Rng::new(19);
    let m = lm_head_with(&mut rng, vec![4, 1024, 16], 8192, false, "mean");
    let s = session(&m);
    assert_eq!(s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "LinearCrossEntropy").count(), 1);
    let Some(_) = gpu("gpu_fp16_lm_head_keeps_its_small_softmax_gradient") else { return };
    let x = m.input_bytes(&mut rng);
    let sig = m.sig();
    let mut seeds = vec![vec![1.0f32]];
    let cpu = cpu_step(&s, &x, &sig, weight_data(&m), &mut seeds);
    let gpu = gpu_step_in(&s, &x, &sig, &weight_data(&m), &seeds, F32Mode::F16, LEGACY);
    assert_step_close("fp16 LM head", &m, &gpu, &cpu, 1e-2);
}

/// Mixed-precision sessions round the fused LM head's operands once per op (W) and per chunk
/// (X_c, and G in bf16 sessions, at a row stride of whole 16-byte vectors) instead of per gemm:
/// both LM heads (two chunks with transB, bias, class weights and ignore_index; W [K, C] with no
/// bias, one chunk and two), 40 classes and 43 (G's rows padded), bf16 and fp16 sessions within
/// 3e-2 of the largest value of the CPU executor's exact f32.
#[test]
fn gpu_mixed_precision_lm_heads_match_the_cpu_executor() {
    let Some(_) = gpu("gpu_mixed_precision_lm_heads_match_the_cpu_executor") else { return };
    let mut rng = Rng::new(23);
    for (big, full, classes) in [(true, true, 40), (false, false, 40), (true, true, 43), (false, false, 43), (true, false, 43)] {
        // lm_head's two models; with 43 classes G's 16-bit copy is padded to rows of 48
        let input = if big { vec![3, 3000, 8] } else { vec![2, 35, 8] };
        let m = lm_head_with(&mut rng, input, classes, full, if big { "mean" } else { "sum" });
        let s = session(&m);
        let x = m.input_bytes(&mut rng);
        let sig = m.sig();
        let mut seeds = vec![vec![0.75f32]];
        let cpu = cpu_step(&s, &x, &sig, weight_data(&m), &mut seeds);
        for mode in [F32Mode::Bf16, F32Mode::F16] {
            let gpu = gpu_step_in(&s, &x, &sig, &weight_data(&m), &seeds, mode, LEGACY);
            assert_step_close(&format!("lm_head big={big} classes={classes} {mode:?}"), &m, &gpu, &cpu, 3e-2);
        }
    }
}

/// Without a GPU, the CPU half of the comparison still runs: every test model imports, gives
/// every weight a gradient and runs a train step on the CPU executor with finite results.
#[test]
fn every_test_model_runs_a_cpu_train_step() {
    for (name, m) in models() {
        let mut rng = Rng::new(5);
        let s = session(&m);
        assert!(s.grads.iter().all(|g| g.is_some()), "{name}: a weight has no gradient");
        let x = m.input_bytes(&mut rng);
        let plan = s.plan(&[m.sig()], true).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let (outs, grads) = cpu_step(&s, &x, &m.sig(), weight_data(&m), &mut seeds);
        for (what, v) in outs.iter().map(|v| ("output", v)).chain(grads.iter().map(|g| ("gradient", g))) {
            assert!(v.iter().all(|x| x.is_finite()), "{name}: a {what} is not finite");
        }
        assert!(grads.iter().all(|g| g.iter().any(|&x| x != 0.0)), "{name}: a gradient is all zero");
    }
}
