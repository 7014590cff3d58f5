//! Dropout, DropoutGrad and DropoutAdd (kernels/dropout.cu). Masks come from Philox4x32-10
//! keyed by the step's seed mixed with the node's name (`salt_of`), so every Dropout node of a step draws its
//! own stream and a replay with the same seed draws the same masks, in the model's own graph as
//! in the model-and-loss graph that numbers its values differently (they differ from the CPU
//! backend's masks, as PyTorch's CPU and CUDA masks differ). In a step recorded into a CUDA
//! graph the seed is read from device memory (`dropout_slot_T`), which computes the same key.
//! DropoutKey writes that key for a fused attention whose Dropout it replaced.

use cudarc::driver::result;

use super::{float_suffix, input, CudaCtx, CudaTable, DView};
use crate::backend::cuda::launch::KArg;
use crate::error::{Error, Result};
use crate::ir::Node;
use crate::tensor::DType;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The Philox key of a Dropout node: the step's seed mixed with the node's salt (`salt_of`);
/// `dropout_slot_T` computes the same on the device.
pub fn random_key(seed: u64, salt: u64) -> u64 {
    splitmix(seed ^ salt)
}

/// A Dropout node's salt: splitmix of the FNV-1a hash of its name. Not its output's value id:
/// the fused loss's graph (engine/cross_entropy.py) imports extra initializers and an input
/// before the node outputs, so its ids are shifted from the model's own graph, whose replay of
/// the logits (engine/lazy.py) must draw the fused step's masks. Node names are unique (the
/// exporters name every node; the importer names the others `<op>_<index>`), and passes keep
/// a Dropout's name.
pub fn salt_of(node: &Node) -> u64 {
    let fnv = node.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    splitmix(fnv)
}

/// Whether a Dropout trains: known at plan time, or read on the device (a bool computed in the
/// step, at this address).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Training {
    Known(bool),
    OnDevice(u64),
}

/// A Dropout's ratio and training mode from its optional inputs at `at` and `at + 1` (defaults:
/// the `ratio` attribute or 0.5, and not training, as the CPU kernel). Each is a plan-time
/// constant or a value computed in the step, which the kernels read on the device
/// (kernels/dropout.cu, "the rate's operands").
struct Rate {
    /// The constant ratio (unused where `ratio_at` is set).
    ratio: f64,
    /// The computed ratio's address (0: none) and its type's code in the kernels.
    ratio_at: u64,
    ratio_type: i32,
    training: Training,
}

impl Rate {
    fn of(node: &Node, ins: &[Option<DView>], at: usize) -> Result<Rate> {
        let given = |i: usize| ins.get(i).and_then(|x| x.as_ref());
        let training = match given(at + 1) {
            None => Training::Known(false),
            Some(t) => match t.host {
                Some(h) => Training::Known(h.to_f64_vec().first().is_some_and(|&v| v != 0.0)),
                None if t.dtype == DType::Bool && t.numel() == 1 => Training::OnDevice(t.ptr),
                None => {
                    return Err(node.err(format!("training_mode (input {}) must be one bool, got {:?} {:?}", at + 1, t.dtype, t.shape)))
                }
            },
        };
        let (mut ratio, mut ratio_at, mut ratio_type) = (node.attrs.float("ratio", 0.5)? as f64, 0, 0);
        match given(at) {
            None => {}
            Some(r) => match r.host {
                Some(h) => ratio = h.to_f64_vec().first().copied().unwrap_or(ratio),
                None if training == Training::Known(false) => {} // outside training the ratio is unused
                None => {
                    ratio_type = match r.dtype {
                        DType::F32 => 0,
                        DType::F64 => 1,
                        DType::BF16 => 2,
                        DType::F16 => 3,
                        d => return Err(node.err(format!("ratio (input {at}) must be a float, got {}", d.name()))),
                    };
                    if r.numel() != 1 {
                        return Err(node.err(format!("ratio (input {at}) must be one value, got shape {:?}", r.shape)));
                    }
                    ratio_at = r.ptr;
                }
            },
        }
        if ratio_at == 0 && !(0.0..1.0).contains(&ratio) {
            return Err(node.err(format!("ratio {ratio} must be in [0, 1)")));
        }
        Ok(Rate { ratio, ratio_at, ratio_type, training })
    }

    /// Nothing is dropped, whatever the device holds: outside training, or at a constant ratio 0.
    fn keeps_everything(&self) -> bool {
        self.training == Training::Known(false) || (self.ratio_at == 0 && self.ratio == 0.0 && self.training == Training::Known(true))
    }

    /// The ratio argument of a forward kernel (0 outside training).
    fn forward_ratio(&self) -> f32 {
        if self.training == Training::Known(false) {
            0.0
        } else {
            self.ratio as f32
        }
    }

    /// The scale argument of a backward kernel.
    fn grad_scale(&self) -> f32 {
        if self.training == Training::Known(false) {
            1.0
        } else {
            (1.0 / (1.0 - self.ratio)) as f32
        }
    }

    /// The kernels' trailing rate operands (ratio_at, ratio_type, training_at, err), null where
    /// a constant stands (`of` leaves ratio_at 0 outside training); `err` (the error flag) is
    /// set by the forward kernels only.
    fn args(&self, err: u64) -> [KArg; 4] {
        let training_at = match self.training {
            Training::OnDevice(p) => p,
            Training::Known(_) => 0,
        };
        [KArg::Ptr(self.ratio_at), KArg::I32(self.ratio_type), KArg::Ptr(training_at), KArg::Ptr(err)]
    }
}

fn dropout(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let x = input(node, ins, 0)?;
    let rate = Rate::of(node, ins, 1)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let mask = outs.get(1).map_or(0, |m| m.ptr);
    if rate.keeps_everything() {
        if x.ptr != outs[0].ptr {
            // SAFETY: input and output hold n elements of the same type and do not overlap.
            unsafe { result::memcpy_dtod_async(outs[0].ptr, x.ptr, n * x.dtype.size(), ctx.stream) }
                .map_err(|e| Error::Cuda(format!("copy: {e}")))?;
        }
        if mask != 0 {
            ctx.rt.launch(ctx.stream, "fill_u8", ctx.rt.elementwise_grid(n), &[KArg::Ptr(mask), KArg::I64(n as i64), KArg::U64(1)])?;
        }
        return Ok(());
    }
    launch(node, ctx, x, None, outs[0].ptr, mask, &rate)
}

/// DropoutAdd(x, residual, ratio?, training_mode?) -> (Dropout(x) + residual, mask): the mask
/// a Dropout of this name draws; outside training, x + residual (ratio 0 keeps everything).
fn dropout_add(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (x, r) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let rate = Rate::of(node, ins, 2)?;
    if r.shape != x.shape || !crate::ops::random::residual_joins(x.dtype, r.dtype) || outs[0].shape != x.shape || outs[0].dtype != r.dtype {
        return Err(node.err(format!(
            "the residual {:?} {:?} must be shaped like x {:?} and typed like it (or f32 for a 16-bit x)",
            r.dtype, r.shape, x.shape
        )));
    }
    if x.numel() == 0 {
        return Ok(());
    }
    let mask = outs.get(1).map_or(0, |m| m.ptr);
    launch(node, ctx, x, Some(r), outs[0].ptr, mask, &rate)
}

/// The dropout kernel of `node` over x (plus `res`) into y and `mask` (0: none): keyed by the
/// step's seed, or by the seed slot a recorded step reads.
fn launch(node: &Node, ctx: &mut CudaCtx, x: &DView, res: Option<&DView>, y: u64, mask: u64, rate: &Rate) -> Result<()> {
    let salt = salt_of(node);
    let t = float_suffix(node, x.dtype)?;
    let op = match res {
        Some(r) if r.dtype != x.dtype => "dropout_add_wide",
        Some(_) => "dropout_add",
        None => "dropout",
    };
    // the Philox key, or the seed's address and the salt the kernel mixes into it
    let (kernel, key, last) = if ctx.seed_slot != 0 {
        (format!("{op}_slot_{t}"), KArg::Ptr(ctx.seed_slot), KArg::U64(salt))
    } else {
        (format!("{op}_{t}"), KArg::U64(random_key(ctx.seed, salt)), KArg::U64(0))
    };
    let n = x.numel();
    let mut args = vec![KArg::Ptr(x.ptr)];
    args.extend(res.map(|r| KArg::Ptr(r.ptr)));
    args.extend([KArg::Ptr(y), KArg::Ptr(mask), KArg::I64(n as i64), KArg::F32(rate.forward_ratio()), key, last]);
    args.extend(rate.args(ctx.error_flag));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n.div_ceil(4)), &args)
}

/// DropoutGrad(dy, mask, ratio?, training_mode?), dx in dy's type or its `dropped_type`.
fn dropout_grad(node: &Node, ins: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let (dy, mask) = (input(node, ins, 0)?, input(node, ins, 1)?);
    let rate = Rate::of(node, ins, 2)?;
    let n = dy.numel();
    if n == 0 {
        return Ok(());
    }
    // DropoutAdd's gradient for a 16-bit x out of an f32 stream: dy rounded to dx's type first
    let out = outs[0].dtype;
    let kernel = match crate::ops::random::dropped_type(node)? {
        Some(t) if dy.dtype == DType::F32 && out == t => format!("dropout_grad_wide_{}", float_suffix(node, t)?),
        _ if dy.dtype == out => format!("dropout_grad_{}", float_suffix(node, dy.dtype)?),
        _ => {
            return Err(node.err(format!(
                "dy is {:?} and dx {out:?}: they differ where no {} allows it",
                dy.dtype,
                crate::ops::random::DROPPED_TYPE
            )))
        }
    };
    let mut args = vec![KArg::Ptr(dy.ptr), KArg::Ptr(mask.ptr), KArg::Ptr(outs[0].ptr), KArg::I64(n as i64), KArg::F32(rate.grad_scale())];
    args.extend(rate.args(0));
    ctx.rt.launch(ctx.stream, &kernel, ctx.rt.elementwise_grid(n), &args)
}

/// DropoutKey() -> key: the Philox key a Dropout of this node's name would draw its mask with
/// (`random_key`; a recorded step's replay computes it from the seed slot), which the fused
/// attention keeps its probabilities by (kernels/attention.cuh `att_drop`).
fn dropout_key(node: &Node, _: &[Option<DView>], outs: &[DView], ctx: &mut CudaCtx) -> Result<()> {
    let out = outs.first().ok_or_else(|| node.err("DropoutKey has one output"))?;
    if out.dtype != DType::I64 || out.numel() != 1 {
        return Err(node.err(format!("the key is {} {:?}, expected one int64", out.dtype.name(), out.shape)));
    }
    let salt = salt_of(node);
    let (seed, key) = if ctx.seed_slot != 0 { (ctx.seed_slot, salt) } else { (0, random_key(ctx.seed, salt)) };
    ctx.rt.launch(ctx.stream, "dropout_key_i64", ctx.rt.elementwise_grid(1), &[KArg::Ptr(out.ptr), KArg::Ptr(seed), KArg::U64(key)])
}

pub fn register(t: &mut CudaTable) {
    t.add("Dropout", dropout);
    t.add("DropoutKey", dropout_key);
    t.add("DropoutGrad", dropout_grad);
    t.add("DropoutAdd", dropout_add);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, ValueId};

    fn dropout(name: &str, output: usize) -> Node {
        Node { name: name.into(), op_type: "Dropout".into(), inputs: vec![], outputs: vec![ValueId(output)], attrs: Attrs::default() }
    }

    /// The same node in graphs that number their values differently (the model's own graph and
    /// the model-and-loss graph) draws the same masks; two nodes of one graph draw their own.
    #[test]
    fn a_dropout_is_keyed_by_its_name_not_its_value_id() {
        assert_eq!(salt_of(&dropout("node_dropout_1", 5)), salt_of(&dropout("node_dropout_1", 7)));
        assert_ne!(salt_of(&dropout("node_dropout_1", 5)), salt_of(&dropout("node_dropout_2", 5)));
        assert_ne!(random_key(1, salt_of(&dropout("a", 0))), random_key(2, salt_of(&dropout("a", 0))));
    }
}
