//! Steps replayed from CUDA graphs (session/cuda_graph.rs) against the same steps launched
//! kernel by kernel: for every test model plus ones with a training-mode Dropout (alone, before
//! a residual add, and on an attention's probabilities, fused), three steps
//! with different inputs and seeds through one recorded forward and backward graph give the
//! outputs and gradients of the launched steps bit for bit (the same kernels in the same
//! order; Dropout reads its seed from the seed slot and draws the same masks; gradients summed
//! with float atomics, which no two runs order alike, within 1e-5), and a replay over other
//! memory is refused.

use super::exec::{download_f32, session_with, weight_data};
use super::exec_fusions::{residual_dropout, residual_dropout_of};
use super::exec_models::*;
use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::launch::DeviceBuffer;
use crate::ir::Graph;
use crate::session::cuda_graph::{GraphSlot, Graphed, PhaseRun};
use crate::session::Session;

/// The device memory of one model's steps: weights, gradient seeds, gradients, two inputs.
struct Memory {
    weights: Vec<DeviceBuffer>,
    seeds: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    inputs: Vec<DeviceBuffer>,
}

/// (outputs, gradients) of one step through `graphs` (forward, backward, seed slot) or launched.
fn step(
    s: &Session,
    m: &Model,
    mem: &Memory,
    arena: u64,
    input: usize,
    seed: u64,
    graphs: Option<(&GraphSlot, &GraphSlot, u64)>,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let g = gpu_or_reason().expect("under gpu()");
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let ptrs = |v: &[DeviceBuffer]| v.iter().map(|b| b.ptr()).collect::<Vec<u64>>();
    let (w, sd, gr) = (ptrs(&mem.weights), ptrs(&mem.seeds), ptrs(&mem.grads));
    let run = match graphs {
        None => PhaseRun::Launches,
        Some((f, _, seed_slot)) => PhaseRun::Graph(Graphed { slot: f, seed_slot }),
    };
    let inputs = [(m.sig(), mem.inputs[input].ptr())];
    let stream = std::ptr::null_mut();
    // SAFETY: every buffer holds its value's planned data and outlives the step (synchronised below).
    let mut p =
        unsafe { s.forward_cuda(rt, stream, arena, &inputs, &w, true, seed, &[], false, run) }.unwrap_or_else(|e| panic!("forward: {e}"));
    let outs = (0..s.outputs.len())
        .map(|k| {
            let (a, _, shape) = s.output_cuda(&p, k).expect("output");
            download_f32(g, a, shape.iter().product())
        })
        .collect();
    // SAFETY: as above.
    unsafe { s.backward_cuda(rt, stream, &mut p, &w, &sd, &gr, graphs.map(|(_, b, _)| b)) }.unwrap_or_else(|e| panic!("backward: {e}"));
    (outs, mem.grads.iter().map(host::<f32>).collect())
}

/// Op types whose CUDA kernels add with float atomics (their summation order varies per run).
/// Not GatherGrad (sorted, ops/gather.rs): the embedding models' steps must repeat bit for bit.
const ATOMIC_OPS: [&str; 3] = ["GatherElementsGrad", "GatherNDGrad", "MaxPoolGrad"];

fn sums_with_atomics(g: &Graph) -> bool {
    g.nodes.iter().any(|n| ATOMIC_OPS.contains(&n.op_type.as_str()))
}

#[test]
fn gpu_graphed_steps_match_launched_steps_bit_for_bit() {
    let Some(g) = gpu_alone("gpu_graphed_steps_match_launched_steps_bit_for_bit") else { return };
    let mut rng = Rng::new(23);
    let mut all: Vec<_> = models().into_iter().map(|(name, m)| (name, m, MatmulPrecision::Fp32)).collect();
    all.push(("dropout_mlp", dropout_mlp(&mut rng), MatmulPrecision::Fp32));
    all.push(("random_draws_mlp", random_draws_mlp(&mut rng), MatmulPrecision::Fp32));
    all.push(("residual_dropout", residual_dropout(&mut rng, true), MatmulPrecision::Fp32));
    // a bf16 branch's dropout into an f32 stream: dropout_add_wide_slot_bf16
    all.push(("residual_dropout bf16 into f32", residual_dropout_of(&mut rng, true, true), MatmulPrecision::Bf16));
    // an attention's dropout fused: DropoutKey reads the seed slot, the kernels the key it wrote
    // (the SIMT kernels; heads of 64 with bf16 products: the tensor-core ones)
    all.push(("attention_dropout", self_attention_dropped(&mut rng, false, 70, 4, 0.3), MatmulPrecision::Fp32));
    all.push(("attention_dropout heads of 64", self_attention_dropped(&mut rng, true, 71, 64, 0.3), MatmulPrecision::Bf16));
    for (name, m, precision) in all {
        let s = session_with(&m, crate::session::Target::Cuda, precision);
        let plan = s.plan(&[m.sig()], true).expect("plan");
        let mem = Memory {
            weights: weight_data(&m).iter().map(|w| dev(g, w)).collect(),
            seeds: s.outputs.iter().map(|&o| dev(g, &rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0))).collect(),
            grads: m.weights.iter().map(|(_, shape)| zeros::<f32>(g, shape.iter().product())).collect(),
            inputs: (0..2).map(|_| dev(g, &m.input_bytes(&mut rng))).collect(),
        };
        let bytes = s.arena_bytes(&[m.sig()], true, &[]).expect("arena size");
        let (launched_arena, graphed_arena, other_arena) = (zeros::<u8>(g, bytes), zeros::<u8>(g, bytes), zeros::<u8>(g, bytes));
        let (fwd, bwd, seed_slot) = (GraphSlot::default(), GraphSlot::default(), zeros::<u64>(g, 1));
        for (i, (input, seed)) in [(0, 11u64), (1, 12), (0, 13)].into_iter().enumerate() {
            let want = step(&s, &m, &mem, launched_arena.ptr(), input, seed, None);
            let got = step(&s, &m, &mem, graphed_arena.ptr(), input, seed, Some((&fwd, &bwd, seed_slot.ptr())));
            assert_eq!(got.0, want.0, "{name} step {i}: graphed outputs differ from launched ones");
            if sums_with_atomics(&s.graph) {
                for (k, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
                    let f = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
                    assert_close(&format!("{name} step {i}: graphed gradient {k}"), &f(a), &f(b), 1e-5, 1e-7);
                }
            } else {
                assert_eq!(got.1, want.1, "{name} step {i}: graphed gradients differ from launched ones");
            }
        }
        let nodes = fwd.nodes().expect("recorded") + bwd.nodes().expect("recorded");
        // the same graphs over another arena: refused, nothing queued
        let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
        let w: Vec<u64> = mem.weights.iter().map(|b| b.ptr()).collect();
        let run = PhaseRun::Graph(Graphed { slot: &fwd, seed_slot: seed_slot.ptr() });
        // SAFETY: as in `step`.
        let err = unsafe {
            s.forward_cuda(rt, std::ptr::null_mut(), other_arena.ptr(), &[(m.sig(), mem.inputs[0].ptr())], &w, true, 1, &[], false, run)
        }
        .err()
        .unwrap_or_else(|| panic!("{name}: a replay over another arena was not refused"));
        assert!(err.to_string().contains("recorded over other memory"), "{name}: {err}");
        println!("{name}: 3 graphed steps equal the launched ones ({nodes} graph nodes)");
    }
}
