//! The kernel registry: every `kernels/<family>.cu` embedded with `include_str!`, and next to
//! it the list of kernels it must define. Kernel names are `<op>_<dtype>` on both sides: the
//! `.cu` files instantiate templates through X-macros (`ORT_FLOATS(UNARY, exp)` defines
//! `exp_f32`, `exp_f64`, `exp_bf16`, `exp_f16`), and the groups below name the same ops and the
//! same type lists. Each group also gives its kernels' parameters (the launch ABI, abi.rs). A
//! test compiles every file with NVRTC and checks that the CUBIN defines exactly these kernels,
//! with these parameter layouts (engine/tests/cuda_kernels.rs).

/// The element-type suffixes of the prelude's X-macros (kernels/prelude.cuh).
pub mod types {
    pub const FLOATS: &[&str] = &["f32", "f64", "bf16", "f16"];
    pub const NUMS: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32", "u8", "i8"];
    /// Types arithmetic is instantiated for (`ORT_ARITH`).
    pub const ARITH: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32"];
    /// Element widths for ops that only move bits (`ORT_WIDTHS`).
    pub const WIDTHS: &[&str] = &["u8", "u16", "u32", "u64"];
    /// 16-byte vectors (`copy_v16`: copies the host rewrote into whole vectors).
    pub const V16: &[&str] = &["v16"];
    /// Cast destinations: every number type and bool.
    pub const CAST_TO: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32", "u8", "i8", "bool"];
    /// Types with a native atomic add (scatter-add gradients).
    pub const FLOATS_F32_F64: &[&str] = &["f32", "f64"];
    /// Gradient types of the fused optimizers (parameters and moments are f32).
    pub const GRADS: &[&str] = &["f32", "bf16", "f16"];
    pub const F32: &[&str] = &["f32"];
    /// The 16-bit floats.
    pub const HALVES: &[&str] = &["bf16", "f16"];
    /// The tensor-core attention's instances: f32 tensors with bf16 products ("f32") or f16
    /// products ("f32f16"), and bf16 and f16 tensors multiplied in their own type.
    pub const ATTENTION_MMA: &[&str] = &["f32", "f32f16", "bf16", "f16"];
    pub const F64: &[&str] = &["f64"];
    pub const U8: &[&str] = &["u8"];
    pub const U32: &[&str] = &["u32"];
    pub const I64: &[&str] = &["i64"];
}

/// Ops instantiated for the same element types, with the same parameter list.
#[derive(Debug)]
pub struct Group {
    pub ops: &'static [&'static str],
    pub dtypes: &'static [&'static str],
    /// The kernels' parameters (checked against the CUBIN's layout by the kernel tests).
    pub args: &'static [Arg],
}

/// One kernel file and the kernels it defines.
#[derive(Debug)]
pub struct Family {
    /// The file's stem: kernels/<name>.cu.
    pub name: &'static str,
    pub source: &'static str,
    pub groups: &'static [Group],
}

impl Family {
    /// "kernels/softmax.cu": the name used in compile errors and logs.
    pub fn file(&self) -> String {
        format!("kernels/{}.cu", self.name)
    }
    /// Every kernel this file must define, with its parameters, sorted by name.
    pub fn kernels(&self) -> Vec<(String, &'static [Arg])> {
        let mut v: Vec<(String, &'static [Arg])> = self
            .groups
            .iter()
            .flat_map(|g| g.ops.iter().flat_map(move |op| g.dtypes.iter().map(move |t| (kernel_name(op, t), g.args))))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
    /// Every kernel this file must define, sorted.
    pub fn kernel_names(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.groups.iter().flat_map(|g| g.ops.iter().flat_map(move |op| g.dtypes.iter().map(move |t| kernel_name(op, t)))).collect();
        v.sort();
        v
    }
}

/// `<op>_<dtype>`, the name convention of every kernel.
pub fn kernel_name(op: &str, dtype: &str) -> String {
    format!("{op}_{dtype}")
}

/// The kernel-name suffix of an engine element type (bool data is u8).
pub fn dtype_suffix(d: crate::tensor::DType) -> &'static str {
    use crate::tensor::DType::*;
    match d {
        F32 => "f32",
        F64 => "f64",
        I64 => "i64",
        I32 => "i32",
        Bool | U8 => "u8",
        I8 => "i8",
        BF16 => "bf16",
        F16 => "f16",
    }
}

use super::abi::Arg;

/// The prelude every kernel file includes as "prelude.cuh".
pub const PRELUDE: (&str, &str) = ("prelude.cuh", include_str!("../../../../kernels/prelude.cuh"));

/// Every header a kernel file may include, served to NVRTC from memory (and part of the cache
/// key): the prelude, what the two attention families share, the tensor-core family's tile
/// staging, the flash kernels' data movement and templates (instantiated with and without key
/// padding), and the row normalisations' templates (LayerNorm and RMSNorm).
pub const HEADERS: &[(&str, &str)] = &[
    PRELUDE,
    ("philox.cuh", include_str!("../../../../kernels/philox.cuh")),
    ("attention.cuh", include_str!("../../../../kernels/attention.cuh")),
    ("attention_mma_stage.cuh", include_str!("../../../../kernels/attention_mma_stage.cuh")),
    ("attention_flash_fragments.cuh", include_str!("../../../../kernels/attention_flash_fragments.cuh")),
    ("attention_flash.cuh", include_str!("../../../../kernels/attention_flash.cuh")),
    ("norm_rows.cuh", include_str!("../../../../kernels/norm_rows.cuh")),
];

use types::*;

const CAST_OPS: &[&str] = &["cast_f32", "cast_f64", "cast_bf16", "cast_f16", "cast_i64", "cast_i32", "cast_u8", "cast_i8"];

macro_rules! family {
    ($name:literal, [$($group:expr),* $(,)?]) => {
        Family { name: $name, source: include_str!(concat!("../../../../kernels/", $name, ".cu")), groups: &[$($group),*] }
    };
}

const fn g(ops: &'static [&'static str], dtypes: &'static [&'static str], args: &'static [Arg]) -> Group {
    Group { ops, dtypes, args }
}

use Arg::{AttnShape, Ptr, Reduce, Strides, Win2d, F32 as AF32, F64 as AF64, I32 as AI32, I64 as AI64, U64 as AU64};

/// Signatures shared by many kernels.
const UNARY: &[Arg] = &[Ptr, Ptr, AI64];
const BINARY: &[Arg] = &[Ptr, Ptr, Ptr, Strides, AI64];
const ACT: &[Arg] = &[Ptr, Ptr, AI64, AF32, AF32];
const ACT_GRAD: &[Arg] = &[Ptr, Ptr, Ptr, AI64, AF32, AF32];
/// The flash attention kernels' (kernels/attention_flash.cuh), with and without key padding.
const FLASH_FWD: &[Arg] = &[Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32, Ptr];
const FLASH_BWD: &[Arg] = &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32, Ptr];

/// Every kernel file, in kernels/ at the repository root, with its kernels and their signatures
/// (the comment at the top of each file describes the parameters).
pub static FAMILIES: &[Family] = &[
    family!(
        "elementwise",
        [
            g(&["sqrt", "exp", "log", "sin", "cos", "erf", "reciprocal", "floor", "ceil", "is_nan"], FLOATS, UNARY),
            g(&["neg", "abs", "sign"], NUMS, UNARY),
            g(&["not"], U8, UNARY),
            g(CAST_OPS, CAST_TO, UNARY),
            g(&["cast_rows_f32"], HALVES, &[Ptr, Ptr, AI64, AI64, AI64, AI64]),
            g(&["is_inf"], FLOATS, &[Ptr, Ptr, AI64, AI32, AI32]),
            g(&["add", "sub", "mul", "div", "max", "min", "mod", "fmod"], NUMS, BINARY),
            g(&["pow"], FLOATS, BINARY),
            g(&["pow"], I64, BINARY),
            g(&["equal", "less", "greater", "less_equal", "greater_equal"], NUMS, BINARY),
            g(&["and", "or", "xor"], U8, BINARY),
            g(&["where"], WIDTHS, &[Ptr, Ptr, Ptr, Ptr, Strides, AI64]),
            g(&["mask_select"], WIDTHS, &[Ptr, Ptr, Ptr, Strides, AI64, AI32]),
            g(&["min_max_grad"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Strides, AI64, AI32, AI32]),
            g(&["erf_grad"], FLOATS, BINARY),
            g(&["affine"], FLOATS, &[Ptr, Ptr, AI64, AF64, AF64]),
        ]
    ),
    family!(
        "activation",
        [
            g(&["relu", "leaky_relu", "tanh", "sigmoid", "gelu", "gelu_tanh", "softplus", "hard_sigmoid", "hard_swish"], FLOATS, ACT),
            g(
                &[
                    "relu_grad",
                    "leaky_relu_grad",
                    "tanh_grad",
                    "sigmoid_grad",
                    "gelu_grad",
                    "gelu_tanh_grad",
                    "softplus_grad",
                    "hard_sigmoid_grad",
                    "hard_swish_grad",
                ],
                FLOATS,
                ACT_GRAD,
            ),
        ]
    ),
    family!(
        "softmax",
        [
            g(&["softmax", "log_softmax"], FLOATS, &[Ptr, Ptr, AI64, AI64, AI64]),
            g(&["softmax_grad", "log_softmax_grad"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AI64, AI64]),
        ]
    ),
    family!(
        "layernorm",
        [
            g(&["layer_norm"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AF32]),
            g(&["layer_norm_stats"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AI64, AF32]),
            g(&["layer_norm_grad"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64]),
            g(&["layer_norm_grad_params_reduce"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64]),
            g(&["layer_norm_f32_y"], HALVES, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AF32]),
            g(&["layer_norm_grad_f32_dy"], HALVES, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64]),
            g(
                &["layer_norm_grad_acc_f32_dy_f32", "layer_norm_grad_acc_f32_dy_bf16", "layer_norm_grad_acc_f32_dy_f16"],
                HALVES,
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64],
            ),
        ]
    ),
    family!(
        "rmsnorm",
        [
            g(&["rms_norm"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI64, AF32]),
            g(&["rms_norm_grad"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64]),
        ]
    ),
    family!(
        "reduce",
        [
            g(&["reduce_sum", "reduce_sum_thread"], FLOATS, &[Ptr, Ptr, Reduce, AF64]),
            g(&["reduce_sum", "reduce_sum_thread"], I64, &[Ptr, Ptr, Reduce, AF64]),
            g(&["reduce_max", "reduce_max_thread", "reduce_min", "reduce_min_thread"], FLOATS, &[Ptr, Ptr, Reduce, AF64]),
            g(&["reduce_grad"], FLOATS, &[Ptr, Ptr, Strides, AI64, AF64]),
        ]
    ),
    family!(
        "movement",
        [
            g(&["copy"], WIDTHS, &[Ptr, Ptr, Strides, AI64]),
            g(&["copy"], V16, &[Ptr, Ptr, Strides, AI64]),
            g(&["fill"], WIDTHS, &[Ptr, AI64, AU64]),
            g(&["trilu"], WIDTHS, &[Ptr, Ptr, AI64, AI64, AI64, AI32, AI64, Ptr]),
        ]
    ),
    family!(
        "gather",
        [
            g(&["gather"], WIDTHS, &[Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64, Ptr]),
            g(&["gather_elements"], WIDTHS, &[Ptr, Ptr, Ptr, Strides, AI64, AI32, AI64, Ptr]),
            g(&["gather_grad_keys"], I64, &[Ptr, Ptr, Ptr, AI64, AI64, Ptr]),
            g(&["gather_grad_rows"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64]),
            g(&["gather_grad_runs"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64]),
            g(&["gather_grad_small"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64, Ptr]),
            g(&["gather_elements_grad"], FLOATS_F32_F64, &[Ptr, Ptr, Ptr, Strides, AI64, AI32, AI64, Ptr]),
            g(&["gather_nd"], WIDTHS, &[Ptr, Ptr, Ptr, Strides, AI64, AI64, AI64, AI64, Ptr]),
            g(&["gather_nd_grad"], FLOATS_F32_F64, &[Ptr, Ptr, Ptr, Strides, AI64, AI64, AI64, AI64, Ptr]),
        ]
    ),
    family!("scan", [g(&["cumsum"], ARITH, &[Ptr, Ptr, AI64, AI64, AI64, AI32, AI32])]),
    family!(
        "sort",
        [
            g(&["radix_hist"], U32, &[Ptr, Ptr, AI64, AI32, AI64]),
            g(&["radix_scan"], U32, &[Ptr, AI64]),
            g(&["radix_scatter"], U32, &[Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI32, AI64]),
        ]
    ),
    family!("conv", [g(&["im2col", "col2im"], FLOATS, &[Ptr, Ptr, Win2d, AI64])]),
    family!(
        "pool",
        [
            g(&["max_pool"], FLOATS, &[Ptr, Ptr, Ptr, Win2d, AI64]),
            g(&["max_pool_grad"], FLOATS_F32_F64, &[Ptr, Ptr, Ptr, AI64, AI64, AI64, Ptr]),
            g(&["avg_pool", "avg_pool_grad"], FLOATS, &[Ptr, Ptr, Win2d, AI64, AI32]),
        ]
    ),
    family!(
        "batchnorm",
        [
            g(&["batch_norm_stats"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI32]),
            g(&["batch_norm_apply"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AF64, AF64, AF64]),
            g(&["batch_norm_grad_sums"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AF64]),
            g(&["batch_norm_grad"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AF64, AI32]),
        ]
    ),
    family!(
        "dropout",
        [
            g(&["dropout"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AF32, AU64, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_slot"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AF32, Ptr, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_add"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AF32, AU64, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_add_slot"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AF32, Ptr, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_add_wide"], HALVES, &[Ptr, Ptr, Ptr, Ptr, AI64, AF32, AU64, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_add_wide_slot"], HALVES, &[Ptr, Ptr, Ptr, Ptr, AI64, AF32, Ptr, AU64, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_grad"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AF32, Ptr, AI32, Ptr, Ptr]),
            g(&["dropout_grad_wide"], HALVES, &[Ptr, Ptr, Ptr, AI64, AF32, Ptr, AI32, Ptr, Ptr]),
            g(&["random_uniform", "random_normal"], FLOATS, &[Ptr, AI64, AF64, AF64, Ptr, AU64]),
            g(&["bernoulli"], FLOATS, &[Ptr, Ptr, AI64, Ptr, AU64]),
            g(&["dropout_key"], I64, &[Ptr, Ptr, AU64]),
        ]
    ),
    family!(
        "loss",
        [
            g(&["sce_loss"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64, AI32, AI32, Ptr]),
            g(&["sce_reduce"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI32]),
            g(&["sce_grad_scale"], FLOATS, &[Ptr, Ptr, Ptr, AI64, AI64, AI64, AI32]),
            g(&["sce_grad"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI64, AI32, AI32, AI32]),
            g(&["lce_weights"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI32, Ptr]),
            g(&["lce_rows"], FLOATS, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI32]),
            g(&["lce_rows_v16"], HALVES, &[Ptr, Ptr, Ptr, Ptr, Ptr, AI64, AI64, AI64, AI32]),
        ]
    ),
    family!(
        "attention",
        [
            g(&["attention_fwd"], F32, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32]),
            g(&["attention_bwd_dq"], F32, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32]),
            g(&["attention_bwd_dkv"], F32, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32]),
        ]
    ),
    family!(
        "attention_mma",
        [
            g(
                &["attention_mma_fwd_d64", "attention_mma_fwd_d128"],
                ATTENTION_MMA,
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32, AI32]
            ),
            g(
                &["attention_mma_bwd_dq_d64", "attention_mma_bwd_dq_d128"],
                ATTENTION_MMA,
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32]
            ),
            g(
                &["attention_mma_bwd_dkv_d64", "attention_mma_bwd_dkv_d128"],
                ATTENTION_MMA,
                &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, AttnShape, AF32, AI32],
            ),
        ]
    ),
    family!(
        "attention_flash",
        [
            g(
                &[
                    "attention_flash_fwd_d32r128",
                    "attention_flash_fwd_d64",
                    "attention_flash_fwd_d64r128",
                    "attention_flash_fwd_d80",
                    "attention_flash_fwd_d96",
                    "attention_flash_fwd_d128",
                ],
                HALVES,
                FLASH_FWD
            ),
            g(
                &[
                    "attention_flash_bwd_dq_d32r128",
                    "attention_flash_bwd_dq_d64",
                    "attention_flash_bwd_dq_d64r128",
                    "attention_flash_bwd_dq_d80",
                    "attention_flash_bwd_dq_d96",
                    "attention_flash_bwd_dq_d128",
                ],
                HALVES,
                FLASH_BWD
            ),
            g(
                &[
                    "attention_flash_bwd_dkv_d32r128",
                    "attention_flash_bwd_dkv_d64",
                    "attention_flash_bwd_dkv_d64r128",
                    "attention_flash_bwd_dkv_d80",
                    "attention_flash_bwd_dkv_d96",
                    "attention_flash_bwd_dkv_d128",
                ],
                HALVES,
                FLASH_BWD
            ),
        ]
    ),
    family!(
        "attention_flash_padded",
        [
            g(
                &[
                    "attention_flash_fwd_d32r128_kp",
                    "attention_flash_fwd_d64_kp",
                    "attention_flash_fwd_d64r128_kp",
                    "attention_flash_fwd_d80_kp",
                    "attention_flash_fwd_d96_kp",
                    "attention_flash_fwd_d128_kp",
                ],
                HALVES,
                FLASH_FWD
            ),
            g(
                &[
                    "attention_flash_bwd_dq_d32r128_kp",
                    "attention_flash_bwd_dq_d64_kp",
                    "attention_flash_bwd_dq_d64r128_kp",
                    "attention_flash_bwd_dq_d80_kp",
                    "attention_flash_bwd_dq_d96_kp",
                    "attention_flash_bwd_dq_d128_kp",
                ],
                HALVES,
                FLASH_BWD
            ),
            g(
                &[
                    "attention_flash_bwd_dkv_d32r128_kp",
                    "attention_flash_bwd_dkv_d64_kp",
                    "attention_flash_bwd_dkv_d64r128_kp",
                    "attention_flash_bwd_dkv_d80_kp",
                    "attention_flash_bwd_dkv_d96_kp",
                    "attention_flash_bwd_dkv_d128_kp",
                ],
                HALVES,
                FLASH_BWD
            ),
        ]
    ),
    family!(
        "attention_flash_dropout",
        [
            g(
                &[
                    "attention_flash_fwd_d32r128_dp",
                    "attention_flash_fwd_d64_dp",
                    "attention_flash_fwd_d64r128_dp",
                    "attention_flash_fwd_d80_dp",
                    "attention_flash_fwd_d96_dp",
                    "attention_flash_fwd_d128_dp",
                ],
                HALVES,
                FLASH_FWD
            ),
            g(
                &[
                    "attention_flash_bwd_dq_d32r128_dp",
                    "attention_flash_bwd_dq_d64_dp",
                    "attention_flash_bwd_dq_d64r128_dp",
                    "attention_flash_bwd_dq_d80_dp",
                    "attention_flash_bwd_dq_d96_dp",
                    "attention_flash_bwd_dq_d128_dp",
                ],
                HALVES,
                FLASH_BWD
            ),
            g(
                &[
                    "attention_flash_bwd_dkv_d32r128_dp",
                    "attention_flash_bwd_dkv_d64_dp",
                    "attention_flash_bwd_dkv_d64r128_dp",
                    "attention_flash_bwd_dkv_d80_dp",
                    "attention_flash_bwd_dkv_d96_dp",
                    "attention_flash_bwd_dkv_d128_dp",
                ],
                HALVES,
                FLASH_BWD
            ),
        ]
    ),
    family!(
        "attention_flash_padded_dropout",
        [
            g(
                &[
                    "attention_flash_fwd_d32r128_kp_dp",
                    "attention_flash_fwd_d64_kp_dp",
                    "attention_flash_fwd_d64r128_kp_dp",
                    "attention_flash_fwd_d80_kp_dp",
                    "attention_flash_fwd_d96_kp_dp",
                    "attention_flash_fwd_d128_kp_dp",
                ],
                HALVES,
                FLASH_FWD
            ),
            g(
                &[
                    "attention_flash_bwd_dq_d32r128_kp_dp",
                    "attention_flash_bwd_dq_d64_kp_dp",
                    "attention_flash_bwd_dq_d64r128_kp_dp",
                    "attention_flash_bwd_dq_d80_kp_dp",
                    "attention_flash_bwd_dq_d96_kp_dp",
                    "attention_flash_bwd_dq_d128_kp_dp",
                ],
                HALVES,
                FLASH_BWD
            ),
            g(
                &[
                    "attention_flash_bwd_dkv_d32r128_kp_dp",
                    "attention_flash_bwd_dkv_d64_kp_dp",
                    "attention_flash_bwd_dkv_d64r128_kp_dp",
                    "attention_flash_bwd_dkv_d80_kp_dp",
                    "attention_flash_bwd_dkv_d96_kp_dp",
                    "attention_flash_bwd_dkv_d128_kp_dp",
                ],
                HALVES,
                FLASH_BWD
            ),
        ]
    ),
    family!(
        "optim",
        [
            g(&["adam"], GRADS, &[Ptr, Ptr, Ptr, AI64, AI64, AF32, AF32, AF32, AF32, AF32, AF32, AF32, AF32, AI32, AI32]),
            g(&["sgd"], GRADS, &[Ptr, Ptr, Ptr, AI64, AI64, AF32, AF32, AF32, AF32, AI32, AI32, AI32]),
            g(&["sum_squares", "scale_by"], GRADS, &[Ptr, Ptr, Ptr, AI64, AI64, Ptr]),
            g(&["grad_norm"], F64, &[Ptr, AI64, AF32, Ptr, Ptr]),
        ]
    ),
];

/// The registered parameters of `kernel`, if it exists.
pub fn signature(kernel: &str) -> Option<&'static [Arg]> {
    FAMILIES
        .iter()
        .flat_map(|f| f.groups.iter())
        .find_map(|g| g.ops.iter().any(|op| g.dtypes.iter().any(|t| kernel_name(op, t) == kernel)).then_some(g.args))
}

/// The family that defines `kernel`, if any.
pub fn family_of(kernel: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.kernel_names().iter().any(|k| k == kernel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_across_families() {
        let mut all: Vec<String> = FAMILIES.iter().flat_map(|f| f.kernel_names()).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "a kernel name is defined twice");
    }

    #[test]
    fn every_kernel_file_is_registered() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("kernels/")
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".cu")).map(String::from))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> = FAMILIES.iter().map(|f| f.name.to_string()).collect();
        registered.sort();
        assert_eq!(on_disk, registered);
    }

    #[test]
    fn every_family_includes_the_prelude_and_is_named_after_its_file() {
        for f in FAMILIES {
            assert!(f.source.contains("#include \"prelude.cuh\""), "{}", f.file());
            assert!(!f.kernel_names().is_empty());
        }
        assert_eq!(family_of("exp_bf16").map(|f| f.name), Some("elementwise"));
        assert_eq!(family_of("layer_norm_grad_f32").map(|f| f.name), Some("layernorm"));
        assert_eq!(family_of("adam_bf16").map(|f| f.name), Some("optim"));
        assert_eq!(family_of("gather_grad_rows_bf16").map(|f| f.name), Some("gather"));
        assert_eq!(family_of("radix_scatter_u32").map(|f| f.name), Some("sort"));
        assert_eq!(kernel_name("add", dtype_suffix(crate::tensor::DType::Bool)), "add_u8");
    }

    /// Kernels instantiated for f32 but not for both 16-bit types, each run on widened f32
    /// copies by its dispatcher (ops/widen.rs) when a 16-bit plan reaches it.
    const WIDENED: &[(&str, &str)] = &[
        ("gather_elements_grad", "ops/gather.rs gather_elements_grad"),
        ("gather_nd_grad", "ops/gather_nd.rs gather_nd_grad"),
        ("max_pool_grad", "ops/pool.rs max_pool_grad"),
        ("attention_fwd", "ops/attention.rs attention"),
        ("attention_bwd_dq", "ops/attention.rs attention_grad"),
        ("attention_bwd_dkv", "ops/attention.rs attention_grad"),
    ];

    /// 16-bit plans (the autocast pass) reach every float kernel: a kernel made for f32 has bf16
    /// and f16 instances too, or is one its dispatcher widens (listed above). A 16-bit plan once
    /// failed at run time on the missing `gather_grad_bf16`.
    #[test]
    fn every_f32_kernel_has_sixteen_bit_instances_or_is_widened() {
        let mut lacking = Vec::new();
        for f in FAMILIES {
            for g in f.groups.iter().filter(|g| g.dtypes.contains(&"f32")) {
                for op in g.ops {
                    let half = ["bf16", "f16"].iter().all(|t| g.dtypes.contains(t));
                    if !half && !WIDENED.iter().any(|(k, _)| k == op) {
                        lacking.push(format!("{op} ({}: {:?})", f.file(), g.dtypes));
                    }
                }
            }
        }
        assert!(lacking.is_empty(), "f32 kernels with no 16-bit instances that no dispatcher widens: {lacking:?}");
    }
}
