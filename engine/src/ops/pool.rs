//! Pools over [N, C, D1..Dk] (1-D and 2-D windows): MaxPool-12 (kernel_shape, strides, pads,
//! auto_pad, ceil_mode, dilations; outputs Y and Indices, flat row-major indices into X, padding
//! never chosen), AveragePool-19 (count_include_pad) and GlobalAveragePool, with their internal
//! gradients MaxPoolGrad(dy, indices, x_shape) (scatter-add at the saved indices),
//! AveragePoolGrad(dy, x_shape) and GlobalAveragePoolGrad(dy, x_shape).
//!
//! The importer always materialises MaxPool's Indices output (as it does Dropout's mask), so the
//! gradient needs neither X nor a recomputation.

use super::util::{const_ints, input};
use super::window::{resolve, Window};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// The window of a pool node over input shape `x` ([N, C, D...]).
pub fn pool_geometry(node: &Node, x: &[usize]) -> Result<Window> {
    if x.len() < 3 || x.len() > 4 {
        return Err(node.err(format!("input {x:?} must be [N, C, D1] or [N, C, D1, D2] (other ranks are not supported yet)")));
    }
    if node.attrs.int("storage_order", 0).map_err(|e| node.err(e.to_string()))? != 0 {
        return Err(node.err("storage_order 1 (column-major indices) is not supported"));
    }
    resolve(node, &x[2..], None, true)
}

fn pool_attrs(node: &Node) -> crate::ir::Attrs {
    let mut attrs = node.attrs.clone();
    attrs.0.retain(|(k, _)| {
        matches!(k.as_str(), "kernel_shape" | "strides" | "pads" | "auto_pad" | "dilations" | "ceil_mode" | "count_include_pad")
    });
    attrs
}

fn float_input<'a>(node: &Node, inputs: &'a [Option<InferIn<'a>>]) -> Result<&'a InferIn<'a>> {
    let x = input(node, inputs, 0)?;
    if !x.dtype.is_float() {
        return Err(node.err(format!("input must be float32 or float64, got {}", x.dtype.name())));
    }
    Ok(x)
}

struct MaxPool;
impl OpDef for MaxPool {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = float_input(node, inputs)?;
        let win = pool_geometry(node, x.shape)?;
        let mut out = x.shape[..2].to_vec();
        out.extend_from_slice(&win.output);
        Ok(vec![TypeOut::new(x.dtype, out.clone()), TypeOut::new(DType::I64, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            if node.outputs.len() < 2 {
                return Err(node.err("the gradient needs the Indices output"));
            }
            let x = g.x(0)?;
            let s = g.shape_of(x);
            let idx = g.y(1);
            let d = g.op("MaxPoolGrad", &[dy, idx, s], Default::default());
            g.set(0, d);
            Ok(())
        })
    }
}

struct AveragePool;
impl OpDef for AveragePool {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = float_input(node, inputs)?;
        let win = pool_geometry(node, x.shape)?;
        let mut out = x.shape[..2].to_vec();
        out.extend_from_slice(&win.output);
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let x = g.x(0)?;
            let s = g.shape_of(x);
            let d = g.op("AveragePoolGrad", &[dy, s], pool_attrs(node));
            g.set(0, d);
            Ok(())
        })
    }
}

struct GlobalAveragePool;
impl OpDef for GlobalAveragePool {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = float_input(node, inputs)?;
        if x.shape.len() < 2 {
            return Err(node.err(format!("input {:?} must be [N, C, ...]", x.shape)));
        }
        let mut out = x.shape.to_vec();
        out[2..].iter_mut().for_each(|d| *d = 1);
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|_, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let x = g.x(0)?;
            let s = g.shape_of(x);
            let d = g.op("GlobalAveragePoolGrad", &[dy, s], Default::default());
            g.set(0, d);
            Ok(())
        })
    }
}

/// Pool gradients: shaped by the x_shape input (`shape_at`), after checking dy against it.
struct PoolGrad {
    shape_at: usize,
}
impl OpDef for PoolGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let s: Vec<usize> = const_ints(node, &inputs[self.shape_at], "shape")?.into_iter().map(|d| d.max(0) as usize).collect();
        if s.len() != dy.shape.len() || s.len() < 2 || s[..2] != dy.shape[..2] {
            return Err(node.err(format!("dy {:?} does not fit the input shape {s:?}", dy.shape)));
        }
        if node.op_type == "AveragePoolGrad" {
            let win = pool_geometry(node, &s)?;
            if win.output != dy.shape[2..] {
                return Err(node.err(format!("dy {:?} does not match the pool's output {:?}", dy.shape, win.output)));
            }
        }
        if node.op_type == "MaxPoolGrad" {
            let idx = input(node, inputs, 1)?;
            if idx.shape != dy.shape || idx.dtype != DType::I64 {
                return Err(node.err(format!(
                    "indices {:?} ({}) must be int64 shaped like dy {:?}",
                    idx.shape,
                    idx.dtype.name(),
                    dy.shape
                )));
            }
        }
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("MaxPool", MaxPool);
    r.add("AveragePool", AveragePool);
    r.add("GlobalAveragePool", GlobalAveragePool);
    r.internal("MaxPoolGrad", PoolGrad { shape_at: 2 });
    r.internal("AveragePoolGrad", PoolGrad { shape_at: 1 });
    r.internal("GlobalAveragePoolGrad", PoolGrad { shape_at: 1 });
}
