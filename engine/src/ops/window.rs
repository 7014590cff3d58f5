//! Sliding-window geometry shared by Conv and the pools: kernel_shape, strides, dilations, pads
//! (begin..., end...), auto_pad (NOTSET, SAME_UPPER, SAME_LOWER, VALID) and ceil_mode, resolved
//! to concrete per-axis numbers for one input shape. Spec: Conv-11, MaxPool-12, AveragePool-19.

use crate::error::Result;
use crate::ir::Node;

/// Concrete geometry over the spatial axes of an [N, C, D1, ..., Dk] input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub input: Vec<usize>,
    pub kernel: Vec<usize>,
    pub strides: Vec<usize>,
    pub dilations: Vec<usize>,
    pub pad_begin: Vec<usize>,
    pub pad_end: Vec<usize>,
    pub output: Vec<usize>,
}

impl Window {
    pub fn rank(&self) -> usize {
        self.input.len()
    }
    /// Number of output positions per (n, c) plane.
    pub fn out_size(&self) -> usize {
        self.output.iter().product()
    }
    pub fn in_size(&self) -> usize {
        self.input.iter().product()
    }
    pub fn kernel_size(&self) -> usize {
        self.kernel.iter().product()
    }
    /// The same geometry over exactly two spatial axes (a 1-D window gets a leading axis of 1),
    /// which is what the CPU kernels implement.
    pub fn as_2d(&self) -> Window {
        if self.rank() == 2 {
            return self.clone();
        }
        let lift = |v: &[usize], one: usize| -> Vec<usize> {
            let mut o = vec![one];
            o.extend_from_slice(v);
            o
        };
        Window {
            input: lift(&self.input, 1),
            kernel: lift(&self.kernel, 1),
            strides: lift(&self.strides, 1),
            dilations: lift(&self.dilations, 1),
            pad_begin: lift(&self.pad_begin, 0),
            pad_end: lift(&self.pad_end, 0),
            output: lift(&self.output, 1),
        }
    }
}

fn ints_or(node: &Node, name: &str, k: usize, default: usize) -> Result<Vec<usize>> {
    match node.attrs.ints(name).map_err(|e| node.err(e.to_string()))? {
        None => Ok(vec![default; k]),
        Some(v) => {
            if v.len() != k || v.iter().any(|&x| x < 1) {
                return Err(node.err(format!("{name} {v:?} must have {k} positive entries")));
            }
            Ok(v.into_iter().map(|x| x as usize).collect())
        }
    }
}

/// Resolves the window of `node` over the spatial dims `input` (shape[2..]). `kernel` is the
/// kernel's spatial shape when the op reads it from a weight (Conv), else the `kernel_shape`
/// attribute is required. `ceil_mode` is read for pools only.
pub fn resolve(node: &Node, input: &[usize], kernel: Option<&[usize]>, allow_ceil: bool) -> Result<Window> {
    let k = input.len();
    if k == 0 {
        return Err(node.err("the input needs at least one spatial axis ([N, C, D1, ...])"));
    }
    let kernel: Vec<usize> = match (node.attrs.ints("kernel_shape").map_err(|e| node.err(e.to_string()))?, kernel) {
        (Some(ks), w) => {
            let ks: Vec<usize> = ks.iter().map(|&d| d.max(0) as usize).collect();
            if let Some(w) = w {
                if w != ks.as_slice() {
                    return Err(node.err(format!("kernel_shape {ks:?} does not match the weight's spatial shape {w:?}")));
                }
            }
            ks
        }
        (None, Some(w)) => w.to_vec(),
        (None, None) => return Err(node.err("attribute 'kernel_shape' is required")),
    };
    if kernel.len() != k || kernel.contains(&0) {
        return Err(node.err(format!("kernel shape {kernel:?} does not fit a {k}-D spatial input {input:?}")));
    }
    let strides = ints_or(node, "strides", k, 1)?;
    let dilations = ints_or(node, "dilations", k, 1)?;
    let ceil = allow_ceil && node.attrs.int("ceil_mode", 0).map_err(|e| node.err(e.to_string()))? != 0;
    let auto_pad = node.attrs.string("auto_pad", "NOTSET").map_err(|e| node.err(e.to_string()))?;
    let span: Vec<usize> = (0..k).map(|i| (kernel[i] - 1) * dilations[i] + 1).collect();
    let (mut pad_begin, mut pad_end) = (vec![0; k], vec![0; k]);
    let mut output = vec![0; k];
    match auto_pad.as_str() {
        "NOTSET" | "" => {
            if let Some(p) = node.attrs.ints("pads").map_err(|e| node.err(e.to_string()))? {
                if p.len() != 2 * k || p.iter().any(|&x| x < 0) {
                    return Err(node.err(format!("pads {p:?} must have {} non-negative entries", 2 * k)));
                }
                for i in 0..k {
                    pad_begin[i] = p[i] as usize;
                    pad_end[i] = p[k + i] as usize;
                }
            }
            for i in 0..k {
                let full = input[i] + pad_begin[i] + pad_end[i];
                if full < span[i] {
                    return Err(
                        node.err(format!("the window (extent {}) is larger than the padded input ({full}) on spatial axis {i}", span[i]))
                    );
                }
                let room = full - span[i];
                let mut o = if ceil { room.div_ceil(strides[i]) + 1 } else { room / strides[i] + 1 };
                // in ceil mode the last window must start inside the input or the left padding
                if ceil && (o - 1) * strides[i] >= input[i] + pad_begin[i] {
                    o -= 1;
                }
                output[i] = o;
            }
        }
        "VALID" => {
            for i in 0..k {
                if input[i] < span[i] {
                    return Err(node.err(format!("the window (extent {}) is larger than the input ({}) on axis {i}", span[i], input[i])));
                }
                let room = input[i] - span[i];
                output[i] = if ceil { room.div_ceil(strides[i]) + 1 } else { room / strides[i] + 1 };
            }
        }
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..k {
                let o = input[i].div_ceil(strides[i]);
                let total = ((o.max(1) - 1) * strides[i] + span[i]).saturating_sub(input[i]);
                let small = total / 2;
                if auto_pad == "SAME_UPPER" {
                    pad_begin[i] = small;
                    pad_end[i] = total - small;
                } else {
                    pad_end[i] = small;
                    pad_begin[i] = total - small;
                }
                output[i] = o;
            }
        }
        other => return Err(node.err(format!("auto_pad '{other}' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID"))),
    }
    Ok(Window { input: input.to_vec(), kernel, strides, dilations, pad_begin, pad_end, output })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Attrs};

    fn node(attrs: Attrs) -> Node {
        Node { name: "p".into(), op_type: "MaxPool".into(), inputs: vec![], outputs: vec![], attrs }
    }

    #[test]
    fn output_sizes() {
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![3, 3])).with("pads", Attr::Ints(vec![1, 1, 1, 1]));
        let w = resolve(&node(a), &[32, 32], None, true).unwrap();
        assert_eq!(w.output, vec![32, 32]);
        // ceil mode: 5 with k2 s2 -> 3 windows (the last one half outside)
        let a =
            Attrs::default().with("kernel_shape", Attr::Ints(vec![2])).with("strides", Attr::Ints(vec![2])).with("ceil_mode", Attr::Int(1));
        assert_eq!(resolve(&node(a.clone()), &[5], None, true).unwrap().output, vec![3]);
        assert_eq!(resolve(&node(a), &[5], None, false).unwrap().output, vec![2]);
        // SAME_UPPER, stride 2 on 5: out 3, total pad 2 -> (1, 1); SAME_LOWER with k2: pad (1, 0)
        let a = Attrs::default()
            .with("kernel_shape", Attr::Ints(vec![3]))
            .with("strides", Attr::Ints(vec![2]))
            .with("auto_pad", Attr::String("SAME_UPPER".into()));
        let w = resolve(&node(a), &[5], None, false).unwrap();
        assert_eq!((w.output[0], w.pad_begin[0], w.pad_end[0]), (3, 1, 1));
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![2])).with("auto_pad", Attr::String("SAME_LOWER".into()));
        let w = resolve(&node(a), &[4], None, false).unwrap();
        assert_eq!((w.output[0], w.pad_begin[0], w.pad_end[0]), (4, 1, 0));
        // dilation 2, kernel 3: extent 5
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![3])).with("dilations", Attr::Ints(vec![2]));
        assert_eq!(resolve(&node(a), &[7], None, false).unwrap().output, vec![3]);
        let a = Attrs::default().with("kernel_shape", Attr::Ints(vec![9]));
        assert!(resolve(&node(a), &[7], None, false).is_err());
    }
}
