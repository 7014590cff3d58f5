//! The CPU backend: kernels over raw arena memory, multi-threaded with rayon, matmuls by the
//! `gemm` crate (which picks AVX2/AVX-512/FMA paths at run time from CPU features).

mod activation;
mod broadcast;
mod elementwise;
mod internal;
mod loss;
mod matmul;
mod movement;
mod norm;
mod random;
mod reduce;
mod shape_ops;
mod softmax;
pub mod tensor_view;

use std::collections::HashMap;
use std::sync::OnceLock;

pub use tensor_view::{In, Out};

use crate::error::Result;
use crate::ir::Node;

/// Per-run state a kernel may use: the random stream for dropout-like ops.
pub struct CpuCtx {
    pub rng: random::Rng,
}

impl CpuCtx {
    pub fn new(seed: u64) -> Self {
        CpuCtx { rng: random::Rng::new(seed) }
    }
}

pub type Kernel = fn(&Node, &[Option<In>], &mut [Out], &mut CpuCtx) -> Result<()>;

pub struct KernelTable(HashMap<&'static str, Kernel>);

impl KernelTable {
    pub fn add(&mut self, op: &'static str, k: Kernel) {
        self.0.insert(op, k);
    }
}

pub fn kernels() -> &'static KernelTable {
    static T: OnceLock<KernelTable> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = KernelTable(HashMap::new());
        activation::register(&mut t);
        elementwise::register(&mut t);
        internal::register(&mut t);
        loss::register(&mut t);
        matmul::register(&mut t);
        movement::register(&mut t);
        norm::register(&mut t);
        random::register(&mut t);
        reduce::register(&mut t);
        shape_ops::register(&mut t);
        softmax::register(&mut t);
        t
    })
}

pub fn kernel(op_type: &str) -> Option<Kernel> {
    kernels().0.get(op_type).copied()
}

pub struct CpuBackend;

impl super::Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn missing_kernels<'a>(&self, op_types: &[&'a str]) -> Vec<&'a str> {
        op_types.iter().copied().filter(|o| kernel(o).is_none()).collect()
    }
}

/// Below this many elements a kernel runs on one thread (rayon's overhead would dominate).
pub const PAR_MIN: usize = 1 << 15;
