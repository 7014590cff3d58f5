//! The vector instruction level of this CPU, detected once at run time. Kernels with SIMD paths
//! (backend/cpu/vmath.rs, optim/adam.rs) compile their loops for each level and pick by it;
//! nothing is built for the build machine's CPU.

use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Level {
    /// AVX-512F.
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
            if is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Generic
    })
}
