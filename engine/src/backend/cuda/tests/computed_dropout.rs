//! A Dropout whose ratio and training_mode are graph inputs (computed in the step, so read on
//! the device: kernels/dropout.cu's rate operands), through a CUDA session's forward and
//! backward: in training y = x·mask/(1 - ratio) and the weight's gradient follows the mask;
//! with training_mode false nothing is dropped; a ratio outside [0, 1) gives NaN and the
//! session reports the node after the step (`Session::index_errors_cuda`), the step itself
//! queued without an error.

use std::collections::HashMap;

use super::gpu_run::LEGACY;
use super::support::*;
use crate::ir::{Attrs, Dim, Graph, ValueKind};
use crate::session::cuda_graph::PhaseRun;
use crate::session::{Session, SessionOptions, Target};
use crate::tensor::{DType, Tensor};

const ROWS: usize = 64;
const COLS: usize = 33;

/// x [ROWS, COLS] · w [COLS], then Dropout(·, ratio, training_mode) with its mask; both inputs
/// of the Dropout are graph inputs. Outputs y and mask; weight w.
fn session(w_data: &[f32]) -> Session {
    let mut g = Graph::default();
    let known = |d: &[usize]| Some(d.iter().map(|&n| Dim::Known(n)).collect());
    let x = g.add_value("x", ValueKind::Input, Some(DType::F32), known(&[ROWS, COLS]));
    let ratio = g.add_value("ratio", ValueKind::Input, Some(DType::F32), known(&[]));
    let training = g.add_value("training", ValueKind::Input, Some(DType::Bool), known(&[]));
    g.inputs.extend([x, ratio, training]);
    let w = g.add_value("w", ValueKind::Weight, Some(DType::F32), known(&[COLS]));
    g.weights.push((w, Some(std::sync::Arc::new(Tensor::from_f32(vec![COLS], w_data.to_vec())))));
    let h = g.add_node("scale", "Mul", vec![Some(x), Some(w)], Attrs::default(), 1)[0];
    let outs = g.add_node("drop", "Dropout", vec![Some(h), Some(ratio), Some(training)], Attrs::default(), 2);
    g.outputs.extend(outs);
    let bytes = crate::onnx::export_model(&g, g.nodes.len(), &HashMap::new(), 17).expect("export");
    Session::from_onnx_with(&bytes, None, &["w".to_string()], &[true], None, Target::Cuda, SessionOptions::default()).expect("import")
}

struct Step {
    y: Vec<f32>,
    mask: Vec<u8>,
    dw: Vec<f32>,
}

/// One training step (forward, backward with dy = 1) with the given ratio and training_mode.
fn step(g: &crate::backend::cuda::loader::Loaded, s: &Session, x: &[f32], w: &[f32], ratio: f32, training: bool) -> Step {
    let rt = runtime_or_reason().expect("runtime");
    let sigs = vec![(DType::F32, vec![ROWS, COLS]), (DType::F32, vec![]), (DType::Bool, vec![])];
    let arena = zeros::<u8>(g, s.plan(&sigs, true).expect("plan").arena_bytes.max(1));
    let (dx, dr, dt, dwt) = (dev(g, x), dev(g, &[ratio]), dev(g, &[training as u8]), dev(g, w));
    let (ones, grad) = (dev(g, &vec![1f32; ROWS * COLS]), zeros::<f32>(g, COLS));
    let feed: Vec<_> = sigs.into_iter().zip([dx.ptr(), dr.ptr(), dt.ptr()]).collect();
    // SAFETY: every buffer holds what the plan says and lives until the synchronize below.
    let mut p = unsafe { s.forward_cuda(rt, LEGACY, arena.ptr(), &feed, &[dwt.ptr()], true, 7, &[], false, PhaseRun::Launches) }
        .expect("the forward pass is queued");
    let (y_at, _, _) = s.output_cuda(&p, 0).expect("y");
    let (mask_at, _, _) = s.output_cuda(&p, 1).expect("mask");
    g.synchronize().expect("sync");
    let (mut y, mut mask) = (vec![0f32; ROWS * COLS], vec![0u8; ROWS * COLS]);
    // SAFETY: both outputs hold ROWS·COLS planned elements in the live arena.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut y, y_at).expect("y");
        cudarc::driver::result::memcpy_dtoh_sync(&mut mask, mask_at).expect("mask");
    }
    // SAFETY: as above; the gradient buffer holds COLS f32.
    unsafe { s.backward_cuda(rt, LEGACY, &mut p, &[dwt.ptr()], &[ones.ptr(), 0], &[grad.ptr()], None) }
        .expect("the backward pass is queued");
    g.synchronize().expect("sync");
    Step { y, mask, dw: host::<f32>(&grad) }
}

#[test]
fn gpu_a_dropout_with_a_computed_ratio_and_training_mode_trains() {
    let Some(g) = gpu("gpu_a_dropout_with_a_computed_ratio_and_training_mode_trains") else { return };
    let mut rng = Rng::new(54);
    let (x, w) = (rng.f32s(ROWS * COLS, -1.0, 1.0), rng.f32s(COLS, -1.0, 1.0));
    let s = session(&w);
    let h = |i: usize| x[i] * w[i % COLS];
    let dw_of = |mask: &[u8], scale: f32| -> Vec<f64> {
        (0..COLS).map(|c| (0..ROWS).map(|r| r * COLS + c).filter(|&i| mask[i] == 1).map(|i| (x[i] * scale) as f64).sum()).collect()
    };

    // training at ratio 0.25: about a quarter dropped, the rest scaled by 4/3
    let t = step(g, &s, &x, &w, 0.25, true);
    let kept = t.mask.iter().filter(|&&m| m == 1).count() as f64 / t.mask.len() as f64;
    assert!((kept - 0.75).abs() < 0.05, "ratio 0.25 read on the device kept {kept} of the elements");
    let scale = (1.0f64 / 0.75) as f32;
    for i in 0..ROWS * COLS {
        let want = if t.mask[i] == 1 { h(i) * scale } else { 0.0 };
        assert_eq!(t.y[i], want, "element {i}: y {} where mask {} and x·w {}", t.y[i], t.mask[i], h(i));
    }
    assert_close("dw, training at ratio 0.25", &t.dw.iter().map(|&v| v as f64).collect::<Vec<_>>(), &dw_of(&t.mask, scale), 1e-5, 1e-6);

    // training_mode false: nothing dropped or scaled, the ratio unread
    let t = step(g, &s, &x, &w, 0.25, false);
    assert!(t.mask.iter().all(|&m| m == 1), "training_mode false dropped an element");
    assert!((0..ROWS * COLS).all(|i| t.y[i] == h(i)), "training_mode false changed y");
    assert_close("dw, not training", &t.dw.iter().map(|&v| v as f64).collect::<Vec<_>>(), &dw_of(&t.mask, 1.0), 1e-5, 1e-6);
    assert!(s.index_errors_cuda().expect("flags").is_empty(), "valid ratios were reported");

    // a ratio outside [0, 1): NaN, and the node reported once the step has landed
    let t = step(g, &s, &x, &w, 1.5, true);
    assert!(t.y.iter().all(|v| v.is_nan()), "ratio 1.5: y is not NaN");
    assert_eq!(s.index_errors_cuda().expect("flags"), vec!["Dropout node 'drop'".to_string()]);
    assert!(s.index_errors_cuda().expect("flags").is_empty(), "the report repeats");
}
