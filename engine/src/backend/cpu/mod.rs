//! The CPU backend: kernels over raw arena memory, multi-threaded with rayon, matmuls by the
//! `gemm` crate (which picks AVX2/AVX-512/FMA paths at run time from CPU features) or, in the
//! bf16 matmul mode, by `bf16` (avx512_bf16 or AMX, also chosen at run time).

mod activation;
mod attention;
mod attention_f32;
mod batchnorm;
pub mod bf16;
mod broadcast;
mod conv;
mod cumsum;
mod elementwise;
mod gather_nd;
mod in_place;
mod internal;
mod lce_stream;
mod lce_tiles;
mod linear;
mod linear_cross_entropy;
mod loss;
mod matmul;
mod movement;
mod norm;
mod pool;
mod random;
mod random_draws;
mod reduce;
mod rms_norm;
mod shape_ops;
mod softmax;
pub mod tensor_view;
mod vmath;
pub mod widen;

use std::collections::HashMap;
use std::sync::OnceLock;

pub use in_place::{add_in_place_first, add_in_place_second, gather_grad_accumulate, mul_scalar_in_place, sum_already_in_place};
pub use matmul::on_this_thread;
pub use tensor_view::{In, Out};

use crate::error::Result;
use crate::ir::Node;

/// Per-run state a kernel may use: the random stream for dropout-like ops, and how matmuls
/// multiply (fp32, or bf16 products with f32 accumulation).
pub struct CpuCtx {
    pub rng: random::Rng,
    pub matmul: bf16::MatmulPath,
}

impl CpuCtx {
    pub fn new(seed: u64) -> Self {
        CpuCtx { rng: random::Rng::new(seed), matmul: bf16::MatmulPath::Fp32 }
    }

    pub fn with_matmul(self, matmul: bf16::MatmulPath) -> Self {
        CpuCtx { matmul, ..self }
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
        attention::register(&mut t);
        batchnorm::register(&mut t);
        conv::register(&mut t);
        cumsum::register(&mut t);
        elementwise::register(&mut t);
        gather_nd::register(&mut t);
        internal::register(&mut t);
        linear::register(&mut t);
        loss::register(&mut t);
        linear_cross_entropy::register(&mut t);
        matmul::register(&mut t);
        movement::register(&mut t);
        norm::register(&mut t);
        pool::register(&mut t);
        random::register(&mut t);
        random_draws::register(&mut t);
        reduce::register(&mut t);
        rms_norm::register(&mut t);
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

/// Runs one op on host tensors (types from the op's shape rule, like plan-time folding): for
/// kernel unit tests.
#[cfg(test)]
pub(crate) mod testutil {
    use super::{kernel, CpuCtx, In, Out};
    use crate::error::Result;
    use crate::ir::{Attrs, Node};
    use crate::ops::{self, InferIn};
    use crate::tensor::Tensor;

    pub fn try_run(op: &str, attrs: Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        try_run_ctx(op, attrs, inputs, &mut CpuCtx::new(0))
    }

    pub fn try_run_ctx(op: &str, attrs: Attrs, inputs: &[&Tensor], ctx: &mut CpuCtx) -> Result<Vec<Tensor>> {
        let inputs: Vec<Option<&Tensor>> = inputs.iter().map(|t| Some(*t)).collect();
        try_run_opt(op, attrs, &inputs, ctx)
    }

    /// As `try_run_ctx`, with optional inputs (None: an absent input, as in the graph).
    pub fn try_run_opt(op: &str, attrs: Attrs, inputs: &[Option<&Tensor>], ctx: &mut CpuCtx) -> Result<Vec<Tensor>> {
        let def = ops::lookup(op).expect("registered op");
        let probe = Node { name: "t".into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs: attrs.clone() };
        let ins: Vec<Option<InferIn>> =
            inputs.iter().map(|t| t.map(|t| InferIn { dtype: t.dtype(), shape: &t.shape, value: Some(t) })).collect();
        let types = def.infer(&probe, &ins)?;
        let node = Node {
            name: "t".into(),
            op_type: op.into(),
            inputs: vec![None; inputs.len()],
            outputs: (0..types.len()).map(crate::ir::ValueId).collect(),
            attrs,
        };
        let mut results: Vec<Tensor> = types.iter().map(|t| Tensor::zeros(t.dtype, t.shape.clone())).collect();
        let views: Vec<Option<In>> = inputs.iter().map(|t| t.map(In::of)).collect();
        let shapes: Vec<Vec<usize>> = results.iter().map(|t| t.shape.clone()).collect();
        let mut outs: Vec<Out> = results
            .iter_mut()
            .zip(&shapes)
            .map(|(t, s)| {
                let d = t.dtype();
                // SAFETY: each tensor is uniquely borrowed and holds numel(s) elements of d.
                unsafe { Out::from_raw(d, s, t.as_bytes_mut().as_mut_ptr()) }
            })
            .collect();
        super::widen::call(kernel(op).expect("kernel"), &node, &views, &mut outs, ctx)?;
        drop(outs);
        Ok(results)
    }

    pub fn run(op: &str, attrs: Attrs, inputs: &[&Tensor]) -> Vec<Tensor> {
        try_run(op, attrs, inputs).unwrap_or_else(|e| panic!("{op}: {e}"))
    }

    /// Deterministic values in [-1, 1) with full f32 mantissas (so rounding matters): xorshift64
    /// from `seed`.
    pub fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }
}
