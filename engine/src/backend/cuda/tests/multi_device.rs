//! A second GPU (`cuda:1`, as a data-parallel rank on a multi-GPU machine trains): its own
//! runtime (the kernels loaded into that device's primary context, a cuBLAS handle there), and
//! a session that steps there gives the outputs and gradients the same session gives on GPU 0,
//! bit for bit (float-atomic sums within 1e-5). A session keeps its GPU state on the device of
//! its first step, so a step on another GPU is an error that says so. Skipped where there is
//! one GPU; CI runs it on cuda-emu with ORT_EMU_DEVICES=2, where a kernel or cuBLAS operand in
//! another device's memory fails as it faults on a GPU without peer access.

use super::exec::{download_f32, session_with, weight_data};
use super::exec_models::*;
use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::runtime::CudaRuntime;
use crate::session::cuda_graph::PhaseRun;
use crate::session::{Session, Target};

/// One model's step memory on one device.
struct Memory {
    weights: Vec<DeviceBuffer>,
    seeds: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    input: DeviceBuffer,
    arena: DeviceBuffer,
}

impl Memory {
    fn on(rt: &CudaRuntime, s: &Session, m: &Model, weights: &[Vec<f32>], seeds: &[Vec<f32>], input: &[u8]) -> Self {
        let g = &rt.loaded;
        Memory {
            weights: weights.iter().map(|w| dev(g, w)).collect(),
            seeds: seeds.iter().map(|v| dev(g, v)).collect(),
            grads: m.weights.iter().map(|(_, shape)| zeros::<f32>(g, shape.iter().product())).collect(),
            input: dev(g, input),
            arena: zeros::<u8>(g, s.arena_bytes(&[m.sig()], true, &[]).expect("arena size").max(1)),
        }
    }
}

/// A step's outputs and weight gradients.
type Step = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// (outputs, gradients) of one launched training step of `s` on `rt`'s GPU.
fn step(rt: &CudaRuntime, s: &Session, m: &Model, mem: &Memory, seed: u64) -> Result<Step, String> {
    let ptrs = |v: &[DeviceBuffer]| v.iter().map(|b| b.ptr()).collect::<Vec<u64>>();
    let (w, sd, gr) = (ptrs(&mem.weights), ptrs(&mem.seeds), ptrs(&mem.grads));
    let stream = std::ptr::null_mut();
    // SAFETY: every buffer is memory of `rt`'s device holding its value's planned data, alive
    // until the synchronising downloads below.
    let mut p = unsafe {
        s.forward_cuda(rt, stream, mem.arena.ptr(), &[(m.sig(), mem.input.ptr())], &w, true, seed, &[], false, PhaseRun::Launches)
    }
    .map_err(|e| e.to_string())?;
    let outs = (0..s.outputs.len())
        .map(|k| {
            let (a, _, shape) = s.output_cuda(&p, k).expect("output");
            download_f32(&rt.loaded, a, shape.iter().product())
        })
        .collect();
    // SAFETY: as above.
    unsafe { s.backward_cuda(rt, stream, &mut p, &w, &sd, &gr, None) }.map_err(|e| e.to_string())?;
    rt.loaded.synchronize().map_err(|e| e.to_string())?;
    Ok((outs, mem.grads.iter().map(host::<f32>).collect()))
}

#[test]
fn gpu_a_second_gpu_trains_as_the_first() {
    let Some(_) = gpu("gpu_a_second_gpu_trains_as_the_first") else { return };
    let count = cudarc::driver::result::device::get_count().unwrap_or(1);
    if count < 2 {
        eprintln!("SKIPPED gpu_a_second_gpu_trains_as_the_first: one GPU here (cuda-emu: ORT_EMU_DEVICES=2)");
        return;
    }
    let rt0 = runtime_on(0).unwrap_or_else(|e| panic!("{e}"));
    let rt1 = runtime_on(1).unwrap_or_else(|e| panic!("cuda:1: {e}"));
    assert_eq!((rt0.ordinal, rt1.ordinal), (0, 1));
    assert_eq!((rt0.loaded.ctx.ordinal(), rt1.loaded.ctx.ordinal()), (0, 1), "each runtime in its own device's context");
    assert!(!std::ptr::eq(rt0, rt1), "cuda:1 has a runtime of its own");
    let mut rng = Rng::new(31);
    let mut all = models();
    all.push(("dropout_mlp", dropout_mlp(&mut rng)));
    for (name, m) in all {
        let (s0, s1) = (session_with(&m, Target::Cuda, MatmulPrecision::Fp32), session_with(&m, Target::Cuda, MatmulPrecision::Fp32));
        let plan = s0.plan(&[m.sig()], true).expect("plan");
        let weights = weight_data(&m);
        let seeds: Vec<Vec<f32>> = s0.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let input = m.input_bytes(&mut rng);
        let mem0 = Memory::on(rt0, &s0, &m, &weights, &seeds, &input);
        let mem1 = Memory::on(rt1, &s1, &m, &weights, &seeds, &input);
        let want = step(rt0, &s0, &m, &mem0, 5).unwrap_or_else(|e| panic!("{name} on cuda:0: {e}"));
        let got = step(rt1, &s1, &m, &mem1, 5).unwrap_or_else(|e| panic!("{name} on cuda:1: {e}"));
        assert_eq!(got.0, want.0, "{name}: cuda:1's outputs differ from cuda:0's");
        for (k, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
            let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
            assert_close(&format!("{name}: cuda:1's gradient {k}"), &f(a), &f(b), 1e-5, 1e-7);
        }
        // the session's constants and flags live on cuda:0 now: a step on cuda:1 is refused
        let refused = step(rt1, &s0, &m, &mem1, 6).expect_err("a cuda:0 session stepping on cuda:1");
        assert!(refused.contains("on cuda:0, so it cannot run a step on cuda:1"), "{name}: {refused}");
    }
}

#[test]
fn gpu_memory_of_another_gpu_is_not_an_operand() {
    let Some(_) = gpu("gpu_memory_of_another_gpu_is_not_an_operand") else { return };
    if !emulated() || cudarc::driver::result::device::get_count().unwrap_or(1) < 2 {
        eprintln!("SKIPPED gpu_memory_of_another_gpu_is_not_an_operand: checks cuda-emu's model of two GPUs (ORT_EMU_DEVICES=2)");
        return;
    }
    let (rt0, rt1) = (runtime_on(0).expect("cuda:0"), runtime_on(1).expect("cuda:1"));
    let m = models().into_iter().next().expect("a model").1;
    let s = session_with(&m, Target::Cuda, MatmulPrecision::Fp32);
    let plan = s.plan(&[m.sig()], true).expect("plan");
    let mut rng = Rng::new(32);
    let weights = weight_data(&m);
    let seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let input = m.input_bytes(&mut rng);
    // cuda:1's runtime and arena, cuda:0's weights: the first product or kernel fails
    let mut mixed = Memory::on(rt1, &s, &m, &weights, &seeds, &input);
    mixed.weights = weights.iter().map(|w| dev(&rt0.loaded, w)).collect();
    let err = step(rt1, &s, &m, &mixed, 1).expect_err("cuda:0's weights read by cuda:1's kernels");
    assert!(!err.is_empty());
    rt0.bind().expect("cuda:0 current again");
}
