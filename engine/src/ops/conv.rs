//! Conv (opset 11: X [N, C, D1..Dk], W [M, C/group, k1..kk], optional B [M]; group, strides,
//! pads, auto_pad, dilations) for 1-D and 2-D windows, and its internal gradients, one op per
//! input so that a rule emits only what is wanted:
//! ConvGradX(dy, w, x_shape) -> dx, ConvGradW(dy, x, w_shape) -> dw, ConvGradB(dy) -> db
//! (the sum of dy over every axis but the channel axis 1).

use super::util::{const_ints, input};
use super::window::{resolve, Window};
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attrs, Node};

/// (group, window) of a Conv node for input shape `x` and weight shape `w`, after checking that
/// they fit together.
pub fn conv_geometry(node: &Node, x: &[usize], w: &[usize]) -> Result<(usize, Window)> {
    if x.len() < 3 || x.len() != w.len() {
        return Err(node.err(format!("input {x:?} and weight {w:?} must be [N, C, D...] and [M, C/group, k...] of the same rank")));
    }
    if x.len() > 4 {
        return Err(node.err(format!("{}-D convolutions are not supported yet (1-D and 2-D are)", x.len() - 2)));
    }
    let group = node.attrs.int("group", 1).map_err(|e| node.err(e.to_string()))?;
    if group < 1 {
        return Err(node.err(format!("group {group} must be positive")));
    }
    let group = group as usize;
    let (c, m) = (x[1], w[0]);
    if c % group != 0 || m % group != 0 || w[1] * group != c {
        return Err(node.err(format!("input channels {c}, output channels {m} and weight {w:?} do not fit group {group}")));
    }
    let win = resolve(node, &x[2..], Some(&w[2..]), false)?;
    Ok((group, win))
}

struct Conv;
impl OpDef for Conv {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let w = input(node, inputs, 1)?;
        if !x.dtype.is_float() || w.dtype != x.dtype {
            return Err(node.err(format!("X and W must be float tensors of one type, got {} and {}", x.dtype.name(), w.dtype.name())));
        }
        let (_, win) = conv_geometry(node, x.shape, w.shape)?;
        if let Some(Some(b)) = inputs.get(2) {
            if b.shape != [w.shape[0]] || b.dtype != x.dtype {
                return Err(node.err(format!("bias {:?} must be [{}]", b.shape, w.shape[0])));
            }
        }
        let mut out = vec![x.shape[0], w.shape[0]];
        out.extend_from_slice(&win.output);
        Ok(vec![TypeOut::new(x.dtype, out)])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            let (x, w) = (g.x(0)?, g.x(1)?);
            let mut attrs = node.attrs.clone();
            attrs.0.retain(|(k, _)| matches!(k.as_str(), "group" | "strides" | "pads" | "auto_pad" | "dilations" | "kernel_shape"));
            if g.wants(0) {
                let s = g.shape_of(x);
                let dx = g.op("ConvGradX", &[dy, w, s], attrs.clone());
                g.set(0, dx);
            }
            if g.wants(1) {
                let s = g.shape_of(w);
                let dw = g.op("ConvGradW", &[dy, x, s], attrs.clone());
                g.set(1, dw);
            }
            if g.wants(2) {
                let db = g.op("ConvGradB", &[dy], Attrs::default());
                g.set(2, db);
            }
            Ok(())
        })
    }
}

/// ConvGradX(dy, w, x_shape) and ConvGradW(dy, x, w_shape): shaped by input 2.
struct ConvGradShaped;
impl OpDef for ConvGradShaped {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        let other = input(node, inputs, 1)?;
        let s: Vec<usize> = const_ints(node, &inputs[2], "shape")?.into_iter().map(|d| d.max(0) as usize).collect();
        let (x, w) = if node.op_type == "ConvGradX" { (s.as_slice(), other.shape) } else { (other.shape, s.as_slice()) };
        let (_, win) = conv_geometry(node, x, w)?;
        let mut want = vec![x[0], w[0]];
        want.extend_from_slice(&win.output);
        if dy.shape != want.as_slice() {
            return Err(node.err(format!("dy {:?} does not match the convolution's output {want:?}", dy.shape)));
        }
        Ok(vec![TypeOut::new(dy.dtype, s)])
    }
}

struct ConvGradB;
impl OpDef for ConvGradB {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let dy = input(node, inputs, 0)?;
        if dy.shape.len() < 2 {
            return Err(node.err("dy must be [N, C, ...]"));
        }
        Ok(vec![TypeOut::new(dy.dtype, vec![dy.shape[1]])])
    }
}

pub fn register(r: &mut Registry) {
    r.add("Conv", Conv);
    r.internal("ConvGradX", ConvGradShaped);
    r.internal("ConvGradW", ConvGradShaped);
    r.internal("ConvGradB", ConvGradB);
}
