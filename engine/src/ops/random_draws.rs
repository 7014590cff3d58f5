//! The ops that draw random numbers into a new tensor: RandomUniformLike, RandomNormalLike
//! (`torch.rand_like`, `torch.randn_like`, and timm's DropPath / torchvision's stochastic
//! depth, whose `bernoulli_` both exporters write as a RandomUniformLike and a compare),
//! RandomUniform, RandomNormal (`torch.rand` / `torch.randn` of a fixed shape) and Bernoulli
//! (`torch.bernoulli`). Outputs are float tensors; no gradient flows through them (PyTorch's
//! derivative of each is zero), and like Dropout they are drawn afresh every step from the
//! step's seed, never folded as constants. The `seed` attribute, where an exporter writes one,
//! is mixed into the node's own stream (it does not make every step draw the same numbers).

use super::util::input;
use super::{InferIn, OpDef, Registry, TypeOut};
use crate::error::Result;
use crate::ir::Node;
use crate::tensor::DType;

/// What a node draws.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Law {
    /// Uniform in [low, high).
    Uniform { low: f64, high: f64 },
    /// Normal with this mean and standard deviation.
    Normal { mean: f64, scale: f64 },
    /// 1 with the probability its input holds (in [0, 1]), else 0.
    Bernoulli,
}

/// The law of a random-draw node (attributes low/high, mean/scale).
pub fn law(node: &Node) -> Result<Law> {
    let a = &node.attrs;
    Ok(match node.op_type.as_str() {
        "RandomUniformLike" | "RandomUniform" => {
            let (low, high) = (a.float("low", 0.0)? as f64, a.float("high", 1.0)? as f64);
            if low.partial_cmp(&high).is_none_or(|o| o == std::cmp::Ordering::Greater) {
                return Err(node.err(format!("low {low} must not exceed high {high}")));
            }
            Law::Uniform { low, high }
        }
        "RandomNormalLike" | "RandomNormal" => Law::Normal { mean: a.float("mean", 0.0)? as f64, scale: a.float("scale", 1.0)? as f64 },
        "Bernoulli" => Law::Bernoulli,
        other => return Err(node.err(format!("{other} is not a random-draw op"))),
    })
}

/// The op types of this file, which each backend's one draw kernel serves.
pub const DRAW_OPS: [&str; 5] = ["RandomUniformLike", "RandomNormalLike", "RandomUniform", "RandomNormal", "Bernoulli"];

/// What a backend xors into the node's stream key: the `seed` attribute's bits spread by the
/// golden-ratio constant (0 without one).
pub fn seed_mix(node: &Node) -> Result<u64> {
    Ok(match node.attrs.get("seed") {
        None => 0,
        Some(_) => (node.attrs.float("seed", 0.0)?.to_bits() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    })
}

/// The output type: the `dtype` attribute, else `default` (the input's type; float32 for
/// RandomUniform and RandomNormal); a float type.
fn output_type(node: &Node, default: Option<DType>) -> Result<DType> {
    let code = node.attrs.int("dtype", 0)?;
    let t = if code != 0 {
        DType::from_onnx(code as i32).ok_or_else(|| node.err(format!("attribute dtype {code} is not an element type the engine has")))?
    } else {
        default.unwrap_or(DType::F32)
    };
    if !t.is_float() {
        return Err(node.err(format!("draws {} values: only float32, float64, bfloat16 and float16 are supported", t.name())));
    }
    Ok(t)
}

/// RandomUniformLike, RandomNormalLike, Bernoulli: the input's shape (and, without `dtype`,
/// its type); the input's values are read by Bernoulli only.
struct DrawLike;
impl OpDef for DrawLike {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let x = input(node, inputs, 0)?;
        law(node)?;
        let t = output_type(node, Some(x.dtype))?;
        if node.op_type == "Bernoulli" && t != x.dtype {
            return Err(node.err(format!(
                "draws {} values from {} probabilities: only into the probabilities' own type (a Cast after it gives others)",
                t.name(),
                x.dtype.name()
            )));
        }
        Ok(vec![TypeOut::new(t, x.shape.to_vec())])
    }
    fn is_random(&self) -> bool {
        true
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[0]
    }
}

/// RandomUniform, RandomNormal: the `shape` attribute's shape.
struct DrawShaped;
impl OpDef for DrawShaped {
    fn infer(&self, node: &Node, _inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        law(node)?;
        let shape = node.attrs.ints("shape")?.ok_or_else(|| node.err("attribute shape is required"))?;
        let shape = shape
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| node.err(format!("shape {shape:?} has a negative dimension"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(vec![TypeOut::new(output_type(node, None)?, shape)])
    }
    fn is_random(&self) -> bool {
        true
    }
}

pub fn register(r: &mut Registry) {
    for op in DRAW_OPS {
        match op {
            "RandomUniform" | "RandomNormal" => r.add(op, DrawShaped),
            _ => r.add(op, DrawLike),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Attrs, ValueId};

    fn node(op: &str, attrs: Attrs) -> Node {
        Node { name: "r".into(), op_type: op.into(), inputs: vec![Some(ValueId(0))], outputs: vec![ValueId(1)], attrs }
    }

    #[test]
    fn outputs_take_the_dtype_attribute_else_the_inputs_type() {
        let x = InferIn { dtype: DType::BF16, shape: &[3, 4], value: None };
        let like = |attrs| DrawLike.infer(&node("RandomUniformLike", attrs), &[Some(x)]).unwrap().remove(0);
        assert_eq!(like(Attrs::default()), TypeOut::new(DType::BF16, vec![3, 4]));
        assert_eq!(like(Attrs::default().with("dtype", Attr::Int(1))), TypeOut::new(DType::F32, vec![3, 4]));
        let ints = DrawLike.infer(&node("RandomNormalLike", Attrs::default().with("dtype", Attr::Int(7))), &[Some(x)]);
        assert!(ints.unwrap_err().to_string().contains("draws int64 values"), "an int64 draw is refused by name");
        let shaped = node("RandomNormal", Attrs::default().with("shape", Attr::Ints(vec![2, 5])));
        assert_eq!(DrawShaped.infer(&shaped, &[]).unwrap(), vec![TypeOut::new(DType::F32, vec![2, 5])]);
        let bad = node(
            "RandomUniform",
            Attrs::default().with("low", Attr::Float(2.0)).with("high", Attr::Float(1.0)).with("shape", Attr::Ints(vec![1])),
        );
        assert!(DrawShaped.infer(&bad, &[]).unwrap_err().to_string().contains("low 2 must not exceed high 1"));
    }
}
