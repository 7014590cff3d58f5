//! The graph passes of CUDA sessions against the unfused graphs of CPU sessions, on the CPU
//! executor (the reference the GPU is compared with in exec.rs): each fusion is found where it
//! should be, and the fused train step gives the unfused one's outputs and gradients.

use super::exec::{assert_step_close, cpu_step, gpu_step_in, session, session_for, session_with, unfused_session, weight_data, LEGACY};
use super::exec_models::*;
use super::gpu_run::GpuRun;
use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::blas::F32Mode;
use crate::ir::Attrs;
use crate::session::Session;
use crate::tensor::{DType, Tensor};

type Values = Vec<Vec<f64>>;

/// (outputs, gradients) of one train step of `fused` and of `plain`, both on the CPU executor,
/// on the same random input and seeds, as f64.
fn cpu_steps(m: &Model, fused: &Session, plain: &Session, rng: &mut Rng) -> ((Values, Values), (Values, Values)) {
    let x = m.input_bytes(rng);
    let plan = fused.plan(&[m.sig()], true).expect("plan");
    let mut seeds: Vec<Vec<f32>> = fused.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
    let wide = |v: Vec<Vec<f32>>| v.into_iter().map(|t| t.into_iter().map(f64::from).collect()).collect::<Values>();
    let (fo, fg) = cpu_step(fused, &x, &m.sig(), weight_data(m), &mut seeds.clone());
    let (po, pg) = cpu_step(plain, &x, &m.sig(), weight_data(m), &mut seeds);
    ((wide(fo), wide(fg)), (wide(po), wide(pg)))
}

/// A CUDA session's train graph takes the tanh GELU out of the product that feeds it
/// (passes/fuse_linear_gelu.rs: a Linear writing the GELU and its input, the GELU recomputed
/// for the backward pass from that input) and the GELU's gradient, with the bias gradient of
/// that layer, out of the product that feeds the gradient (passes/matmul_gelu_grad.rs): no
/// forward Gelu, GeluGrad nor bias sum left. The fused graph's step on the CPU executor (the
/// GPU's reference) matches a CPU session's unfused graph; gpu_train_step_matches_the_cpu_executor
/// runs it on the GPU (gelu_mlp: the epilogues; gelu_mlp_12: their fallbacks).
#[test]
fn the_gelu_and_its_gradient_come_out_of_the_products() {
    let mut rng = Rng::new(3);
    let m = gelu_mlp(&mut rng, 16);
    let (s, plain) = (session(&m), session_for(&m, crate::session::Target::Cpu));
    let ops: Vec<&str> = s.graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
    let linear = s.graph.nodes[..s.n_fwd].iter().find(|n| n.name == "fc:gelu").expect("the fused Linear");
    assert_eq!((linear.op_type.as_str(), linear.outputs.len()), ("Linear", 2), "{ops:?}");
    assert!(!ops[..s.n_fwd].contains(&"Gelu"), "no forward Gelu: {ops:?}");
    let recomputed: Vec<&str> = s.graph.nodes[s.n_fwd..].iter().filter(|n| n.op_type == "Gelu").map(|n| n.name.as_str()).collect();
    assert_eq!(recomputed, ["fc:gelu:recompute"], "{ops:?}");
    let fused: Vec<_> = s.graph.nodes.iter().filter(|n| n.op_type == "MatMulGeluGrad").collect();
    assert_eq!(fused.len(), 1, "{ops:?}");
    assert_eq!(fused[0].outputs.len(), 2, "the bias gradient is its output 1");
    assert!(!ops.contains(&"GeluGrad") && !ops.contains(&"SumRows"), "{ops:?}");
    let ((fo, fg), (po, pg)) = cpu_steps(&m, &s, &plain, &mut rng);
    assert_close("gelu_mlp: output", &fo[0], &po[0], 1e-5, 1e-6);
    for ((name, _), (a, b)) in m.weights.iter().zip(fg.iter().zip(&pg)) {
        assert_close(&format!("gelu_mlp: gradient of {name}"), a, b, 1e-5, 1e-6);
    }
}

/// The exporters' attention becomes one Attention node in a CUDA session, and the fused graph's
/// train step on the CPU executor (the reference the GPU is compared with) matches the unfused
/// graph (a CPU session without graph passes): outputs and every weight gradient.
#[test]
fn attention_fuses_for_cuda_and_matches_the_unfused_graph() {
    let mut rng = Rng::new(11);
    // heads of 4 (the SIMT kernels' test models) and of 64 over 150 rows (the tensor-core ones')
    for (torchlib, t, hd) in [(true, 70, 4), (false, 70, 4), (true, 150, 64), (false, 150, 64)] {
        let m = self_attention_of(&mut rng, torchlib, t, hd);
        let (fused, plain) = (session(&m), unfused_session(&m));
        let count = |s: &Session| s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "Attention").count();
        assert_eq!((count(&fused), count(&plain)), (1, 0), "torchlib={torchlib}");
        // the scaling of Q and Kᵀ (torchlib's) or of the scores (eager) is the node's scale
        let attn = fused.graph.nodes.iter().find(|n| n.op_type == "Attention").expect("Attention");
        let scale = attn.attrs.float("scale", 1.0).expect("scale") as f64;
        assert!((scale - 1.0 / (hd as f64).sqrt()).abs() < 1e-6, "torchlib={torchlib}: scale {scale}");
        let muls = fused.graph.nodes[..fused.n_fwd].iter().filter(|n| matches!(n.op_type.as_str(), "Mul" | "Div")).count();
        assert_eq!(muls, 0, "torchlib={torchlib}: no scaling left outside the fused attention");
        let ((fo, fg), (po, pg)) = cpu_steps(&m, &fused, &plain, &mut rng);
        // heads of 64: sums of 64-128 terms around the largest values, in a different order (the
        // online softmax): within 2e-5 of the largest value
        let close = |what: String, a: &[f64], b: &[f64]| {
            if hd == 4 {
                assert_close(&what, a, b, 1e-5, 1e-6)
            } else {
                assert_close_scaled(&what, a, b, 2e-5)
            }
        };
        close(format!("torchlib={torchlib}, heads of {hd}: output"), &fo[0], &po[0]);
        for ((name, _), (a, b)) in m.weights.iter().zip(fg.iter().zip(&pg)) {
            close(format!("torchlib={torchlib}, heads of {hd}: gradient of {name}"), a, b);
        }
    }
}

/// An attention's dropout fuses in a CUDA session: the Dropout becomes a DropoutKey of its name
/// and the Attention's `dropout`. On the GPU the fused step draws the unfused CUDA graph's masks
/// (the Philox stream keyed by the Dropout's name): its outputs and gradients are the unfused
/// step's, to the products' rounding. Heads of 4 over 70 rows in f32 (the SIMT kernels, a padding
/// mask read) and heads of 64 over 71 rows with bf16 products (the tensor-core kernels, the
/// causal mask computed). The check has teeth: the unfused step with another seed, whose masks
/// differ, is far from it.
#[test]
fn attention_dropout_fuses_for_cuda_and_draws_the_unfused_masks() {
    use crate::session::{SessionOptions, Target};
    for (torchlib, t, hd, precision, rtol) in [(false, 70, 4, MatmulPrecision::Fp32, 1e-5), (true, 71, 64, MatmulPrecision::Bf16, 2e-2)] {
        let case = format!("torchlib={torchlib}, heads of {hd}, {precision:?}");
        let m = self_attention_dropped(&mut Rng::new(5), torchlib, t, hd, 0.3);
        let fused = session_with(&m, Target::Cuda, precision);
        let key = fused.graph.nodes.iter().find(|n| n.op_type == "DropoutKey").unwrap_or_else(|| panic!("{case}: no DropoutKey"));
        assert_eq!(key.name, "attn_drop", "{case}: the key is drawn under the Dropout's name");
        let attn = fused.graph.nodes.iter().find(|n| n.op_type == "Attention").unwrap_or_else(|| panic!("{case}: no Attention"));
        assert!((attn.attrs.float("dropout", 0.0).expect("dropout") - 0.3).abs() < 1e-7, "{case}");
        assert!(!fused.graph.nodes.iter().any(|n| n.op_type == "Dropout"), "{case}: a Dropout is left");
        let bytes = crate::onnx::export_model(&m.graph, m.graph.nodes.len(), &Default::default(), 17).expect("export");
        let names: Vec<String> = m.weights.iter().map(|w| w.0.clone()).collect();
        let options = SessionOptions { unfused: true, matmul_precision: precision };
        let plain = Session::from_onnx_with(&bytes, None, &names, &vec![true; names.len()], None, Target::Cuda, options).expect("import");
        assert!(plain.graph.nodes.iter().any(|n| n.op_type == "Dropout"), "{case}: the unfused graph keeps its Dropout");
        let Some(_) = gpu("attention_dropout_fuses_for_cuda_and_draws_the_unfused_masks") else { continue };
        let mut rng = Rng::new(9);
        let x = m.input_bytes(&mut rng);
        let plan = fused.plan(&[m.sig()], true).expect("plan");
        let seeds: Vec<Vec<f32>> = fused.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let mode = if precision == MatmulPrecision::Bf16 { F32Mode::Bf16 } else { F32Mode::Exact };
        let step = |s: &Session| gpu_step_in(s, &x, &m.sig(), &weight_data(&m), &seeds, mode, LEGACY);
        let (got, want) = (step(&fused), step(&plain));
        assert_step_close(&case, &m, &got, &want, rtol);
        let other = GpuRun::new(&plain, &[m.sig()], &weight_data(&m), &seeds, mode, LEGACY).with_seed(2).step(&[&x]);
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (o, w) = (wide(&other.0[0]), wide(&want.0[0]));
        let apart = o.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / max_abs(&w);
        assert!(apart > 20.0 * rtol, "{case}: another seed's step is only {apart:.2e} from this one's: the masks were not drawn");
        println!("{case}: the fused step matches the unfused one within {rtol:e}; another seed's output is {apart:.2e} away");
    }
}

/// Llama's RMSNorm, written out, becomes one RmsNorm node in a CUDA session (with its trained
/// weight, and without one), nothing of the unfused arithmetic left, and the fused train step
/// on the CPU executor matches the unfused graph's: output and every weight gradient (the
/// norm's weight's through RmsNormGrad's dscale). gpu_train_step_matches_the_cpu_executor runs
/// the model on the GPU.
#[test]
fn rms_norm_fuses_for_cuda_and_matches_the_unfused_graph() {
    let mut rng = Rng::new(17);
    let m = rms_pre_norm(&mut rng);
    let (fused, plain) = (session(&m), unfused_session(&m));
    let forward = |s: &Session| s.graph.nodes[..s.n_fwd].iter().map(|n| n.op_type.clone()).collect::<Vec<_>>();
    let ops = forward(&fused);
    let norms: Vec<usize> = fused.graph.nodes[..fused.n_fwd].iter().filter(|n| n.op_type == "RmsNorm").map(|n| n.inputs.len()).collect();
    assert_eq!(norms, [2, 1], "the first norm with its weight, the second without: {ops:?}");
    for gone in ["Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"] {
        assert!(!ops.iter().any(|o| o == gone), "{gone} left in {ops:?}");
    }
    assert!(forward(&plain).iter().any(|o| o == "Pow"), "the unfused session keeps the arithmetic");
    let grads: Vec<usize> = fused.graph.nodes.iter().filter(|n| n.op_type == "RmsNormGrad").map(|n| n.outputs.len()).collect();
    assert_eq!(grads, [1, 2], "dscale only for the trained weight (the backward runs last layer first)");
    let ((fo, fg), (po, pg)) = cpu_steps(&m, &fused, &plain, &mut rng);
    assert_close("rms_pre_norm: output", &fo[0], &po[0], 1e-5, 1e-6);
    for ((name, _), (a, b)) in m.weights.iter().zip(fg.iter().zip(&pg)) {
        assert_close(&format!("rms_pre_norm: gradient of {name}"), a, b, 1e-5, 1e-6);
    }
}

/// CUDA sessions fuse the LM head with its loss, in chunks of at least 512 rows whose rows are
/// padded to whole 64 classes (the scratch output): the 9000 rows of the big `lm_head` (8
/// features: 3 times its weight would be 24 rows) take 18 chunks of 500, the 70 of the small
/// one a single chunk.
#[test]
fn lm_head_loss_fuses_for_cuda_in_large_chunks() {
    let mut rng = Rng::new(13);
    for (big, scratch) in [(true, vec![500, 64]), (false, vec![70, 64])] {
        let m = lm_head(&mut rng, big);
        let s = session(&m);
        let fused: Vec<_> = s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "LinearCrossEntropy").collect();
        assert_eq!(fused.len(), 1, "big={big}: {:?}", s.graph.nodes.iter().map(|n| &n.op_type).collect::<Vec<_>>());
        assert_eq!(fused[0].attrs.string("target", "").expect("target"), "cuda");
        let plan = s.plan(&[m.sig()], true).expect("plan");
        assert_eq!(plan.shape(fused[0].outputs[4]), scratch.as_slice(), "big={big}");
    }
}

/// The CUDA train graphs recompute activations in the backward pass (passes/recompute.rs):
/// on the CPU executor, every test model's CUDA-target graph gives the CPU-target graph's
/// outputs and gradients (the targets' other passes only regroup the same arithmetic).
#[test]
fn recomputed_activations_give_the_same_train_step() {
    let mut recomputed = 0;
    for (name, m) in models() {
        let mut rng = Rng::new(7);
        let cuda = session(&m);
        let cpu = session_for(&m, crate::session::Target::Cpu);
        recomputed += cuda.passes.rewrites.iter().filter(|(p, _)| *p == "recompute").map(|(_, n)| n).sum::<usize>();
        let ((co, cg), (po, pg)) = cpu_steps(&m, &cuda, &cpu, &mut rng);
        for (k, (a, b)) in co.iter().zip(&po).chain(cg.iter().zip(&pg)).enumerate() {
            assert_close(&format!("{name}: output or gradient {k}"), a, b, 1e-5, 1e-6);
        }
    }
    assert!(recomputed >= 2, "the test models recompute {recomputed} activations");
}

/// A residual branch's dropout, `Tanh(Dropout(h) + r)` with h and r products of x ([4, 48]
/// each), the DropoutAdd of passes/fuse_dropout_add.rs where `provable` (both reshaped to a
/// constant shape, so the pass proves them alike); without it the same arithmetic stays a
/// Dropout and an Add (the products' shapes are not known to the pass).
pub(super) fn residual_dropout(rng: &mut Rng, provable: bool) -> Model {
    residual_dropout_of(rng, provable, false)
}

/// residual_dropout, or with `stream` the residual x itself ([4, 64], h then x times a
/// [64, 64] weight): in a 16-bit session h is a 16-bit product and x stays f32, so autocast
/// joins them by a Cast of the dropped h (a 16-bit branch into an f32 stream).
pub(super) fn residual_dropout_of(rng: &mut Rng, provable: bool, stream: bool) -> Model {
    let input = vec![4, 64];
    let (mut g, x) = new_model(&input);
    let mut ws = Vec::new();
    let width = if stream { 64 } else { 48 };
    let w = weight(&mut g, &mut ws, "w", &[64, width], rng);
    let mut h = op(&mut g, "mm_h", "MatMul", &[x, w], Attrs::default());
    let mut r = x;
    if !stream {
        let v = weight(&mut g, &mut ws, "v", &[64, 48], rng);
        r = op(&mut g, "mm_r", "MatMul", &[x, v], Attrs::default());
    }
    if provable {
        let shape = ints(&mut g, "shape", &[4, width as i64]);
        h = op(&mut g, "view_h", "Reshape", &[h, shape], Attrs::default());
        r = op(&mut g, "view_r", "Reshape", &[r, shape], Attrs::default());
    }
    let ratio = g.add_const("ratio", Tensor::from_f32(vec![], vec![0.3]));
    let training = g.add_const("training", Tensor::new(vec![], crate::tensor::Data::Bool(vec![1])).expect("bool"));
    let d = g.add_node("drop", "Dropout", vec![Some(h), Some(ratio), Some(training)], Attrs::default(), 1)[0];
    let sum = op(&mut g, "residual", "Add", &[r, d], Attrs::default());
    let y = op(&mut g, "tanh", "Tanh", &[sum], Attrs::default());
    g.outputs.push(y);
    Model { graph: g, input, input_dtype: DType::F32, index_bound: 0, weights: ws }
}

/// A residual branch's Dropout and Add become one DropoutAdd (passes/fuse_dropout_add.rs) on
/// both backends, named as the Dropout; it draws the unfused graph's masks and gives its step
/// bit for bit: on the CPU executor, and on the GPU (the Philox stream keyed by the name). In
/// f32; in bf16 (the dropped value rounded to bf16 before the add, as the Dropout stored it: the
/// CPU computes 16-bit kernels widened); and a bf16 branch into an f32 stream, its Cast fused too.
#[test]
fn dropout_add_draws_the_unfused_masks_and_gives_the_unfused_step() {
    let mut rng = Rng::new(47);
    for (precision, stream) in [(MatmulPrecision::Fp32, false), (MatmulPrecision::Bf16, false), (MatmulPrecision::Bf16, true)] {
        let case = format!("{precision:?}, residual {}", if stream { "an f32 stream" } else { "a product" });
        let fused_model = residual_dropout_of(&mut Rng::new(5), true, stream);
        let plain_model = residual_dropout_of(&mut Rng::new(5), false, stream);
        for target in [crate::session::Target::Cpu, crate::session::Target::Cuda] {
            let (fused, plain) = (session_with(&fused_model, target, precision), session_with(&plain_model, target, precision));
            let ops = |s: &Session| s.graph.nodes.iter().map(|n| n.op_type.clone()).collect::<Vec<_>>();
            let dropout_add = fused.graph.nodes.iter().find(|n| n.op_type == "DropoutAdd");
            assert_eq!(dropout_add.map(|n| n.name.as_str()), Some("drop"), "{case}, {target:?}: {:?}", ops(&fused));
            assert!(!ops(&fused).contains(&"Dropout".to_string()), "{case}, {target:?}: {:?}", ops(&fused));
            let casts = |s: &Session| s.graph.nodes[..s.n_fwd].iter().filter(|n| n.op_type == "Cast").count();
            if stream {
                assert_eq!(casts(&fused) + 1, casts(&plain), "{case}, {target:?}: the Cast into the stream fused too");
            }
            assert!(ops(&plain).contains(&"Dropout".to_string()) && !ops(&plain).contains(&"DropoutAdd".to_string()), "{:?}", ops(&plain));
            if target == crate::session::Target::Cpu {
                let ((fo, fg), (po, pg)) = cpu_steps(&fused_model, &fused, &plain, &mut rng);
                assert_eq!((fo, fg), (po, pg), "{case}: the CPU's fused step differs from the unfused one");
            }
        }
        let Some(_) = gpu("dropout_add_draws_the_unfused_masks_and_gives_the_unfused_step") else { continue };
        let target = crate::session::Target::Cuda;
        let (fused, plain) = (session_with(&fused_model, target, precision), session_with(&plain_model, target, precision));
        let x = fused_model.input_bytes(&mut rng);
        let plan = fused.plan(&[fused_model.sig()], true).expect("plan");
        let seeds: Vec<Vec<f32>> = fused.outputs.iter().map(|&o| rng.f32s(plan.shape(o).iter().product(), -1.0, 1.0)).collect();
        let mode = if precision == MatmulPrecision::Bf16 { F32Mode::Bf16 } else { F32Mode::Exact };
        let step = |s: &Session, m: &Model| gpu_step_in(s, &x, &m.sig(), &weight_data(m), &seeds, mode, LEGACY);
        assert_eq!(step(&fused, &fused_model), step(&plain, &plain_model), "{case}: the GPU's fused step differs from the unfused one");
    }
}
