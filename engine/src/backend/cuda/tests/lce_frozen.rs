//! A frozen LM head (passes/lce_weight_grad.rs): x [3, 3000, 8] through a trainable projection
//! W0, then the fused head (W [40, 8] through a Transpose, a bias, class weights, ignore_index,
//! the mean, many chunks). With W not trainable the LinearCrossEntropy skips dW₁ (empty, no
//! product); the loss and the other weights' gradients are the trainable-head session's bit
//! for bit, on the CPU executor for CPU and CUDA sessions and on the GPU.

use std::collections::HashMap;

use super::exec::{cpu_step, weight_data};
use super::exec_models::*;
use super::gpu_run::{GpuRun, LEGACY};
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::ir::{Attr, Attrs};
use crate::session::{Session, SessionOptions, Target};
use crate::tensor::{DType, Tensor};

fn projected_head(rng: &mut Rng) -> Model {
    let (c, k) = (40, 8);
    let input = vec![3, 3000, k];
    let rows = 9000;
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let w0 = weight(&mut g, &mut ws, "w0", &[k, k], rng);
    let w = weight(&mut g, &mut ws, "w", &[c, k], rng);
    let b = weight(&mut g, &mut ws, "b", &[c], rng);
    let h0 = op(&mut g, "proj", "MatMul", &[x, w0], Attrs::default());
    let wt = op(&mut g, "w_t", "Transpose", &[w], Attrs::default().with("perm", Attr::Ints(vec![1, 0])));
    let h = op(&mut g, "head", "MatMul", &[h0, wt], Attrs::default());
    let h = op(&mut g, "head_bias", "Add", &[h, b], Attrs::default());
    let shape = ints(&mut g, "rows", &[-1, c as i64]);
    let scores = op(&mut g, "flat", "Reshape", &[h, shape], Attrs::default());
    let labels = g.add_const("labels", Tensor::from_i64(vec![rows], (0..rows).map(|i| (i * 7 % c) as i64).collect()));
    let cw = g.add_const("class_weights", Tensor::from_f32(vec![c], (0..c).map(|c| 0.5 + (c % 3) as f32 * 0.25).collect()));
    let attrs = Attrs::default().with("reduction", Attr::String("mean".into())).with("ignore_index", Attr::Int(3));
    let loss = g.add_node("ce", "SoftmaxCrossEntropyLoss", vec![Some(scores), Some(labels), Some(cw)], attrs, 1)[0];
    g.outputs.push(loss);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// The session with the head's weight `w` trainable or not.
fn session_training(m: &Model, target: Target, head_trains: bool) -> Session {
    let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &HashMap::new(), 17).expect("export");
    let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
    let trainable: Vec<bool> = names.iter().map(|n| head_trains || n != "w").collect();
    Session::from_onnx_with(&bytes, None, &names, &trainable, None, target, SessionOptions::default()).expect("import")
}

#[test]
fn a_frozen_lm_head_skips_its_weight_gradient_and_changes_nothing_else() {
    let m = projected_head(&mut Rng::new(29));
    let x = m.input_bytes(&mut Rng::new(31));
    let weights = weight_data(&m);
    let seeds = vec![vec![0.75f32]];
    for target in [Target::Cpu, Target::Cuda] {
        let (trains, frozen) = (session_training(&m, target, true), session_training(&m, target, false));
        let dropped = |s: &Session| s.passes.rewrites.iter().filter(|(p, _)| *p == "lce_weight_grad").map(|(_, n)| n).sum::<usize>();
        assert_eq!((dropped(&trains), dropped(&frozen)), (0, 1), "{target:?}");
        let lce = frozen.graph.nodes.iter().find(|n| n.op_type == "LinearCrossEntropy").expect("fused");
        let plan = frozen.plan(&[m.sig()], true).expect("plan");
        assert_eq!(plan.shape(lce.outputs[2]), &[0usize][..], "{target:?}: dW₁ is empty");
        assert!(frozen.grads[1].is_none() && trains.grads[1].is_some());
        let want = cpu_step(&trains, &x, &m.sig(), weights.clone(), &mut seeds.clone());
        let got = cpu_step(&frozen, &x, &m.sig(), weights.clone(), &mut seeds.clone());
        assert!(got.0 == want.0, "{target:?}: the loss");
        assert!(got.1[0] == want.1[0] && got.1[2] == want.1[2], "{target:?}: W0's and b's gradients");
        assert!(got.1[1].iter().all(|&v| v == 0.0) && want.1[1].iter().any(|&v| v != 0.0));
        if target == Target::Cuda && gpu("a_frozen_lm_head_skips_its_weight_gradient_and_changes_nothing_else").is_some() {
            let run = |s: &Session| GpuRun::new(s, &[m.sig()], &weights, &seeds, F32Mode::Exact, LEGACY).step(&[&x]);
            let (want, got) = (run(&trains), run(&frozen));
            assert!(got.0 == want.0, "on the GPU: the loss");
            assert!(got.1[0] == want.1[0] && got.1[2] == want.1[2], "on the GPU: W0's and b's gradients");
            assert!(got.1[1].iter().all(|&v| v == 0.0));
        }
    }
}
