//! The vector instruction level of this CPU, detected once at run time. Kernels with SIMD paths
//! (backend/cpu/vmath.rs, backend/cpu/random.rs, optim/adam.rs) compile their loops for each
//! level and pick by it (`multiversion!`); nothing is built for the build machine's CPU.

use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Level {
    /// AVX-512F and FMA.
    Avx512,
    /// AVX2 and FMA.
    Avx2,
    /// Neither: the baseline target's instructions.
    Generic,
}

pub fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Generic
    })
}

/// `multiversion!(name, body, (args) -> ret)`: a module `name` whose `call(args)` runs the
/// `#[inline(always)]` function `body::<FMA>` compiled for AVX-512F, for AVX2+FMA or for the
/// baseline, whichever `level()` reports (the body is written so that LLVM vectorises it).
/// `FMA` is true on the first two: `f32::mul_add` is one instruction there, a libm call on the
/// baseline.
macro_rules! multiversion {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        pub mod $name {
            use super::*;
            #[target_feature(enable = "avx512f,fma")]
            unsafe fn avx512($($arg: $ty),*) -> $ret {
                $body::<true>($($arg),*)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret {
                $body::<true>($($arg),*)
            }
            fn generic($($arg: $ty),*) -> $ret {
                $body::<false>($($arg),*)
            }
            pub fn call($($arg: $ty),*) -> $ret {
                match $crate::simd::level() {
                    // SAFETY: level() reported the CPU supports the enabled features.
                    $crate::simd::Level::Avx512 => unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::simd::Level::Avx2 => unsafe { avx2($($arg),*) },
                    $crate::simd::Level::Generic => generic($($arg),*),
                }
            }
        }
    };
}

pub(crate) use multiversion;
