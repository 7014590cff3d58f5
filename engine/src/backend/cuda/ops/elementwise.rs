//! Element-wise ops (kernels/elementwise.cu): binary arithmetic and comparisons broadcast
//! through `Strides`, unary math on contiguous data, Where.

use super::strides::{broadcast, make};
use super::{input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::backend::cuda::registry::dtype_suffix;
use crate::error::Result;
use crate::ir::Node;

fn binary_kernel(op: &str) -> Option<&'static str> {
    Some(match op {
        "Add" => "add",
        "Sub" => "sub",
        "Mul" => "mul",
        "Div" => "div",
        "Pow" => "pow",
        "Max" => "max",
        "Min" => "min",
        "Equal" => "equal",
        "Less" => "less",
        "Greater" => "greater",
        "LessOrEqual" => "less_equal",
        "GreaterOrEqual" => "greater_equal",
        "And" => "and",
        "Or" => "or",
        "Xor" => "xor",
        _ => return None,
    })
}

fn binary(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b) = (input(node, ins, 0)?, input(node, ins, 1)?);
    if node.op_type == "Mod" || (ins.len() > 2 && matches!(node.op_type.as_str(), "Max" | "Min")) {
        return Err(node.err("not supported by the CUDA backend yet (Mod; Max/Min of more than two inputs)"));
    }
    let stem = binary_kernel(&node.op_type).ok_or_else(|| node.err("no CUDA binary kernel"))?;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let err = |e: crate::error::Error| node.err(e.to_string());
    let s = make(o.shape, &[broadcast(a.shape, o.shape).map_err(err)?, broadcast(b.shape, o.shape).map_err(err)?], &[])?;
    let kernel = format!("{stem}_{}", dtype_suffix(a.dtype));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(a.ptr), KArg::Ptr(b.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)])
}

fn unary(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let stem = match node.op_type.as_str() {
        "Sqrt" => "sqrt",
        "Exp" => "exp",
        "Log" => "log",
        "Sin" => "sin",
        "Cos" => "cos",
        "Erf" => "erf",
        "Reciprocal" => "reciprocal",
        "Floor" => "floor",
        "Ceil" => "ceil",
        "Neg" => "neg",
        "Abs" => "abs",
        "Sign" => "sign",
        "Not" => "not",
        _ => return Err(node.err("no CUDA unary kernel")),
    };
    let n = x.numel();
    let kernel = format!("{stem}_{}", dtype_suffix(x.dtype));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64)])
}

fn where_op(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (c, a, b) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?);
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let err = |e: crate::error::Error| node.err(e.to_string());
    let s = make(
        o.shape,
        &[broadcast(c.shape, o.shape).map_err(err)?, broadcast(a.shape, o.shape).map_err(err)?, broadcast(b.shape, o.shape).map_err(err)?],
        &[],
    )?;
    let width = super::movement::width(a.dtype.size());
    ctx.rt.launch(
        ctx.stream,
        &format!("where_{width}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(c.ptr), KArg::Ptr(a.ptr), KArg::Ptr(b.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)],
    )
}

pub fn register(t: &mut CudaTable) {
    for op in ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"] {
        t.add(op, binary);
    }
    for op in ["Sqrt", "Exp", "Log", "Sin", "Cos", "Erf", "Reciprocal", "Floor", "Ceil", "Neg", "Abs", "Sign", "Not"] {
        t.add(op, unary);
    }
    t.add("Where", where_op);
}
