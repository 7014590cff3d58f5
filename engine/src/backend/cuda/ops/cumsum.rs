//! CumSum (kernels/scan.cu) with the semantics of backend/cpu/cumsum.rs: the axis input
//! (a constant), `exclusive` and `reverse`; x viewed as [outer, len, inner] around the axis,
//! one thread per (outer, inner) column.

use super::{input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::backend::cuda::registry::dtype_suffix;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

fn cumsum(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let axis_in = super::infer_ins(node, ins, 1..2, "axis")?;
    let axis = crate::ops::cumsum_axis_of(node, &axis_in[0], x.shape.len())?;
    // 16-bit floats accumulate in f32 (kernels/scan.cu), as the CPU's widened run does
    if !matches!(x.dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::I64 | DType::I32) {
        return Err(node.err(format!("CumSum on CUDA takes f32, f64, bf16, f16, int64 or int32, got {}", x.dtype.name())));
    }
    let sfx = dtype_suffix(x.dtype);
    let len = x.shape.get(axis).copied().unwrap_or(1);
    let inner: usize = x.shape.get(axis + 1..).map(|s| s.iter().product()).unwrap_or(1);
    let outer: usize = x.shape[..axis.min(x.shape.len())].iter().product();
    let columns = outer * inner;
    if columns == 0 || len == 0 {
        return Ok(());
    }
    let flag = |name: &str| -> Result<KArg> { Ok(KArg::I32((node.attrs.int(name, 0)? != 0) as i32)) };
    let i = |v: usize| KArg::I64(v as i64);
    let args = [KArg::Ptr(x.ptr), KArg::Ptr(outs[0].ptr), i(outer), i(len), i(inner), flag("exclusive")?, flag("reverse")?];
    ctx.rt.launch(ctx.stream, &format!("cumsum_{sfx}"), ctx.rt.elementwise_grid(columns), &args)
}

pub fn register(t: &mut CudaTable) {
    t.add("CumSum", cumsum);
}
