//! Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (reduction none/sum/mean,
//! ignore_index, class weights; class axis 1, extra dims after it), with the internal gradients
//! SoftmaxCrossEntropyLossGrad(dloss, scores, labels, weights?) and NLLLossGrad(...).
//! The softmax is recomputed in the backward pass instead of keeping log_prob alive.
//!
//! LinearCrossEntropy (internal, made by passes/fuse_linear_cross_entropy.rs): the LM head
//! `Linear(X, W, b)` and a row-wise softmax cross-entropy (reduction mean or sum) as one op that
//! never holds the whole logits matrix. It walks the rows in chunks of `lce_chunk_rows`: one
//! chunk's logits (output `scratch`, planned in the arena and dead after the node), their
//! log-sum-exp and loss terms, and, in the same pass, the gradient the loss would get for a unit
//! seed (softmax − one-hot, times the row's class weight and the reduction's 1/Σweights), pushed
//! through the two gradient gemms into dX and dW (and a column sum into db). The backward
//! pass only scales those by the seed: three gemms per step, as unfused, with no recompute.

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

/// How large LinearCrossEntropy's chunks may be on one backend: at most `max_rows` rows,
/// `scratch_bytes` of chunk logits and (where `weight_multiple` is not 0) that many times the
/// weight's bytes of them, never under `min_rows` rows whatever the vocabulary (below it the
/// per-chunk dW gemm's re-reads of dW dominate); each chunk row padded to whole `row_align`
/// classes (the scratch output's row length). The node's `target` attribute ("cpu", the
/// default, "cpu_half" in a bf16/fp16 CPU session, or "cuda", set by
/// passes/fuse_linear_cross_entropy.rs) picks one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LceBudget {
    pub max_rows: usize,
    pub min_rows: usize,
    pub scratch_bytes: usize,
    pub weight_multiple: usize,
    pub row_align: usize,
}

impl LceBudget {
    /// The per-chunk dW gemm (inner dimension = chunk rows) reads and writes all of dW once per
    /// chunk, and each chunk reads all of W twice, so chunks must be large: on the tutorial head
    /// (700 × 200 · 200 × 28782, 2 threads) 256 rows took 0.8x the time of 128 in 5 of 6
    /// interleaved runs, and two chunks of 350 took 0.975x the time of three of 234 on the fp32
    /// path (medians of 8 rounds, three runs: 102.0/100.1/101.7 ms against 106.0/102.4/104.0) and
    /// 0.94x on the bf16 path (90.5 against 96.4), for 13 MB more scratch (`lce_chunk_speed` in
    /// backend/cpu/linear_cross_entropy.rs, `LCE_CHUNKS=234,350`). The scratch bytes bound the
    /// rest: a vocabulary wider than 40 MiB / 364 rows (GPT-2's 50257 f32 columns: 51 MB at 256
    /// rows) gets fewer rows: on GPT-2's head (508 × 256 · 256 × 50257, 2 threads) three chunks
    /// of 170 rows took ~3% more time than two of 254 (`lce_chunk_speed` on that shape) for 17 MB
    /// less peak.
    pub const CPU: LceBudget = LceBudget { max_rows: 384, min_rows: 128, scratch_bytes: 40 << 20, weight_multiple: 0, row_align: 1 };
    /// A bf16/fp16 CPU session's: at most 256 rows. PyTorch's autocast keeps the logits and
    /// their gradient in bf16, so eager's own memory is lower there, and the 13 MB that two
    /// chunks of 350 add on the tutorial's head took ortrain's growth to 0.615x autocast eager's
    /// (`python -m bench`, 275 against 447 MiB; target 0.6x) for a 6% faster LinearCrossEntropy.
    pub const CPU_HALF: LceBudget = LceBudget { max_rows: 256, ..LceBudget::CPU };
    /// A GPU wants thousands of rows per gemm, and each chunk's dW products re-read and re-write
    /// dW (GPT-2 124M's: 154 MB) at memory bandwidth, about 4 times the weight's bytes of
    /// traffic a chunk. A chunk's logits of at most 3 times the weight keep that under the
    /// logits' own traffic (written, read by the row pass, G written and read by two products):
    /// GPT-2 124M's 16368 rows in 8 chunks of 2046 (2304 rows are 3 times its 768-wide weight;
    /// 512 MiB alone would allow 2670: 7 chunks), the tutorial's 700 in 2 of 350. With its 700
    /// in one chunk the tutorial's peak GPU memory was 0.74x eager's on an H200 (333 against
    /// 451 MiB; target 0.7x), 80 MB of it that chunk's logits. Rows of whole 64 classes
    /// (backend/cuda/ops/linear_cross_entropy.rs: GPT-2's 50257 left the logits and dX
    /// products on Turing's cutlass_75 kernels on an H200).
    pub const CUDA: LceBudget = LceBudget { max_rows: 8192, min_rows: 512, scratch_bytes: 512 << 20, weight_multiple: 3, row_align: 64 };

    /// The budget a LinearCrossEntropy node names in its `target` attribute.
    pub fn of(node: &Node) -> Result<LceBudget> {
        match node.attrs.string("target", "cpu")?.as_str() {
            "cpu" => Ok(LceBudget::CPU),
            "cpu_half" => Ok(LceBudget::CPU_HALF),
            "cuda" => Ok(LceBudget::CUDA),
            other => Err(node.err(format!("target '{other}' is not one of cpu, cpu_half, cuda"))),
        }
    }
}

/// Rows per chunk for `rows` rows of an `n`-column head over `k` features, of `elem_bytes`-byte
/// logits: at most the budget's rows and what fits its scratch bytes and weight multiple (never
/// under its `min_rows`), then evened out over the chunks that takes (700 rows on the CPU:
/// 2 × 350, not 364 + 336), so that the scratch is no larger than the chunks need.
pub fn lce_chunk_rows(rows: usize, n: usize, k: usize, elem_bytes: usize, budget: LceBudget) -> usize {
    let mut fits = budget.scratch_bytes / (n * elem_bytes).max(1);
    if budget.weight_multiple > 0 {
        // rows · n ≤ multiple · n · k
        fits = fits.min(budget.weight_multiple * k);
    }
    let most = fits.clamp(budget.min_rows, budget.max_rows);
    let chunks = rows.div_ceil(most).max(1);
    rows.div_ceil(chunks)
}

/// Whether a LinearCrossEntropy node computes dW₁: its `weight_grad` attribute (default 1), which
/// passes/lce_weight_grad.rs sets to 0 where nothing reads dW₁ (a frozen LM head: LoRA): dW₁ is
/// then an empty tensor and the kernels skip its product, a third of the node's work.
pub fn lce_weight_grad(node: &Node) -> Result<bool> {
    Ok(node.attrs.int("weight_grad", 1)? != 0)
}

/// LinearCrossEntropy(X[…, K], W, b?, labels[rows], class_weights?) -> (loss, dX₁, dW₁, db₁,
/// scratch), where the `₁` outputs are the gradients for a loss seed of 1 (db₁ is [N] zeros when
/// there is no bias; dW₁ is empty with `weight_grad` 0) and `scratch` is the chunk's logits.
struct LinearCrossEntropy;
impl OpDef for LinearCrossEntropy {
    fn infer(&self, node: &Node, inputs: &[Option<InferIn>]) -> Result<Vec<TypeOut>> {
        let (x, w, t) = (input(node, inputs, 0)?, input(node, inputs, 1)?, input(node, inputs, 3)?);
        let (k, n) = super::linear::linear_dims(node, w.shape)?;
        if x.shape.last() != Some(&k) {
            return Err(node.err(format!("X {:?} does not end in the weight's K = {k}", x.shape)));
        }
        let rows: usize = x.shape[..x.shape.len() - 1].iter().product();
        if t.shape != [rows] {
            return Err(node.err(format!("labels {:?} do not match the {rows} rows of X {:?}", t.shape, x.shape)));
        }
        if let Some(Some(b)) = inputs.get(2) {
            if b.shape != [n] {
                return Err(node.err(format!("the bias must be [{n}], got {:?}", b.shape)));
            }
        }
        if let Some(Some(cw)) = inputs.get(4) {
            if cw.shape != [n] {
                return Err(node.err(format!("the class weights must be [{n}], got {:?}", cw.shape)));
            }
        }
        let reduction = node.attrs.string("reduction", "mean")?;
        if reduction != "mean" && reduction != "sum" {
            return Err(node.err(format!("reduction '{reduction}' is not one of sum, mean")));
        }
        let dw = if lce_weight_grad(node)? { TypeOut::like(w) } else { TypeOut::new(w.dtype, vec![0]) };
        Ok(vec![TypeOut::new(x.dtype, vec![]), TypeOut::like(x), dw, TypeOut::new(x.dtype, vec![n]), {
            let budget = LceBudget::of(node)?;
            let cols = n.next_multiple_of(budget.row_align.max(1));
            TypeOut::new(x.dtype, vec![lce_chunk_rows(rows, cols, k, x.dtype.size(), budget), cols])
        }])
    }
    fn gradient(&self) -> Option<fn(&Node, &mut GradCtx) -> Result<()>> {
        Some(|node, g| {
            let Some(dy) = g.dy(0) else { return Ok(()) };
            if g.wants(1) && !lce_weight_grad(node)? {
                return Err(node.err("the weight's gradient is wanted but weight_grad is 0"));
            }
            for i in 0..3 {
                if g.wants(i) && (i < 2 || node.input(2).is_some()) {
                    let unit = g.y(i + 1);
                    let d = g.op("Mul", &[unit, dy], Attrs::default());
                    g.set(i, d);
                }
            }
            Ok(())
        })
    }
    fn non_differentiable_inputs(&self) -> &'static [usize] {
        &[3, 4]
    }
}

pub fn register(r: &mut Registry) {
    r.internal("LinearCrossEntropy", LinearCrossEntropy);
    r.add("SoftmaxCrossEntropyLoss", Loss);
    r.add("NegativeLogLikelihoodLoss", Loss);
    r.internal("SoftmaxCrossEntropyLossGrad", LossGrad);
    r.internal("NLLLossGrad", LossGrad);
}

#[cfg(test)]
mod tests {
    use super::{lce_chunk_rows, LceBudget};

    #[test]
    fn lce_chunks_are_even_and_within_the_scratch_budget() {
        // the CPU budgets have no weight multiple: k does not matter
        let cpu = |rows, n, elem| lce_chunk_rows(rows, n, 1, elem, LceBudget::CPU);
        // a bf16 session's: 3 chunks of 234 (less memory, as autocast eager's is less)
        assert_eq!(lce_chunk_rows(700, 28782, 200, 4, LceBudget::CPU_HALF), 234);
        // the tutorial's head (700 rows, 28782 f32 columns): 364 rows fit 40 MiB; 2 chunks of 350,
        // not 364 + 336
        assert_eq!(cpu(700, 28782, 4), 350);
        // GPT-2's (508 rows, 50257 columns): 256 rows would be 51 MB; 3 chunks of 170 fit 40 MiB
        assert_eq!(cpu(508, 50257, 4), 170);
        // f64 logits take twice the bytes per row: 182 rows fit, 4 chunks of 175
        assert_eq!(cpu(700, 28782, 8), 175);
        // few rows: one chunk of all of them; a huge vocabulary still gets 128-row chunks
        assert_eq!(cpu(77, 30522, 4), 77);
        assert_eq!(cpu(1000, 1 << 20, 4), 125);
        assert_eq!(cpu(0, 100, 4), 0);
    }

    #[test]
    fn gpu_chunks_are_thousands_of_rows() {
        let cuda = |rows, n, k, elem| lce_chunk_rows(rows, n, k, elem, LceBudget::CUDA);
        // GPT-2 124M (16 × 1023 shifted rows, 50257 columns, 768 features): 2670 rows fit
        // 512 MiB, 2304 are 3 times the weight; 8 × 2046
        assert_eq!(cuda(16 * 1023, 50257, 768, 4), 2046);
        // the tutorial's 700 rows over 200 features: at most 600, so 2 × 350
        assert_eq!(cuda(700, 28782, 200, 4), 350);
        // a narrow weight still gets 512-row chunks; a huge vocabulary keeps 512-row chunks;
        // many rows of a small one stop at 8192
        assert_eq!(cuda(2000, 1000, 16, 4), 500);
        assert_eq!(cuda(4096, 1 << 20, 4096, 4), 512);
        assert_eq!(cuda(20000, 1000, 4096, 4), 6667);
    }
}
