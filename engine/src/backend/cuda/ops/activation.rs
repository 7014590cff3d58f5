//! Activations and their gradients (kernels/activation.cu): one contiguous launch each, with
//! the parameters the CPU kernels read (LeakyRelu's alpha 0.01, HardSigmoid's 0.2 and 0.5,
//! Gelu's `approximate`).

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::Result;
use crate::ir::Node;

/// (kernel stem, alpha, beta) for an activation or its gradient op.
fn stem(node: &Node) -> Result<(String, f32, f32)> {
    let op = node.op_type.as_str();
    let base = op.strip_suffix("Grad").unwrap_or(op);
    let alpha = node.attrs.float("alpha", if base == "HardSigmoid" { 0.2 } else { 0.01 })?;
    let beta = node.attrs.float("beta", 0.5)?;
    let tanh = node.attrs.string("approximate", "none")? == "tanh";
    let name = match base {
        "Relu" => "relu",
        "LeakyRelu" => "leaky_relu",
        "Tanh" => "tanh",
        "Sigmoid" => "sigmoid",
        "Gelu" if tanh => "gelu_tanh",
        "Gelu" => "gelu",
        "Softplus" => "softplus",
        "HardSigmoid" => "hard_sigmoid",
        "HardSwish" => "hard_swish",
        other => return Err(node.err(format!("no CUDA activation kernel for {other}"))),
    };
    Ok((if op.ends_with("Grad") { format!("{name}_grad") } else { name.to_string() }, alpha, beta))
}

fn forward(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let (name, alpha, beta) = stem(node)?;
    let kernel = format!("{name}_{}", float_suffix(node, x.dtype)?);
    let n = x.numel();
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64), KArg::F32(alpha), KArg::F32(beta)],
    )
}

/// XGrad(dy, s): s is the forward output or input, as ops/activation.rs chose.
fn gradient(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, s) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let (name, alpha, beta) = stem(node)?;
    let kernel = format!("{name}_{}", float_suffix(node, dy.dtype)?);
    let n = dy.numel();
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(dy.ptr), KArg::Ptr(s.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64), KArg::F32(alpha), KArg::F32(beta)],
    )
}

pub fn register(t: &mut CudaTable) {
    for op in ["Relu", "LeakyRelu", "Tanh", "Sigmoid", "Gelu", "Softplus", "HardSigmoid", "HardSwish"] {
        t.add(op, forward);
    }
    for op in ["ReluGrad", "LeakyReluGrad", "TanhGrad", "SigmoidGrad", "GeluGrad", "SoftplusGrad", "HardSigmoidGrad", "HardSwishGrad"] {
        t.add(op, gradient);
    }
}
