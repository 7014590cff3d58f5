//! The device radix sort (kernels/sort.cu, ops/radix_sort.rs) against a stable host sort: keys
//! from int64 indices as GatherGrad makes them (gather_grad_keys_i64: the values are the
//! positions, so a stable sort leaves equal keys' values ascending), from one key to many
//! tiles, with keys of one to four bytes (one to four passes) and long runs of one key.

use super::exec::download_f32;
use super::support::*;
use crate::backend::cuda::blas::F32Mode;
use crate::backend::cuda::launch::KArg;
use crate::backend::cuda::ops::radix_sort::{passes, sort_pairs};

fn args_of(op: &str) -> Vec<KArg> {
    let (p, i) = (KArg::Ptr, KArg::I64);
    match op {
        "radix_hist" => vec![p(1), p(2), i(3), KArg::I32(0), i(4)],
        "radix_scan" => vec![p(1), i(2)],
        "radix_scatter" => vec![p(1), p(2), p(3), p(4), p(5), i(6), KArg::I32(8), i(7)],
        _ => panic!("sort: no test launches {op}"),
    }
}

#[test]
fn sort_test_argument_lists_match_the_registry() {
    check_family_args("sort", args_of);
}

#[test]
fn gpu_radix_sort_is_stable_and_sorted() {
    let Some(g) = gpu("gpu_radix_sort_is_stable_and_sorted") else { return };
    let rt = runtime_or_reason().unwrap_or_else(|e| panic!("{e}"));
    let (ctx, _claim) = direct_ctx(F32Mode::Exact, 0);
    let mut rng = Rng::new(31);
    for (n, dim) in
        [(0usize, 5usize), (1, 1), (700, 200), (1024, 256), (1025, 257), (5000, 70000), (3000, 3), (2100, (u32::MAX - 1) as usize)]
    {
        let idx: Vec<i64> = (0..n).map(|j| if j % 3 == 0 { (dim / 2) as i64 } else { rng.int(0, dim as i64) }).collect();
        let max_key = dim as u32;
        let di = dev(g, &idx);
        let sorted = sort_pairs(&ctx, n, max_key, 0, |k, v| {
            let args = [KArg::Ptr(di.ptr()), KArg::Ptr(k), KArg::Ptr(v), KArg::I64(n as i64), KArg::I64(dim as i64), KArg::Ptr(0)];
            rt.launch(ctx.stream, "gather_grad_keys_i64", rt.elementwise_grid(n), &args)
        })
        .unwrap_or_else(|e| panic!("n {n}, dim {dim}: {e}"));
        g.synchronize().expect("sync");
        // u32s as f32 bits (the copy moves bits only)
        let down = |addr: u64| -> Vec<u32> { download_f32(g, addr, n).iter().map(|v| v.to_bits()).collect() };
        let (got_keys, got_vals) = (down(sorted.keys), down(sorted.vals));
        let mut want: Vec<(u32, u32)> = idx.iter().enumerate().map(|(j, &k)| (k as u32, j as u32)).collect();
        want.sort_by_key(|&(k, _)| k);
        let what = format!("n {n}, keys below {dim} ({} passes)", passes(max_key));
        assert_eq!(got_keys, want.iter().map(|p| p.0).collect::<Vec<_>>(), "{what}: keys");
        assert_eq!(got_vals, want.iter().map(|p| p.1).collect::<Vec<_>>(), "{what}: values (positions, stable)");
    }
}
