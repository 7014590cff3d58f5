//! The kernel registry: every `kernels/<family>.cu` embedded with `include_str!`, and next to
//! it the list of kernels it must define. Kernel names are `<op>_<dtype>` on both sides: the
//! `.cu` files instantiate templates through X-macros (`ORT_FLOATS(UNARY, exp)` defines
//! `exp_f32`, `exp_f64`, `exp_bf16`, `exp_f16`), and the groups below name the same ops and the
//! same type lists. A test compiles every file with NVRTC and checks that the CUBIN defines
//! exactly these kernels (engine/tests/cuda_kernels.rs).

/// The element-type suffixes of the prelude's X-macros (kernels/prelude.cuh).
pub mod types {
    pub const FLOATS: &[&str] = &["f32", "f64", "bf16", "f16"];
    pub const NUMS: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32", "u8", "i8"];
    /// Types arithmetic is instantiated for (`ORT_ARITH`).
    pub const ARITH: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32"];
    /// Element widths for ops that only move bits (`ORT_WIDTHS`).
    pub const WIDTHS: &[&str] = &["u8", "u16", "u32", "u64"];
    /// Cast destinations: every number type and bool.
    pub const CAST_TO: &[&str] = &["f32", "f64", "bf16", "f16", "i64", "i32", "u8", "i8", "bool"];
    pub const F32: &[&str] = &["f32"];
    pub const U8: &[&str] = &["u8"];
    pub const I64: &[&str] = &["i64"];
}

/// Ops instantiated for the same element types.
#[derive(Debug)]
pub struct Group {
    pub ops: &'static [&'static str],
    pub dtypes: &'static [&'static str],
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
    }
}

/// The prelude every kernel file includes as "prelude.cuh".
pub const PRELUDE: (&str, &str) = ("prelude.cuh", include_str!("../../../../kernels/prelude.cuh"));

use types::*;

const CAST_OPS: &[&str] = &["cast_f32", "cast_f64", "cast_bf16", "cast_f16", "cast_i64", "cast_i32", "cast_u8", "cast_i8"];

pub static FAMILIES: &[Family] = &[Family {
    name: "elementwise",
    source: include_str!("../../../../kernels/elementwise.cu"),
    groups: &[
        Group { ops: &["sqrt", "exp", "log", "sin", "cos", "erf", "reciprocal", "floor", "ceil"], dtypes: FLOATS },
        Group { ops: &["neg", "abs", "sign"], dtypes: NUMS },
        Group { ops: &["is_nan", "is_inf"], dtypes: FLOATS },
        Group { ops: &["not", "and", "or", "xor", "equal"], dtypes: U8 },
        Group { ops: CAST_OPS, dtypes: CAST_TO },
        Group { ops: &["add", "sub", "mul", "div", "max", "min", "mod", "fmod"], dtypes: ARITH },
        Group { ops: &["pow"], dtypes: FLOATS },
        Group { ops: &["pow"], dtypes: I64 },
        Group { ops: &["equal", "less", "greater", "less_equal", "greater_equal"], dtypes: ARITH },
        Group { ops: &["where", "mask_select"], dtypes: WIDTHS },
        Group { ops: &["min_max_grad", "erf_grad", "affine"], dtypes: FLOATS },
    ],
}];

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
    fn every_family_includes_the_prelude_and_is_named_after_its_file() {
        for f in FAMILIES {
            assert!(f.source.contains("#include \"prelude.cuh\""), "{}", f.file());
            assert!(!f.kernel_names().is_empty());
        }
        assert_eq!(family_of("exp_bf16").map(|f| f.name), Some("elementwise"));
        assert_eq!(kernel_name("add", dtype_suffix(crate::tensor::DType::Bool)), "add_u8");
    }
}
