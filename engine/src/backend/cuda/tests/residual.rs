//! passes/fuse_residual_linear.rs on CUDA: in a bf16 session, the projections of a pre-norm
//! residual stack (a Gemm with a bias over flattened rows, as GPT-2's Conv1D, and a MatMul)
//! become Linears adding the f32 residual stream (input 3) with the f32 bias, run as one
//! cuBLASLt product with both in its epilogue (blas_lt.rs). No Cast to f32 or Add is left
//! between a projection and the stream, and the weights' gradients come out of their products
//! in f32 (passes/wgrad_f32.rs); the step within bf16's precision of the fp32 session's (on a
//! GPU, the GPU's within that of the CPU executor's, which runs the same fused graph).

use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::blas::F32Mode;
use crate::tensor::DType;

#[test]
fn sixteen_bit_projections_add_the_residual_stream() {
    let mut rng = Rng::new(59);
    let m = super::exec_models::pre_norm_residual(&mut rng);
    let s = super::exec::session_with(&m, crate::session::Target::Cuda, MatmulPrecision::Bf16);
    let plan = s.plan(&[m.sig()], true).expect("plan");
    let steps: Vec<&crate::ir::Node> = plan.steps.iter().map(|n| &s.graph.nodes[n.0]).collect();
    let fused: Vec<&&crate::ir::Node> = steps.iter().filter(|n| n.op_type == "Linear" && n.input(3).is_some()).collect();
    assert_eq!(fused.len(), 2, "Linears adding the residual");
    for n in &fused {
        let (x, r, y) = (n.input(0).expect("x"), n.input(3).expect("residual"), n.outputs[0]);
        assert_eq!(plan.dtype(x), Some(DType::BF16), "{}: X", n.name);
        assert_eq!((plan.dtype(r), plan.dtype(y)), (Some(DType::F32), Some(DType::F32)), "{}: the residual and the sum", n.name);
        if let Some(b) = n.input(2) {
            assert_eq!(plan.dtype(b), Some(DType::F32), "{}: the bias is the f32 parameter", n.name);
        }
    }
    assert!(fused.iter().any(|n| n.input(2).is_some()), "the Gemm's bias went into the Linear");
    let adds = steps.iter().filter(|n| n.op_type == "Add").count();
    assert_eq!(adds, 1, "only the position term's Add is left");
    // passes/wgrad_f32.rs: each projection weight's gradient is its product's f32 result
    let wgrads: Vec<&&crate::ir::Node> = steps.iter().filter(|n| n.op_type == "FusedMatMul" && n.attrs.get("to").is_some()).collect();
    assert_eq!(wgrads.len(), 3, "the three projections' weight gradients");
    for n in &wgrads {
        assert_eq!(plan.dtype(n.outputs[0]), Some(DType::F32), "{}", n.name);
        assert!(s.grads.contains(&Some(n.outputs[0])), "{}: writes a weight's gradient", n.name);
    }
    let widened = |n: &&&crate::ir::Node| {
        let from = n.input(0).and_then(|v| s.graph.value(v).producer);
        n.op_type == "CastLike" && from.is_some_and(|p| s.graph.nodes[p.0].op_type == "FusedMatMul")
    };
    let widened: Vec<&str> = steps.iter().filter(widened).map(|n| n.name.as_str()).collect();
    assert!(widened.is_empty(), "products' results widened after them: {widened:?}");
    super::exec::bf16_step_matches("pre_norm_residual", "sixteen_bit_projections_add_the_residual_stream", &m, &s, &plan, &mut rng);
}

/// With the cuBLASLt epilogues off (`ORTRAIN_CUBLASLT=0`, the path a GPU whose cuBLASLt declines
/// takes), the same fused graph runs as a copy of the residual, a gemm adding the product and a
/// ones-column product adding the bias: within f32 rounding of the epilogue's step. Other tests
/// running meanwhile may take that path too; it computes the same.
#[test]
fn gpu_residual_linears_without_cublaslt_give_the_same_step() {
    let Some(_) = gpu("gpu_residual_linears_without_cublaslt_give_the_same_step") else { return };
    let mut rng = Rng::new(61);
    let m = super::exec_models::pre_norm_residual(&mut rng);
    let s = super::exec::session_with(&m, crate::session::Target::Cuda, MatmulPrecision::Bf16);
    let plan = s.plan(&[m.sig()], true).expect("plan");
    let sig = m.sig();
    let x = m.input_bytes(&mut rng);
    let seeds: Vec<Vec<f32>> = s.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let weights = super::exec::weight_data(&m);
    let with = super::exec::gpu_step_in(&s, &x, &sig, &weights, &seeds, F32Mode::Bf16, super::exec::LEGACY);
    std::env::set_var(crate::backend::cuda::ops::ENV_CUBLASLT, "0");
    let without = super::exec::gpu_step_in(&s, &x, &sig, &weights, &seeds, F32Mode::Bf16, super::exec::LEGACY);
    std::env::remove_var(crate::backend::cuda::ops::ENV_CUBLASLT);
    super::exec::assert_step_close("without cuBLASLt", &m, &without, &with, 1e-5);
}
