//! Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (reduction none/sum/mean,
//! ignore_index, class weights; class axis 1, extra dims after it), with the internal gradients
//! SoftmaxCrossEntropyLossGrad(dloss, scores, labels, weights?) and NLLLossGrad(...).
//! The softmax is recomputed in the backward pass instead of keeping log_prob alive.

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::autodiff::GradCtx;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node};

struct Loss;
impl OpDef for Loss {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        let t = input(node, inputs, 1)?;
        if x.shape.len() < 2 || t.shape.len() + 1 != x.shape.len() || t.shape[0] != x.shape[0] || t.shape[1..] != x.shape[2..] {
            return Err(node.err(format!("scores {:?} and labels {:?} do not match ([N, C, d...] and [N, d...])", x.shape, t.shape)));
        }
        let reduction = node.attrs.string("reduction", "mean")?;
        let shape = match reduction.as_str() {
            "none" => t.shape.to_vec(),
            "sum" | "mean" => vec![],
            other => return Err(node.err(format!("reduction '{other}' is not one of none, sum, mean"))),
        };
        let mut outs = vec![TypeOut::new(x.dtype, shape)];
        if node.outputs.len() > 1 {
            outs.push(TypeOut::like(x));
        }
        Ok(outs)
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let op = if node.op_type == "SoftmaxCrossEntropyLoss" { "SoftmaxCrossEntropyLossGrad" } else { "NLLLossGrad" };
            let from_loss =
                g.dy(0).map(|dy| g.op_n(op, vec![Some(dy), node.input(0), node.input(1), node.input(2)], node.attrs.clone(), 1)[0]);
            // SoftmaxCrossEntropyLoss's optional log_prob output is LogSoftmax(scores) over axis 1
            let from_log_prob = g.dy(1).map(|dlp| {
                let attrs = Attrs::default().with("axis", Attr::Int(1)).with("__opset", Attr::Int(13));
                let lp = g.y(1);
                g.op("LogSoftmaxGrad", &[dlp, lp], attrs)
            });
            let d = match (from_loss, from_log_prob) {
                (Some(a), Some(b)) => g.op("Add", &[a, b], Attrs::default()),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => return Ok(()),
            };
            g.set(0, d);
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[1, 2]
    }
}

struct LossGrad;
impl OpDef for LossGrad {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        Ok(vec![TypeOut::like(input(node, inputs, 1)?)])
    }
}

pub fn register(r: &mut Registry) {
    r.add("SoftmaxCrossEntropyLoss", Loss);
    r.add("NegativeLogLikelihoodLoss", Loss);
    r.internal("SoftmaxCrossEntropyLossGrad", LossGrad);
    r.internal("NLLLossGrad", LossGrad);
}
