//! Checkpointed parts (passes/recompute_segments.rs) on both targets: two residual layers
//! `h = x + Dropout(Gelu(x·W1))·W2`, each marked as a part, against the same model unmarked.
//! The copies run the forward pass's kernels on the same inputs and the Dropout's copy reads
//! the forward's mask, so the step is bit for bit the unmarked one: on the CPU executor for
//! CPU and CUDA sessions, and on the GPU (the Philox masks drawn once, in the forward pass).

use super::exec::{cpu_step, gpu_step, session_for, weight_data};
use super::exec_models::*;
use super::support::*;
use crate::ir::{Attrs, RecomputeSegment};
use crate::session::{Session, Target};
use crate::tensor::{DType, Tensor};

fn layers(marked: bool) -> Model {
    let mut rng = Rng::new(11);
    let input = vec![4, 64];
    let (mut g, mut x) = new_model(&input);
    let mut ws = Vec::new();
    let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.3]));
    let training = g.add_const("training", Tensor::new(vec![], crate::tensor::Data::Bool(vec![1])).expect("bool"));
    for l in 0..2 {
        let w1 = weight(&mut g, &mut ws, &format!("w1_{l}"), &[64, 128], &mut rng);
        let w2 = weight(&mut g, &mut ws, &format!("w2_{l}"), &[128, 64], &mut rng);
        let u = op(&mut g, &format!("fc{l}"), "MatMul", &[x, w1], Attrs::default());
        let v = op(&mut g, &format!("act{l}"), "Gelu", &[u], Attrs::default());
        let d = g.add_node(&format!("drop{l}"), "Dropout", vec![Some(v), Some(ratio), Some(training)], Attrs::default(), 1)[0];
        let p = op(&mut g, &format!("proj{l}"), "MatMul", &[d, w2], Attrs::default());
        let h = op(&mut g, &format!("res{l}"), "Add", &[x, p], Attrs::default());
        if marked {
            let (inputs, outputs) = (vec![g.value(x).name.clone()], vec![g.value(h).name.clone()]);
            g.recompute.push(RecomputeSegment { name: format!("layers.{l}"), inputs, outputs });
        }
        x = h;
    }
    g.outputs.push(x);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

fn recomputed(s: &Session) -> usize {
    s.passes.rewrites.iter().filter(|(p, _)| *p == "recompute_segments").map(|(_, n)| n).sum()
}

#[test]
fn checkpointed_layers_give_the_unmarked_step_bit_for_bit() {
    let (marked, plain) = (layers(true), layers(false));
    let mut rng = Rng::new(3);
    let x = marked.input_bytes(&mut rng);
    let weights = weight_data(&marked);
    for target in [Target::Cpu, Target::Cuda] {
        let (a, b) = (session_for(&marked, target), session_for(&plain, target));
        assert_eq!((recomputed(&a), recomputed(&b)), (2, 0), "{target:?}");
        let plan = a.plan(&[marked.sig()], true).expect("plan");
        let seeds: Vec<Vec<f32>> = a.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let less = plan.arena_bytes;
        let more = b.plan(&[plain.sig()], true).expect("plan").arena_bytes;
        assert!(less < more, "{target:?}: {less} vs {more} arena bytes");
        let got = cpu_step(&a, &x, &marked.sig(), weights.clone(), &mut seeds.clone());
        let want = cpu_step(&b, &x, &plain.sig(), weights.clone(), &mut seeds.clone());
        assert!(got == want, "{target:?} session on the CPU executor: not the unmarked step");
        if target == Target::Cuda && gpu("checkpointed_layers_give_the_unmarked_step_bit_for_bit").is_some() {
            let got = gpu_step(&a, &x, &marked.sig(), &weights, &seeds);
            let want = gpu_step(&b, &x, &plain.sig(), &weights, &seeds);
            assert!(got == want, "on the GPU: not the unmarked step");
            assert!(got.1.iter().flatten().any(|&g| g != 0.0), "gradients flow");
        }
    }
}
