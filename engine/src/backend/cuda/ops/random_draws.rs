//! RandomUniform(Like), RandomNormal(Like) and Bernoulli (ops/random_draws.rs) on the GPU:
//! kernels/dropout.cu's `random_uniform_T`, `random_normal_T`, `bernoulli_T`, from the Philox
//! stream Dropout draws from, keyed as Dropout is (the step's seed and the node's name, so the
//! model's own graph and the fused loss's graph draw the same numbers; in a recorded step the
//! seed is read from device memory). The `seed` attribute is mixed into the node's salt.

use super::random::{random_key, salt_of};
use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;
use crate::ops::random_draws::{law, seed_mix, Law, DRAW_OPS};
use crate::tensor::DType;

fn draw(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let law = law(node)?;
    let o = &outs[0];
    let n = o.numel();
    let t = float_suffix(node, o.dtype)?;
    if n == 0 {
        return Ok(());
    }
    let salt = salt_of(node) ^ seed_mix(node)?;
    // (the seed's device address or null, the key or, with a seed address, the salt)
    let (seed, key) = if ctx.seed_slot != 0 { (ctx.seed_slot, salt) } else { (0, random_key(ctx.seed, salt)) };
    let (name, mut args, groups) = match law {
        Law::Uniform { low, high } => {
            let per = if o.dtype == DType::F64 { 2 } else { 4 };
            (format!("random_uniform_{t}"), vec![KArg::Ptr(o.ptr), KArg::I64(n as i64), KArg::F64(low), KArg::F64(high)], n.div_ceil(per))
        }
        Law::Normal { mean, scale } => {
            (format!("random_normal_{t}"), vec![KArg::Ptr(o.ptr), KArg::I64(n as i64), KArg::F64(mean), KArg::F64(scale)], n.div_ceil(4))
        }
        Law::Bernoulli => {
            let p = input(node, ins, 0)?;
            if p.dtype != o.dtype || p.shape != o.shape {
                return Err(node.err(format!(
                    "Bernoulli of {} probabilities into {}: the types must match",
                    p.dtype.name(),
                    o.dtype.name()
                )));
            }
            (format!("bernoulli_{t}"), vec![KArg::Ptr(p.ptr), KArg::Ptr(o.ptr), KArg::I64(n as i64)], n.div_ceil(4))
        }
    };
    args.extend([KArg::Ptr(seed), KArg::U64(key)]);
    ctx.rt.launch(ctx.stream, &name, ctx.rt.elementwise_grid(groups), &args)
}

pub fn register(t: &mut CudaTable) {
    for op in DRAW_OPS {
        t.add(op, draw);
    }
}
