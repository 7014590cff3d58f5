//! Element-wise ops (kernels/elementwise.cu): binary arithmetic and comparisons broadcast
//! through `Strides` (Mod as `mod` or `fmod` by its attribute), unary math on contiguous data,
//! IsNaN/IsInf, Cast/CastLike (`cast_S_D`, bool destinations included), Where, and the internal
//! ops gradient rules emit: MinMaxGrad, ErfGrad, MaskSelect, Affine. Attributes and defaults
//! are the CPU kernels' (backend/cpu/elementwise.rs, internal.rs).

use super::strides::{broadcast, make};
use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::abi::Strides;
use crate::backend::cuda::launch::KArg;
use crate::backend::cuda::registry::dtype_suffix;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// The kernel stem of a binary op (Mod: `fmod` when its `fmod` attribute is set, as the CPU
/// kernel reads it).
fn binary_kernel(node: &Node) -> Result<Option<&'static str>> {
    if node.op_type == "Mod" {
        return Ok(Some(if node.attrs.int("fmod", 0)? != 0 { "fmod" } else { "mod" }));
    }
    Ok(Some(match node.op_type.as_str() {
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
        _ => return Ok(None),
    }))
}

/// The `Strides` of an output of shape `out` over operands broadcast to it (numpy rules).
fn broadcast_layout(node: &Node, out: &[usize], operands: &[&[usize]]) -> Result<Strides> {
    let strides = operands.iter().map(|o| broadcast(o, out).map_err(|e| node.err(e.to_string()))).collect::<Result<Vec<_>>>()?;
    make(out, &strides, &[])
}

fn binary(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (a, b) = (input(node, ins, 0)?, input(node, ins, 1)?);
    if ins.len() > 2 && matches!(node.op_type.as_str(), "Max" | "Min") {
        return Err(node.err(format!("{} of {} inputs is not supported (2 only, as on the CPU)", node.op_type, ins.len())));
    }
    if node.op_type == "Mod" && a.dtype == DType::Bool {
        return Err(node.err("Mod of bool is not supported (ONNX's Mod takes numbers)"));
    }
    let stem = binary_kernel(node)?.ok_or_else(|| node.err("no CUDA binary kernel"))?;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = broadcast_layout(node, o.shape, &[a.shape, b.shape])?;
    let kernel = format!("{stem}_{}", dtype_suffix(a.dtype));
    let b_ptr = if b.dtype == a.dtype { b.ptr } else { exponent_as(node, b, a.dtype, ctx)? };
    ctx.rt.launch(
        ctx.stream,
        &kernel,
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(a.ptr), KArg::Ptr(b_ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)],
    )
}

/// Pow's exponent of another type than the base (x ** 2 with an int64 2, as the exporters
/// write it; the only binary op whose operand types may differ): cast to the base's type in
/// the runtime's scratch, since `pow_T` reads both operands as T (the CPU kernel converts).
fn exponent_as(node: &Node, b: &DView, to: DType, ctx: &mut CudaCtx) -> Result<u64> {
    if node.op_type != "Pow" {
        return Err(node.err(format!("operands have different element types ({} and {})", to.name(), b.dtype.name())));
    }
    let n = b.numel();
    let at = ctx.rt.scratch((n * to.size()).max(1))?;
    if n > 0 {
        let args = [KArg::Ptr(b.ptr), KArg::Ptr(at), KArg::I64(n as i64)];
        ctx.rt.launch(ctx.stream, &cast_kernel(b.dtype, to), ctx.rt.elementwise_grid(n), &args)?;
    }
    Ok(at)
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
    if n == 0 {
        return Ok(());
    }
    let kernel = format!("{stem}_{}", dtype_suffix(x.dtype));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64)])
}

/// IsNaN(x) and IsInf(x) (detect_positive, detect_negative: 1 by default): bool outputs.
fn is_nan_inf(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let sfx = float_suffix(node, x.dtype)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let (grid, xp, yp) = (ctx.rt.elementwise_grid(n), KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr));
    if node.op_type == "IsNaN" {
        return ctx.rt.launch(ctx.stream, &format!("is_nan_{sfx}"), grid, &[xp, yp, KArg::I64(n as i64)]);
    }
    // the CPU kernel reads a malformed attribute as its default
    let pos = node.attrs.int("detect_positive", 1).unwrap_or(1) != 0;
    let neg = node.attrs.int("detect_negative", 1).unwrap_or(1) != 0;
    ctx.rt.launch(ctx.stream, &format!("is_inf_{sfx}"), grid, &[xp, yp, KArg::I64(n as i64), KArg::I32(pos as i32), KArg::I32(neg as i32)])
}

/// The cast kernel from `from` to `to`: sources by storage type (bool data is u8), bool
/// destinations write 0/1 (`x != 0`, NaN → 1), as the CPU kernel does.
pub(super) fn cast_kernel(from: DType, to: DType) -> String {
    let dst = if to == DType::Bool { "bool" } else { dtype_suffix(to) };
    format!("cast_{}_{dst}", dtype_suffix(from))
}

/// Cast(x; to) and CastLike(x, like): the output's planned type is the destination; the same
/// type is a plain copy (as on the CPU).
fn cast(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let o = &outs[0];
    if x.dtype == o.dtype {
        return super::movement::view_copy(node, ins, outs, ctx);
    }
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let kernel = cast_kernel(x.dtype, o.dtype);
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &[KArg::Ptr(x.ptr), KArg::Ptr(o.ptr), KArg::I64(n as i64)])
}

/// MinMaxGrad(dy, a, b; is_max = 1, which = 0): dy where input `which` won, dy/2 on ties.
fn min_max_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, a, b) = (input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?);
    let is_max = node.attrs.int("is_max", 1)? != 0;
    // as on the CPU: 0 picks a, anything else b
    let which = node.attrs.int("which", 0)? != 0;
    let sfx = float_suffix(node, dy.dtype)?;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = broadcast_layout(node, o.shape, &[dy.shape, a.shape, b.shape])?;
    ctx.rt.launch(
        ctx.stream,
        &format!("min_max_grad_{sfx}"),
        ctx.rt.elementwise_grid(n),
        &[
            KArg::Ptr(dy.ptr),
            KArg::Ptr(a.ptr),
            KArg::Ptr(b.ptr),
            KArg::Ptr(o.ptr),
            KArg::Strides(s),
            KArg::I64(n as i64),
            KArg::I32(is_max as i32),
            KArg::I32(which as i32),
        ],
    )
}

/// ErfGrad(dy, x) = dy · 2/√π · exp(-x²).
fn erf_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, x) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let sfx = float_suffix(node, dy.dtype)?;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = broadcast_layout(node, o.shape, &[dy.shape, x.shape])?;
    ctx.rt.launch(
        ctx.stream,
        &format!("erf_grad_{sfx}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(dy.ptr), KArg::Ptr(x.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)],
    )
}

/// MaskSelect(c, x; keep = 1): x where (c != 0) == keep, else 0.
fn mask_select(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (c, x) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let keep = node.attrs.int("keep", 1)? != 0;
    let o = &outs[0];
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = broadcast_layout(node, o.shape, &[c.shape, x.shape])?;
    let width = super::movement::width(x.dtype.size());
    ctx.rt.launch(
        ctx.stream,
        &format!("mask_select_{width}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(c.ptr), KArg::Ptr(x.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64), KArg::I32(keep as i32)],
    )
}

/// Affine(x; alpha = 1, beta = 0) = alpha · x + beta, in x's (float) type.
fn affine(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let alpha = node.attrs.float("alpha", 1.0)? as f64;
    let beta = node.attrs.float("beta", 0.0)? as f64;
    let sfx = float_suffix(node, x.dtype)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    ctx.rt.launch(
        ctx.stream,
        &format!("affine_{sfx}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64), KArg::F64(alpha), KArg::F64(beta)],
    )
}

fn where_op(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    where_into(node, input(node, ins, 0)?, input(node, ins, 1)?, input(node, ins, 2)?, &outs[0], ctx)
}

/// o = Where(c, a, b), broadcasting (also for dispatchers that make a tensor this way).
pub fn where_into(node: &Node, c: &DView, a: &DView, b: &DView, o: &DView, ctx: &mut CudaCtx) -> Result<()> {
    let n = o.numel();
    if n == 0 {
        return Ok(());
    }
    let s = broadcast_layout(node, o.shape, &[c.shape, a.shape, b.shape])?;
    let width = super::movement::width(a.dtype.size());
    ctx.rt.launch(
        ctx.stream,
        &format!("where_{width}"),
        ctx.rt.elementwise_grid(n),
        &[KArg::Ptr(c.ptr), KArg::Ptr(a.ptr), KArg::Ptr(b.ptr), KArg::Ptr(o.ptr), KArg::Strides(s), KArg::I64(n as i64)],
    )
}

pub fn register(t: &mut CudaTable) {
    for op in [
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Mod",
        "Max",
        "Min",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "And",
        "Or",
        "Xor",
    ] {
        t.add(op, binary);
    }
    for op in ["Sqrt", "Exp", "Log", "Sin", "Cos", "Erf", "Reciprocal", "Floor", "Ceil", "Neg", "Abs", "Sign", "Not"] {
        t.add(op, unary);
    }
    t.add("Where", where_op);
    t.add("IsNaN", is_nan_inf);
    t.add("IsInf", is_nan_inf);
    t.add("Cast", cast);
    t.add("CastLike", cast);
    t.add("MinMaxGrad", min_max_grad);
    t.add("ErfGrad", erf_grad);
    t.add("MaskSelect", mask_select);
    t.add("Affine", affine);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::registry;
    use crate::ir::{Attr, Attrs};

    const ALL: [DType; 7] = [DType::F32, DType::F64, DType::I64, DType::I32, DType::Bool, DType::U8, DType::I8];

    fn node(op: &str, attrs: Attrs) -> Node {
        Node { name: "t".into(), op_type: op.into(), inputs: vec![], outputs: vec![], attrs }
    }

    #[test]
    fn every_engine_cast_has_a_kernel() {
        for from in ALL {
            for to in ALL {
                let k = cast_kernel(from, to);
                assert!(registry::signature(&k).is_some(), "{} -> {}: no kernel {k}", from.name(), to.name());
            }
        }
        assert_eq!(cast_kernel(DType::F32, DType::Bool), "cast_f32_bool");
        assert_eq!(cast_kernel(DType::Bool, DType::F32), "cast_u8_f32");
        assert_eq!(cast_kernel(DType::Bool, DType::U8), "cast_u8_u8");
    }

    #[test]
    fn mod_follows_its_fmod_attribute_and_every_binary_kernel_exists() {
        let m = |f: Option<i64>| {
            let attrs = f.map_or_else(Attrs::default, |f| Attrs::default().with("fmod", Attr::Int(f)));
            binary_kernel(&node("Mod", attrs)).unwrap().unwrap()
        };
        assert_eq!((m(None), m(Some(0)), m(Some(1))), ("mod", "mod", "fmod"));
        for op in ["Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"] {
            let stem = binary_kernel(&node(op, Attrs::default())).unwrap().unwrap();
            for t in [DType::F32, DType::F64, DType::I64] {
                let k = format!("{stem}_{}", dtype_suffix(t));
                assert!(registry::signature(&k).is_some(), "{op} of {}: no kernel {k}", t.name());
            }
        }
        assert!(binary_kernel(&node("Relu", Attrs::default())).unwrap().is_none());
    }

    #[test]
    fn broadcast_layouts_of_the_gradient_helpers() {
        // MinMaxGrad(dy [2, 3], a [2, 3], b [] ): b is read with stride 0, the rest merges to one dimension
        let s = broadcast_layout(&node("MinMaxGrad", Attrs::default()), &[2, 3], &[&[2, 3], &[2, 3], &[]]).unwrap();
        assert_eq!((s.rank, s.dims[0], s.stride[0][0], s.stride[1][0], s.stride[2][0]), (1, 6, 1, 1, 0));
        // MaskSelect(c [3, 1], x [3, 4])
        let s = broadcast_layout(&node("MaskSelect", Attrs::default()), &[3, 4], &[&[3, 1], &[3, 4]]).unwrap();
        assert_eq!((s.rank, &s.stride[0][..2], &s.stride[1][..2]), (2, &[1i64, 0][..], &[4i64, 1][..]));
        let e = broadcast_layout(&node("ErfGrad", Attrs::default()), &[3, 4], &[&[3, 4], &[5]]).unwrap_err();
        assert!(e.to_string().contains("ErfGrad"), "{e}");
    }
}
