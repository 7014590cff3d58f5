//! ONNX conformance on the CUDA executor: every node case of tests/conformance/manifest.txt that
//! is a plain forward model (the CPU passes them all) runs through a CUDA session and must give
//! onnx's expected outputs within the backend tests' tolerances (rtol 1e-3, atol 1e-7 for floats,
//! NaN where NaN is expected; exact for integers and bools; same type and shape), as the CPU's
//! conformance test asks. The kernel tests check each kernel against the CPU on random inputs;
//! these check what onnx's cases vary: attributes, broadcasting, negative axes, empty tensors,
//! integer and 64-bit element types, the edge values onnx chose.
//!
//! The cases come from a folder written by `python -m tests.conformance.cuda_export DIR`; the
//! test reads `ORTRAIN_NODE_CASES=DIR`:
//! `ORTRAIN_NODE_CASES=DIR cargo test --release -p ortrain-engine --features cuda --lib node_cases -- --ignored --nocapture`
//! (with cuda-emu's LD_LIBRARY_PATH where there is no GPU).

use std::path::Path;

use super::case_folders::{case_names, cases_dir, read_tensor, Tally};
use super::gpu_run::LEGACY;
use super::support::*;
use crate::session::cuda_graph::PhaseRun;
use crate::session::{Session, SessionOptions, Target};
use crate::tensor::{DType, Tensor};

const RTOL: f64 = 1e-3;
const ATOL: f64 = 1e-7;

/// Cases the CUDA backend refuses, with (part of) the error it must give; none since a
/// Dropout's computed ratio and training_mode are read on the device (kernels/dropout.cu). A
/// case here that starts to pass must leave the list.
const REFUSED: &[(&str, &str)] = &[];

/// `kind_0.pb`, `kind_1.pb`, ... of a case folder, in order.
fn read_tensors(dir: &Path, kind: &str) -> Vec<Tensor> {
    (0..).map_while(|j| read_tensor(&dir.join(format!("{kind}_{j}.pb")))).collect()
}

/// An output downloaded from the GPU: type, shape, bytes.
type Downloaded = (DType, Vec<usize>, Vec<u8>);

/// The case's outputs computed on the GPU, or the engine's error.
fn run_on_gpu(g: &crate::backend::cuda::loader::Loaded, dir: &Path, inputs: &[Tensor]) -> Result<Vec<Downloaded>, String> {
    let rt = runtime_or_reason()?;
    let onnx = std::fs::read(dir.join("model.onnx")).map_err(|e| e.to_string())?;
    let s = Session::from_onnx_with(&onnx, None, &[], &[], None, Target::Cuda, SessionOptions::default()).map_err(|e| e.to_string())?;
    let sigs: Vec<_> = inputs.iter().map(|t| (t.dtype(), t.shape.clone())).collect();
    let arena_bytes = s.plan(&sigs, false).map_err(|e| e.to_string())?.arena_bytes;
    // device copies of the inputs (one byte at least: an empty tensor still needs an address)
    let bufs: Vec<_> = inputs.iter().map(|t| if t.byte_len() == 0 { zeros::<u8>(g, 1) } else { dev(g, t.as_bytes()) }).collect();
    let arena = zeros::<u8>(g, arena_bytes.max(1));
    let feed: Vec<_> = sigs.iter().cloned().zip(bufs.iter().map(|b| b.ptr())).collect();
    // SAFETY: each input buffer holds its tensor's bytes and the arena the plan's bytes; all live
    // until the outputs are downloaded below (the synchronize before them orders the reads).
    let pending = unsafe { s.forward_cuda(rt, LEGACY, arena.ptr(), &feed, &[], false, 1, &[], false, PhaseRun::Launches) }
        .map_err(|e| e.to_string())?;
    g.synchronize().map_err(|e| e.to_string())?;
    let mut outs = Vec::new();
    for k in 0..s.outputs.len() {
        let (addr, dt, shape) = s.output_cuda(&pending, k).map_err(|e| e.to_string())?;
        let n = numel(&shape) * dt.size();
        let mut bytes = vec![0u8; n];
        if n > 0 {
            // SAFETY: addr holds the output's n planned bytes, in the arena or a constant, alive
            // while `pending` and `arena` are.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut bytes, addr) }.map_err(|e| e.to_string())?;
        }
        outs.push((dt, shape, bytes));
    }
    Ok(outs)
}

/// None when `got` is `want` within the tolerances, else a line saying how it differs.
fn differs(k: usize, want: &Tensor, got: &Downloaded) -> Option<String> {
    let (dt, shape, bytes) = got;
    if *dt != want.dtype() {
        return Some(format!("output {k}: type {}, expected {}", dt.name(), want.dtype().name()));
    }
    if *shape != want.shape {
        return Some(format!("output {k}: shape {shape:?}, expected {:?}", want.shape));
    }
    if !dt.is_float() {
        let bad = bytes.chunks(dt.size()).zip(want.as_bytes().chunks(dt.size())).filter(|(a, b)| a != b).count();
        return (bad > 0).then(|| format!("output {k}: {bad}/{} elements differ", want.numel()));
    }
    let got = Tensor::from_bytes(*dt, shape.clone(), bytes).expect("sized from the plan").to_f64_vec();
    let (mut bad, mut worst) = (0usize, 0f64);
    for (&x, &y) in got.iter().zip(&want.to_f64_vec()) {
        let ok = if x.is_nan() || y.is_nan() { x.is_nan() && y.is_nan() } else { x == y || (x - y).abs() <= ATOL + RTOL * y.abs() };
        if !ok {
            bad += 1;
            worst = worst.max((x - y).abs());
        }
    }
    (bad > 0).then(|| format!("output {k}: {bad}/{} differ, max |diff| {worst:.3e}", want.numel()))
}

#[test]
#[ignore = "needs ORTRAIN_NODE_CASES (python -m tests.conformance.cuda_export DIR)"]
fn gpu_onnx_node_cases_give_onnx_outputs() {
    let dir = cases_dir("ORTRAIN_NODE_CASES", "python -m tests.conformance.cuda_export DIR");
    let Some(g) = gpu("gpu_onnx_node_cases_give_onnx_outputs") else { return };
    let names = case_names(&dir, 100);
    let mut tally = Tally::default();
    for name in &names {
        let case = dir.join(name);
        let (inputs, want) = (read_tensors(&case, "input"), read_tensors(&case, "output"));
        let problem = match run_on_gpu(g, &case, &inputs) {
            Err(e) => Some(format!("error: {}", e.lines().next().unwrap_or(""))),
            Ok(got) if got.len() != want.len() => Some(format!("{} outputs, expected {}", got.len(), want.len())),
            Ok(got) => {
                let errs: Vec<String> = want.iter().zip(&got).enumerate().filter_map(|(k, (w, o))| differs(k, w, o)).collect();
                (!errs.is_empty()).then(|| errs.join("; "))
            }
        };
        tally.record(name, problem, REFUSED.iter().find(|r| r.0 == name.as_str()).map(|r| r.1));
    }
    println!(
        "{} of {} ONNX node cases give onnx's outputs on the CUDA executor ({} refused with the expected error)",
        names.len() - tally.failed.len() - tally.refused,
        names.len(),
        tally.refused
    );
    assert!(tally.failed.is_empty(), "{} node cases differ on CUDA:\n{}", tally.failed.len(), tally.failed.join("\n"));
}
