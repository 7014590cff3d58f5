//! The first launches: a kernel runs, writes what it should, and a wrong argument list is an
//! error before anything reaches the device.

use super::support::*;
use crate::backend::cuda::launch::{Grid, KArg};

#[test]
fn gpu_affine_and_fill_run_and_write_every_element() {
    let Some(g) = gpu("gpu_affine_and_fill_run_and_write_every_element") else { return };
    // n not a multiple of the block, and fewer blocks than elements need (the grid-stride loop)
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let (dx, dy) = (dev(g, &x), zeros::<f32>(g, n));
    run(g, "affine_f32", Grid::new(7, 256), &[dx.arg(), dy.arg(), KArg::I64(n as i64), KArg::F64(2.0), KArg::F64(-1.0)]);
    let y: Vec<f32> = host(&dy);
    assert!(y.iter().enumerate().all(|(i, &v)| v == i as f32 - 1.0), "affine_f32 wrong");

    let dz = zeros::<u32>(g, n);
    run(g, "fill_u32", Grid::elementwise(n as i64, 64), &[dz.arg(), KArg::I64(n as i64), KArg::U64(0xDEAD_BEEF)]);
    assert!(host::<u32>(&dz).iter().all(|&v| v == 0xDEAD_BEEF), "fill_u32 wrong");
}

#[test]
fn a_wrong_argument_list_is_refused_before_launch() {
    use crate::backend::cuda::launch::check_args;
    let e = check_args("affine_f32", &[KArg::Ptr(0), KArg::Ptr(0), KArg::I64(1), KArg::F32(2.0), KArg::F64(0.0)]).unwrap_err();
    assert!(e.to_string().contains("affine_f32: argument 3 must be F64, not F32"), "{e}");
    let e = check_args("affine_f32", &[KArg::Ptr(0)]).unwrap_err();
    assert!(e.to_string().contains("affine_f32 takes 5 arguments, 1 given"), "{e}");
    assert!(check_args("no_such_f32", &[]).unwrap_err().to_string().contains("no CUDA kernel named no_such_f32"));
}
