//! A whole exported model through one training step on four executors: the CPU in exact f32
//! (the reference), the CPU at bf16 matmul precision and CUDA at bf16 and at fp16 with the
//! opt-in passes (tensor-core attention, 16-bit activations), every weight gradient compared
//! with the reference. The CUDA bf16 step must be about as close to the reference as the CPU's
//! bf16 step, the fp16 step (f16 keeps 3 more bits; its loss seeded with 1024, as a loss scaler
//! would) at most half as far: a gradient further off names a CUDA-only pass or kernel that is
//! wrong for this model (or rounds through bf16), which the kernel tests, one op at a time on
//! small shapes, can miss. The CUDA bf16 step runs twice on the same plan and arena and must
//! give the same bits both times.
//!
//! The model comes from a folder written by `python -m bench.parity_model DIR [--model bert|llama]
//! [--padding]` (a GPT-2, a BERT or a Llama with its fused cross-entropy loss; with --padding called with
//! an attention_mask, padded left and right (BERT: one row all padding), which the CUDA sessions'
//! attentions must take as key padding, the queries without a visible key included); the test
//! reads `ORTRAIN_PARITY_MODEL=DIR`:
//! `ORTRAIN_PARITY_MODEL=DIR cargo test --release -p ortrain-engine --features cuda --lib onnx_parity -- --ignored --nocapture`
//! (with cuda-emu's LD_LIBRARY_PATH where there is no GPU).

use std::path::Path;

use super::gpu_run::{GpuRun, LEGACY};
use super::support::*;
use crate::backend::cpu::bf16::MatmulPrecision;
use crate::backend::cuda::blas::F32Mode;
use crate::session::{Session, SessionOptions, Sig, Target};
use crate::tensor::DType;

/// Which model a probe folder holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Model {
    Gpt2,
    Bert,
    Llama,
}

/// The folder's contents: the graph, the bound weights (name, trainable, f32 data), the int64
/// inputs (shape, little-endian bytes), in the graph's input order, and which model it is.
struct Probe {
    onnx: Vec<u8>,
    weights: Vec<(String, bool, Vec<f32>)>,
    inputs: Vec<(Vec<usize>, Vec<u8>)>,
    model: Model,
}

fn read_probe(dir: &Path) -> Probe {
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(f).display()));
    let meta = String::from_utf8(read("meta.txt")).expect("meta.txt is UTF-8");
    let (weight_bytes, input_bytes) = (read("weights.bin"), read("inputs.bin"));
    let (mut weights, mut inputs, mut wat, mut iat, mut model) = (Vec::new(), Vec::new(), 0usize, 0usize, Model::Gpt2);
    for line in meta.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| s.parse::<usize>().unwrap_or_else(|e| panic!("meta.txt: {line:?}: {e}"));
        match f.first().copied() {
            Some("weight") if f.len() == 4 => {
                let n = num(f[3]);
                let data = weight_bytes[wat..wat + 4 * n].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                wat += 4 * n;
                weights.push((f[1].to_string(), f[2] == "1", data));
            }
            Some("input") if f.len() >= 2 => {
                let shape: Vec<usize> = f[2..].iter().map(|s| num(s)).collect();
                let bytes = 8 * shape.iter().product::<usize>();
                inputs.push((shape, input_bytes[iat..iat + bytes].to_vec()));
                iat += bytes;
            }
            Some("model") if f.len() == 2 => {
                model = match f[1] {
                    "gpt2" => Model::Gpt2,
                    "bert" => Model::Bert,
                    "llama" => Model::Llama,
                    other => panic!("meta.txt: model {other:?} is not one of gpt2, bert, llama"),
                }
            }
            _ => panic!("meta.txt: unexpected line {line:?}"),
        }
    }
    assert_eq!((wat, iat), (weight_bytes.len(), input_bytes.len()), "meta.txt does not describe the .bin files whole");
    Probe { onnx: read("model.onnx"), weights, inputs, model }
}

fn open(p: &Probe, target: Target, precision: MatmulPrecision) -> Session {
    std::env::set_var(crate::passes::ENV_ENABLE, "fuse_attention,autocast");
    let names: Vec<String> = p.weights.iter().map(|w| w.0.clone()).collect();
    let trainable: Vec<bool> = p.weights.iter().map(|w| w.1).collect();
    let options = SessionOptions { matmul_precision: precision, ..Default::default() };
    Session::from_onnx_with(&p.onnx, None, &names, &trainable, None, target, options).unwrap_or_else(|e| panic!("import: {e}"))
}

/// Whether the model takes an attention_mask (ids, mask, targets).
fn padded(p: &Probe) -> bool {
    p.inputs.len() == 3
}

fn sigs(p: &Probe) -> Vec<Sig> {
    p.inputs.iter().map(|(shape, _)| (DType::I64, shape.clone())).collect()
}

/// (loss, weight gradients) of one CPU step.
fn cpu_step(s: &Session, p: &Probe) -> (f32, Vec<Vec<f32>>) {
    let mut weights: Vec<Vec<f32>> = p.weights.iter().map(|w| w.2.clone()).collect();
    let wptrs: Vec<*mut u8> = weights.iter_mut().map(|w| w.as_mut_ptr() as *mut u8).collect();
    let feed: Vec<(Sig, &[u8])> = sigs(p).into_iter().zip(p.inputs.iter().map(|i| &i.1[..])).collect();
    let mut grads: Vec<Vec<f32>> = weights.iter().map(|w| vec![0.0; w.len()]).collect();
    let gptrs: Vec<*mut u8> = grads.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
    // SAFETY: every weight and gradient pointer holds its value's f32 data and outlives the calls.
    let mut pending = unsafe { s.forward_with_grads(&feed, &wptrs, true, 1, &[], &gptrs) }.expect("cpu forward");
    let (lp, _, _) = s.output_ptr(&mut pending, 0).expect("loss");
    // SAFETY: the loss is one f32 while `pending` lives.
    let loss = unsafe { *(lp as *const f32) };
    let mut seed = vec![1f32];
    // SAFETY: as above; the seed is the loss's one f32.
    unsafe { s.backward(pending, &wptrs, &[seed.as_mut_ptr() as *mut u8], &gptrs) }.expect("cpu backward");
    (loss, grads)
}

/// (loss, weight gradients) of `steps` steps through the CUDA executor on the same plan, arena
/// and constants (the same weights and batch each time, gradients into fresh zeroed buffers),
/// the loss seeded with `seed` and the gradients divided by it.
fn gpu_steps(s: &Session, p: &Probe, steps: usize, mode: F32Mode, seed: f32) -> Vec<(f32, Vec<Vec<f32>>)> {
    let weights: Vec<Vec<f32>> = p.weights.iter().map(|w| w.2.clone()).collect();
    let mut run = GpuRun::new(s, &sigs(p), &weights, &[vec![seed]], mode, LEGACY);
    // GPT-2's folded causal mask: every attention computes it, so it is not on the GPU (with key
    // padding it is uploaded: a kernel that does not take the padding reads the two combined).
    // Llama's stays on the host only with heads the tensor-core kernels also take (ops::computes_mask)
    if p.model != Model::Llama {
        let on_host = if padded(p) || p.model == Model::Bert { 0 } else { 1 };
        assert_eq!(run.masks_on_host(), on_host, "causal mask constants kept on the host");
    }
    let inputs: Vec<&[u8]> = p.inputs.iter().map(|i| &i.1[..]).collect();
    (0..steps)
        .map(|_| {
            let (outs, mut grads) = run.step(&inputs);
            grads.iter_mut().flatten().for_each(|g| *g /= seed);
            (outs[0][0], grads)
        })
        .collect()
}

/// The attention layouts of a CUDA session's fused attentions: GPT-2's read its c_attn
/// projection in place (passes/attention_packed_qkv.rs), layout BS3HD; BERT's separate Q, K, V
/// projections in theirs (passes/attention_layout.rs), layout BSHD; Llama's rotated Q and
/// repeated K and V with the heads out, K untransposed (passes/attention_keys.rs), BHSD_K, and
/// K and V read before their repeat.
fn assert_attention_layout(p: &Probe, s: &Session, what: &str) {
    let layouts: Vec<String> =
        s.graph.nodes.iter().filter(|n| n.op_type == "Attention").map(|n| n.attrs.string("layout", "BHSD").expect("layout")).collect();
    println!("{what}: attention layouts: {layouts:?}");
    if p.model == Model::Llama {
        // grouped-query attention: K and V read before their repeat (passes/attention_grouped_kv.rs)
        let grouped = s.passes.rewrites.iter().find(|(name, _)| *name == "attention_grouped_kv").map_or(0, |r| r.1);
        assert_eq!(grouped, layouts.len(), "{what}: every attention reads K and V unrepeated: passes {:?}", s.passes.rewrites);
    }
    let want = match p.model {
        Model::Gpt2 => "BS3HD",
        Model::Bert => "BSHD",
        Model::Llama => "BHSD_K",
    };
    assert!(!layouts.is_empty() && layouts.iter().all(|l| l == want), "{what}: every attention in layout {want}: {layouts:?}");
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt()
}

/// ‖got − want‖
fn diff_norm(got: &[f32], want: &[f32]) -> f64 {
    got.iter().zip(want).map(|(&g, &r)| (g as f64 - r as f64).powi(2)).sum::<f64>().sqrt()
}

/// ‖got − want‖ / ‖want‖ (‖got − want‖ when want is zero).
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let w = norm(want);
    if w == 0.0 {
        diff_norm(got, want)
    } else {
        diff_norm(got, want) / w
    }
}

#[test]
#[ignore]
fn gpu_exported_model_step_is_as_close_to_f32_as_the_cpus_bf16_step() {
    let Some(dir) = std::env::var_os("ORTRAIN_PARITY_MODEL") else {
        panic!("set ORTRAIN_PARITY_MODEL to a folder written by `python -m bench.parity_model DIR`");
    };
    let Some(_) = gpu("gpu_exported_model_step_is_as_close_to_f32_as_the_cpus_bf16_step") else { return };
    let p = read_probe(Path::new(&dir));
    let t0 = std::time::Instant::now();
    let (loss, reference) = cpu_step(&open(&p, Target::Cpu, MatmulPrecision::Fp32), &p);
    let (cpu_loss, cpu) = cpu_step(&open(&p, Target::Cpu, MatmulPrecision::Bf16), &p);
    let t1 = std::time::Instant::now();
    let cuda_session = open(&p, Target::Cuda, MatmulPrecision::Bf16);
    assert_attention_layout(&p, &cuda_session, "bf16");
    // the LM head and its loss fused (passes/fuse_linear_cross_entropy.rs), as accelerate()'s graph
    let plan = cuda_session.plan(&sigs(&p), true).expect("plan");
    let heads: Vec<_> = cuda_session.graph.nodes.iter().filter(|n| n.op_type == "LinearCrossEntropy").collect();
    assert_eq!(heads.len(), 1, "one fused LM head: passes {:?}", cuda_session.passes);
    let types: Vec<_> = heads[0].inputs.iter().take(2).map(|v| v.and_then(|v| plan.dtype(v))).collect();
    println!("bf16 LM head: X and W {types:?}");
    // the modes a session of each precision runs its f32 products in (session/cuda.rs)
    let mut gpu = gpu_steps(&cuda_session, &p, 2, F32Mode::Bf16, 1.0);
    // nothing a step leaves behind in the arena, the constants or the kernels' scratch changes
    // the next one, and no kernel sums in a varying order: the same bits (the embeddings' too,
    // BERT's token types all 0: GatherGrad sums repeated rows in position order, ops/gather.rs)
    let mut differ = Vec::new();
    for ((name, ..), (a, b)) in p.weights.iter().zip(gpu[0].1.iter().zip(&gpu[1].1)) {
        if a.iter().zip(b.iter()).any(|(x, y)| x.to_bits() != y.to_bits()) {
            differ.push(format!("{name} ({:.2e})", rel_err(b, a)));
        }
    }
    assert!(
        gpu[1].0.to_bits() == gpu[0].0.to_bits() && differ.is_empty(),
        "a second CUDA step on the same plan and arena differs from the first: loss {} then {}; gradients {differ:?}",
        gpu[0].0,
        gpu[1].0
    );
    let (gpu_loss, gpu) = gpu.swap_remove(0);
    // what explain() reports: every attention ran the flash kernels, GPT-2's with the causal mask
    // computed (and the attention_mask's key padding), BERT's with no mask (or the key padding)
    let paths = cuda_session.attention_paths_cuda();
    use crate::backend::cuda::ops::attention_path::{FLASH, FLASH_CAUSAL, FLASH_KEY_PADDING, FLASH_PADDED};
    let bert = p.model == Model::Bert;
    let want = match (bert, padded(&p)) {
        (false, false) => FLASH_CAUSAL,
        (false, true) => FLASH_PADDED,
        (true, false) => FLASH,
        (true, true) => FLASH_KEY_PADDING,
    };
    assert!(!paths.is_empty() && paths.iter().all(|(_, p)| *p == Some(want)), "attention paths: {paths:?}");
    let t2 = std::time::Instant::now();
    let fp16_session = open(&p, Target::Cuda, MatmulPrecision::Fp16);
    assert_attention_layout(&p, &fp16_session, "fp16");
    let (fp16_loss, fp16) = gpu_steps(&fp16_session, &p, 1, F32Mode::F16, 1024.0).swap_remove(0);
    println!(
        "loss: f32 {loss}, CPU bf16 {cpu_loss}, CUDA bf16 {gpu_loss}, CUDA fp16 {fp16_loss} (CPU steps {:.1} s, two CUDA bf16 steps {:.1} s, \
         one fp16 step {:.1} s)",
        (t1 - t0).as_secs_f64(),
        (t2 - t1).as_secs_f64(),
        t2.elapsed().as_secs_f64()
    );
    let rt = super::support::runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let family = |f: &str, t: &str| {
        let variants = ["d32r128", "d64", "d64r128", "d80", "d96", "d128"];
        let variants = variants.iter().flat_map(|v| [v.to_string(), format!("{v}_kp")]).collect::<Vec<_>>();
        ["fwd", "bwd_dq", "bwd_dkv"].iter().all(|k| variants.iter().any(|v| rt.has_launched(&format!("attention_{f}_{k}_{v}_{t}"))))
    };
    for t in ["bf16", "f16"] {
        println!("{t} attention kernels launched: flash {}, tensor-core (attention_mma) {}", family("flash", t), family("mma", t));
    }
    // GPT-2's bf16 LM head makes its logits in bf16 and G from them in place (BERT's takes f32
    // X and W, rounded for its bf16 products: its transform's LayerNorm stays f32)
    assert!(bert || rt.has_launched("lce_rows_v16_bf16"), "the bf16 session's LM head rows: lce_rows_v16_bf16 never launched");
    let mut worst = Vec::new();
    // a gradient that is 0 in exact arithmetic (BERT's key bias: adding q·b to every key's score
    // leaves the softmax as it was) is f32 noise in the reference: its errors count against the
    // largest gradient's norm instead of its own, under the same bounds
    let largest = reference.iter().map(|r| norm(r)).fold(0.0, f64::max);
    for ((((name, trainable, _), r), c), (g, h)) in p.weights.iter().zip(&reference).zip(&cpu).zip(gpu.iter().zip(&fp16)) {
        if !trainable {
            continue;
        }
        let vanishing = norm(r) < 1e-5 * largest;
        let err = |x: &[f32]| if vanishing { diff_norm(x, r) / largest } else { rel_err(x, r) };
        let (ec, eg, eh) = (err(c), err(g), err(h));
        let of = if vanishing { "error of the largest gradient (0 in exact arithmetic)" } else { "relative error" };
        println!("  {name:50} {of}: CPU bf16 {ec:.2e}, CUDA bf16 {eg:.2e}, CUDA fp16 {eh:.2e}");
        // bf16 operands carry 8 bits: ~4e-3 relative per product, more after a few layers; f16
        // operands 11 (on cuda-emu, 2-layer GPT-2: about a tenth of the bf16 step's error). One
        // parameter's CPU bf16 error depends on the machine's SIMD path (ln_f.bias: 3.0e-4 with
        // AVX2 only, where CUDA bf16 has 4.2e-3): f16 may also stay under 2^-10, which a step
        // computing in bf16 does not
        if eg.is_nan() || eg > 4.0 * ec + 2e-2 {
            worst.push(format!("{name}: CUDA bf16 {eg:.2e} vs CPU bf16 {ec:.2e}"));
        }
        if eh.is_nan() || eh > (0.5 * ec).max(1.0 / 1024.0) {
            worst.push(format!("{name}: CUDA fp16 {eh:.2e}, over half the CPU bf16 step's {ec:.2e}"));
        }
    }
    assert!(((gpu_loss - loss) / loss).abs() < 1e-2, "loss: CUDA bf16 {gpu_loss} vs f32 {loss}");
    assert!(((fp16_loss - loss) / loss).abs() < 1e-2, "loss: CUDA fp16 {fp16_loss} vs f32 {loss}");
    assert!(worst.is_empty(), "gradients the CUDA steps get much further from f32 than the CPU's bf16 step: {worst:?}");
}
