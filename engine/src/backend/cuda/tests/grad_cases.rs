//! Every gradient rule on the CUDA executor: the cases of tests/test_gradcheck.py (one tiny
//! float64 model per differentiable op, with its attribute variants and broadcasting; there
//! checked on the CPU against central differences), in float64 and again in float32 (`@f32`),
//! float16 (`@f16`) and bfloat16 (`@bf16`), each run as one training step on the CPU executor
//! and on the CUDA executor with the same weights and seeds. Outputs and weight gradients must
//! agree to rounding: within 1e-12 (f64), 1e-5 (f32), 2^-8 (f16) or 2^-5 (bf16: 4 of their
//! ulps at 1) of the largest value, as the two backends may sum in different orders and their
//! math functions differ by ulps (on cuda-emu the largest differences are 3.4e-16, 4.9e-7,
//! 8.9e-4 and 8.9e-3, and about half of the cases are bit for bit equal). The training Dropout
//! cases and the attention's dropout compare nothing but run: the CUDA masks come from Philox,
//! the CPU's from SplitMix64 (ops/random.rs); their kernel tests check the dropout identities
//! (dropout.rs, and attention_dropout.rs against an f64 reference with the Philox mask).
//!
//! The cases come from a folder written by `python tests/gradcheck_export.py DIR`; the test
//! reads `ORTRAIN_GRAD_CASES=DIR`:
//! `ORTRAIN_GRAD_CASES=DIR cargo test --release -p ortrain-engine --features cuda --lib grad_cases -- --ignored --nocapture`
//! (with cuda-emu's LD_LIBRARY_PATH where there is no GPU).

use std::path::Path;

use super::case_folders::{case_names, cases_dir, read_tensor, Tally};
use super::gpu_run::LEGACY;
use super::support::*;
use crate::session::cuda_graph::PhaseRun;
use crate::session::{Session, SessionOptions, Target};
use crate::tensor::{DType, Tensor};

/// Relative to the largest magnitude of the compared tensor: float64, float32, float16 and
/// bfloat16 cases (the 16-bit ones 4 of their ulps at 1).
const TOL_F64: f64 = 1e-12;
const TOL_F32: f64 = 1e-5;
const TOL_F16: f64 = 0.00390625;
const TOL_BF16: f64 = 0.03125;

/// Why a case is not compared, as (part of) the error the CUDA backend must give: the fused
/// attention has no float64 kernels (fuse_attention leaves an f64 attention unfused; its `@f32`,
/// `@f16` and `@bf16` cases run). A case named here that starts to run must leave this list.
fn refused(id: &str) -> Option<&'static str> {
    match id {
        "Attention-causal-mask" | "Attention-shared-kv" | "Attention-dropout" => {
            Some("the CUDA attention kernels take f32, bf16 or fp16 tensors, got float64")
        }
        _ => None,
    }
}

struct GradCase {
    onnx: Vec<u8>,
    names: Vec<String>,
    weights: Vec<Tensor>,
    /// The backward seed of each output (None: not a float64 output, no seed).
    seeds: Vec<Option<Tensor>>,
}

fn read_case(dir: &Path) -> GradCase {
    let meta = std::fs::read_to_string(dir.join("meta.txt")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let (mut names, mut outputs) = (Vec::new(), 0usize);
    for line in meta.lines() {
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["weight", name] => names.push(name.to_string()),
            ["outputs", n] => outputs = n.parse().unwrap_or_else(|e| panic!("{}: {line:?}: {e}", dir.display())),
            _ => panic!("{}: meta.txt: unexpected line {line:?}", dir.display()),
        }
    }
    let weights = (0..names.len())
        .map(|j| read_tensor(&dir.join(format!("weight_{j}.pb"))).unwrap_or_else(|| panic!("{}: no weight_{j}.pb", dir.display())))
        .collect();
    let seeds = (0..outputs).map(|k| read_tensor(&dir.join(format!("seed_{k}.pb")))).collect();
    let onnx = std::fs::read(dir.join("model.onnx")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    GradCase { onnx, names, weights, seeds }
}

/// (outputs, weight gradients) of one step, as f64 values.
type Step = (Vec<Vec<f64>>, Vec<Vec<f64>>);

fn open(c: &GradCase, target: Target) -> Result<Session, String> {
    let trainable = vec![true; c.names.len()];
    Session::from_onnx_with(&c.onnx, None, &c.names, &trainable, None, target, SessionOptions::default()).map_err(|e| e.to_string())
}

/// The step on the CPU executor.
fn cpu_step(c: &GradCase) -> Result<Step, String> {
    let s = open(c, Target::Cpu)?;
    let mut weights: Vec<Tensor> = c.weights.clone();
    let wptrs: Vec<*mut u8> = weights.iter_mut().map(|w| w.as_bytes_mut().as_mut_ptr()).collect();
    let mut seeds: Vec<Option<Tensor>> = c.seeds.clone();
    let sptrs: Vec<*mut u8> =
        seeds.iter_mut().map(|sd| sd.as_mut().map_or(std::ptr::null_mut(), |t| t.as_bytes_mut().as_mut_ptr())).collect();
    let mut grads: Vec<Tensor> = c.weights.iter().map(|w| Tensor::zeros(w.dtype(), w.shape.clone())).collect();
    let gptrs: Vec<*mut u8> = grads.iter_mut().map(|g| g.as_bytes_mut().as_mut_ptr()).collect();
    // SAFETY: every pointer holds its value's planned data (the weights, seeds and gradients are
    // the tensors' own buffers, of the declared types and shapes) and outlives both calls.
    let mut pending = unsafe { s.forward(&[], &wptrs, true, 1234, &[]) }.map_err(|e| e.to_string())?;
    let mut outs = Vec::new();
    for k in 0..s.outputs.len() {
        let (p, dt, shape) = s.output_ptr(&mut pending, k).map_err(|e| e.to_string())?;
        // SAFETY: the output holds its shape's elements of type dt while `pending` lives.
        let bytes = unsafe { std::slice::from_raw_parts(p, numel(&shape) * dt.size()) };
        outs.push(Tensor::from_bytes(dt, shape, bytes).map_err(|e| e.to_string())?.to_f64_vec());
    }
    // SAFETY: as above.
    unsafe { s.backward(pending, &wptrs, &sptrs, &gptrs) }.map_err(|e| e.to_string())?;
    Ok((outs, grads.iter().map(Tensor::to_f64_vec).collect()))
}

fn download(g: &crate::backend::cuda::loader::Loaded, dt: DType, shape: &[usize], addr: u64) -> Result<Vec<f64>, String> {
    g.synchronize().map_err(|e| e.to_string())?;
    let mut bytes = vec![0u8; numel(shape) * dt.size()];
    if !bytes.is_empty() {
        // SAFETY: addr holds the value's bytes in live device memory (the arena, a constant or a
        // buffer of this test), and the stream's work is done (synchronized above).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut bytes, addr) }.map_err(|e| e.to_string())?;
    }
    Ok(Tensor::from_bytes(dt, shape.to_vec(), &bytes).map_err(|e| e.to_string())?.to_f64_vec())
}

/// The step on the CUDA executor.
fn gpu_step(g: &crate::backend::cuda::loader::Loaded, c: &GradCase) -> Result<Step, String> {
    let rt = runtime_or_reason()?;
    let s = open(c, Target::Cuda)?;
    let arena_bytes = s.plan(&[], true).map_err(|e| e.to_string())?.arena_bytes;
    let arena = zeros::<u8>(g, arena_bytes.max(1));
    let upload = |t: &Tensor| if t.byte_len() == 0 { zeros::<u8>(g, 1) } else { dev(g, t.as_bytes()) };
    let dw: Vec<_> = c.weights.iter().map(upload).collect();
    let ds: Vec<_> = c.seeds.iter().map(|sd| sd.as_ref().map(upload)).collect();
    let dg: Vec<_> = c.weights.iter().map(|w| zeros::<u8>(g, w.byte_len().max(1))).collect();
    let wptrs: Vec<u64> = dw.iter().map(|b| b.ptr()).collect();
    let sptrs: Vec<u64> = ds.iter().map(|b| b.as_ref().map_or(0, |b| b.ptr())).collect();
    let gptrs: Vec<u64> = dg.iter().map(|b| b.ptr()).collect();
    // SAFETY: the weight, seed and gradient buffers hold their values' planned bytes, the arena
    // the plan's; all live until the downloads below, which synchronize first.
    let mut pending = unsafe { s.forward_cuda(rt, LEGACY, arena.ptr(), &[], &wptrs, true, 1234, &[], false, PhaseRun::Launches) }
        .map_err(|e| e.to_string())?;
    let mut outs = Vec::new();
    for k in 0..s.outputs.len() {
        let (addr, dt, shape) = s.output_cuda(&pending, k).map_err(|e| e.to_string())?;
        outs.push(download(g, dt, &shape, addr)?);
    }
    // SAFETY: as above.
    unsafe { s.backward_cuda(rt, LEGACY, &mut pending, &wptrs, &sptrs, &gptrs, None) }.map_err(|e| e.to_string())?;
    let grads = c.weights.iter().zip(&gptrs).map(|(w, &a)| download(g, w.dtype(), &w.shape, a)).collect::<Result<Vec<_>, _>>()?;
    Ok((outs, grads))
}

/// None when `got` is `want` within `tol` of want's largest magnitude (NaN where NaN), else why.
fn differs(what: &str, want: &[f64], got: &[f64], tol: f64) -> Option<String> {
    if want.len() != got.len() {
        return Some(format!("{what}: {} values, expected {}", got.len(), want.len()));
    }
    let scale = want.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
    let (mut bad, mut worst) = (0usize, 0f64);
    for (&x, &y) in got.iter().zip(want) {
        let ok = if x.is_nan() || y.is_nan() { x.is_nan() && y.is_nan() } else { x == y || (x - y).abs() <= tol * scale };
        if !ok {
            bad += 1;
            worst = worst.max((x - y).abs() / scale);
        }
    }
    (bad > 0).then(|| format!("{what}: {bad}/{} differ, worst {worst:.3e} of the largest value", want.len()))
}

#[test]
#[ignore = "needs ORTRAIN_GRAD_CASES (python tests/gradcheck_export.py DIR)"]
fn gpu_gradient_rules_match_the_cpu_executor() {
    let dir = cases_dir("ORTRAIN_GRAD_CASES", "python tests/gradcheck_export.py DIR");
    let Some(g) = gpu("gpu_gradient_rules_match_the_cpu_executor") else { return };
    // each op's own rule, as tests/test_gradcheck.py runs it: no pass rewrites the one-node model
    std::env::set_var(crate::passes::ENV_DISABLE, "all");
    let ids = case_names(&dir, 50);
    let (mut tally, mut random_runs) = (Tally::default(), 0);
    for id in &ids {
        let c = read_case(&dir.join(id));
        let random = (id.starts_with("Dropout") && id.contains("-train")) || id.starts_with("Attention-dropout@");
        let problem = match (cpu_step(&c), gpu_step(g, &c)) {
            (Err(e), _) => Some(format!("CPU: {}", e.lines().next().unwrap_or(""))),
            (_, Err(e)) => Some(format!("CUDA: {}", e.lines().next().unwrap_or(""))),
            (Ok(_), Ok(_)) if random => {
                random_runs += 1;
                None
            }
            (Ok((co, cg)), Ok((go, gg))) => {
                let tol = match c.weights.first().map(Tensor::dtype) {
                    Some(DType::F32) => TOL_F32,
                    Some(DType::F16) => TOL_F16,
                    Some(DType::BF16) => TOL_BF16,
                    _ => TOL_F64,
                };
                let outs = co.iter().zip(&go).enumerate().filter_map(|(k, (w, o))| differs(&format!("output {k}"), w, o, tol));
                let grads = cg.iter().zip(&gg).zip(&c.names).filter_map(|((w, o), n)| differs(&format!("d/d{n}"), w, o, tol));
                let errs: Vec<String> = outs.chain(grads).collect();
                (!errs.is_empty()).then(|| errs.join("; "))
            }
        };
        tally.record(id, problem, refused(id));
    }
    println!(
        "{} of {} gradient-check cases give the CPU executor's outputs and gradients on the CUDA executor \
         ({random_runs} with random masks run, not compared; {} refused as expected)",
        ids.len() - tally.failed.len() - tally.refused - random_runs,
        ids.len(),
        tally.refused
    );
    assert!(tally.failed.is_empty(), "{} gradient-check cases differ on CUDA:\n{}", tally.failed.len(), tally.failed.join("\n"));
}
