//! The CUDA executor against the CPU executor: small graphs built here, exported to ONNX and
//! imported into a Session (so the graph passes and autodiff run as for a user's model), then
//! one training step (forward, seeded backward) on each backend; outputs and every weight
//! gradient must agree. Without a GPU the plans are still checked to have a CUDA kernel for
//! every step (so a missing kernel fails in CI, not on the rare GPU run).

use std::collections::HashMap;
use std::sync::Arc;

use super::support::*;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::backend::cuda::ops::CudaCtx;
use crate::backend::cuda::runtime;
use crate::exec::cuda::{self as cexec, DeviceArena, DeviceBindings, DeviceConsts, InputSrc};
use crate::exec::Phase;
use crate::ir::{Attr, Attrs, Dim, Graph, ValueId, ValueKind};
use crate::session::{Session, Sig};
use crate::tensor::{DType, Tensor};

/// A test model: a graph with one f32 input, named f32 weights (with data) and its outputs.
struct Model {
    graph: Graph,
    input: Vec<usize>,
    weights: Vec<(String, Vec<usize>)>,
}

fn new_model(input: &[usize]) -> (Graph, ValueId) {
    let mut g = Graph::default();
    let x = g.add_value("x", ValueKind::Input, Some(DType::F32), Some(input.iter().map(|&d| Dim::Known(d)).collect()));
    g.inputs.push(x);
    (g, x)
}

fn weight(g: &mut Graph, ws: &mut Vec<(String, Vec<usize>)>, name: &str, shape: &[usize], rng: &mut Rng) -> ValueId {
    let v = g.add_value(name, ValueKind::Weight, Some(DType::F32), Some(shape.iter().map(|&d| Dim::Known(d)).collect()));
    let n = shape.iter().product();
    g.weights.push((v, Some(Arc::new(Tensor::from_f32(shape.to_vec(), rng.f32s(n, -0.5, 0.5))))));
    ws.push((name.to_string(), shape.to_vec()));
    v
}

fn op(g: &mut Graph, name: &str, op: &str, ins: &[ValueId], attrs: Attrs) -> ValueId {
    g.add_node(name, op, ins.iter().map(|&v| Some(v)).collect(), attrs, 1)[0]
}

/// Linear layers with bias and activations over a 3-D input (batch folded into rows), a
/// batched MatMul against a weight, broadcasting arithmetic and a Transpose.
fn mlp(rng: &mut Rng) -> Model {
    let input = vec![2, 3, 5];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w1 = weight(&mut g, &mut ws, "w1", &[8, 5], rng);
    let b1 = weight(&mut g, &mut ws, "b1", &[8], rng);
    let w2 = weight(&mut g, &mut ws, "w2", &[8, 4], rng);
    let s = weight(&mut g, &mut ws, "s", &[4], rng);
    let t = op(&mut g, "t1", "Transpose", &[w1], Attrs::default().with("perm", Attr::Ints(vec![1, 0])));
    let h = op(&mut g, "mm1", "MatMul", &[x, t], Attrs::default());
    let h = op(&mut g, "add1", "Add", &[h, b1], Attrs::default());
    let h = op(&mut g, "relu", "Relu", &[h], Attrs::default());
    let h = op(&mut g, "mm2", "MatMul", &[h, w2], Attrs::default());
    let h = op(&mut g, "tanh", "Tanh", &[h], Attrs::default());
    let h2 = op(&mut g, "mul", "Mul", &[h, s], Attrs::default());
    let h3 = op(&mut g, "sig", "Sigmoid", &[h2], Attrs::default());
    let y = op(&mut g, "sub", "Sub", &[h3, h], Attrs::default());
    let yt = op(&mut g, "t2", "Transpose", &[y], Attrs::default().with("perm", Attr::Ints(vec![2, 0, 1])));
    g.outputs.push(yt);
    Model { graph: g, input, weights: ws }
}

fn session(m: &Model) -> Session {
    let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &HashMap::new(), 17).expect("export");
    let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
    Session::from_onnx(&bytes, None, &names, &vec![true; names.len()]).expect("import")
}

fn weight_data(m: &Model) -> Vec<Vec<f32>> {
    m.weights
        .iter()
        .map(|(name, _)| {
            let v = m.graph.find(name).expect("weight");
            let t = m.graph.weights.iter().find(|(w, _)| *w == v).and_then(|(_, t)| t.clone()).expect("data");
            t.to_f64_vec().into_iter().map(|x| x as f32).collect()
        })
        .collect()
}

fn bytes_of(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice covers exactly v's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// (outputs, gradients) of one step on the CPU.
fn cpu_step(s: &Session, x: &[f32], shape: &[usize], mut weights: Vec<Vec<f32>>, seeds: &mut [Vec<f32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let sig: Sig = (DType::F32, shape.to_vec());
    let wptrs: Vec<*mut u8> = weights.iter_mut().map(|w| w.as_mut_ptr() as *mut u8).collect();
    // SAFETY: every pointer holds its value's planned f32 data and outlives the calls.
    let mut pending = unsafe { s.forward(&[(sig, bytes_of(x))], &wptrs, true, 1, &[]) }.expect("cpu forward");
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

fn download_f32(g: &crate::backend::cuda::loader::Loaded, addr: u64, n: usize) -> Vec<f32> {
    g.synchronize().expect("sync");
    let mut v = vec![0f32; n];
    // SAFETY: addr holds n f32 values of a live device buffer (the arena or a bound buffer).
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, addr) }.expect("download");
    v
}

/// (outputs, gradients) of one step on the GPU, through the CUDA executor.
fn gpu_step(s: &Session, x: &[f32], shape: &[usize], weights: &[Vec<f32>], seeds: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let g = gpu_or_reason().expect("under gpu()");
    let rt = runtime::runtime(&[]).unwrap_or_else(|e| panic!("{e}"));
    let plan = s.plan(&[(DType::F32, shape.to_vec())], true).expect("plan");
    let kernels = cexec::resolve(&s.graph, &plan).unwrap_or_else(|e| panic!("{e}"));
    let consts = DeviceConsts::upload(rt, &plan).expect("constants");
    let mut arena = DeviceArena::default();
    let base = arena.reserve(rt, plan.arena_bytes).expect("arena");
    let dw: Vec<DeviceBuffer> = weights.iter().map(|w| dev(g, w)).collect();
    let ds: Vec<DeviceBuffer> = seeds.iter().map(|v| dev(g, v)).collect();
    let dg: Vec<DeviceBuffer> = weights.iter().map(|w| zeros::<f32>(g, w.len())).collect();
    let mut bind = DeviceBindings::new(s.graph.values.len());
    // SAFETY: each buffer holds its value's planned f32 data and lives until the end.
    unsafe {
        for (&v, b) in s.weights.iter().zip(&dw) {
            bind.bind(v, b.ptr());
        }
        for (sv, b) in s.seeds.iter().zip(&ds) {
            bind.bind(sv.expect("seeded"), b.ptr());
        }
        for (gv, b) in s.grads.iter().zip(&dg) {
            bind.bind(gv.expect("has a gradient"), b.ptr());
        }
    }
    let mut ctx = CudaCtx { rt, stream: std::ptr::null_mut(), seed: 1, error_flag: 0 };
    let feed = [(s.inputs[0], InputSrc::Host(bytes_of(x)))];
    cexec::run_phase(&s.graph, &plan, &kernels, Phase::Forward, base, &bind, &consts, &feed, &mut ctx).unwrap_or_else(|e| panic!("{e}"));
    let outs: Vec<Vec<f32>> = s
        .outputs
        .iter()
        .map(|&o| {
            let a = cexec::value_address(&s.graph, &plan, base, &bind, &consts, o).expect("output address");
            download_f32(g, a, plan.shape(o).iter().product())
        })
        .collect();
    cexec::run_phase(&s.graph, &plan, &kernels, Phase::Backward, base, &bind, &consts, &[], &mut ctx).unwrap_or_else(|e| panic!("{e}"));
    let grads = dg.iter().map(|b| host::<f32>(b)).collect();
    (outs, grads)
}

fn compare(name: &str, m: &Model) {
    let mut rng = Rng::new(5);
    let s = session(m);
    let x = rng.f32s(m.input.iter().product(), -1.0, 1.0);
    let plan = s.plan(&[(DType::F32, m.input.clone())], true).expect("plan");
    let mut seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let weights = weight_data(m);
    let (co, cg) = cpu_step(&s, &x, &m.input, weights.clone(), &mut seeds);
    let (go, gg) = gpu_step(&s, &x, &m.input, &weights, &seeds);
    let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    for (k, (c, g)) in co.iter().zip(&go).enumerate() {
        assert_close(&format!("{name}: output {k}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    for ((wname, _), (c, g)) in m.weights.iter().zip(cg.iter().zip(&gg)) {
        assert_close(&format!("{name}: gradient of {wname}"), &f(g), &f(c), 1e-5, 1e-6);
    }
    println!("{name}: {} outputs and {} gradients match ({})", co.len(), cg.len(), plan.describe(&s.graph).lines().last().unwrap_or(""));
}

fn models() -> Vec<(&'static str, Model)> {
    let mut rng = Rng::new(3);
    vec![("mlp", mlp(&mut rng))]
}

#[test]
fn every_test_model_has_a_cuda_kernel_for_every_step() {
    for (name, m) in models() {
        let s = session(&m);
        let plan = s.plan(&[(DType::F32, m.input.clone())], true).expect("plan");
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
