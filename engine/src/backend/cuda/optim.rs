//! The fused optimizer update and gradient clipping on the GPU for callers outside a plan (the
//! Python optimizer and clip_grad_norm_ bridges): one `adam_f32` launch (kernels/optim.cu) over
//! every tensor of a parameter group, described by a table of `abi::AdamTensor` in device memory
//! that the caller fills, and the group's chunk list (`chunk_list`, uploaded once per set of
//! tensor sizes); `clip_f32`, three launches over a table of `abi::GradTensor`. The scalars are
//! engine/src/optim's (`AdamScalars`: f64 hyper-parameters rounded once, as torch's).

use cudarc::driver::sys::CUstream;

use super::launch::{Grid, KArg};
use super::runtime::CudaRuntime;
use crate::error::{Error, Result};
use crate::optim::{AdamHyper, AdamScalars};

/// Elements per chunk: a block's unit of work (the tutorial model's 13M parameters: ~200 chunks).
pub const CHUNK: usize = 1 << 16;

/// (tensor index, first element) of every CHUNK-element chunk of tensors of these sizes, in order.
pub fn chunk_list(sizes: &[usize]) -> (Vec<i32>, Vec<i64>) {
    sizes.iter().enumerate().flat_map(|(t, &n)| (0..n).step_by(CHUNK).map(move |s| (t as i32, s as i64))).unzip()
}

/// The tensors of a multi-tensor launch: `table`, the device address of their descriptors
/// (`abi::AdamTensor` or `abi::GradTensor`), and their `chunks` chunks listed at `chunk_tensor`
/// (i32) and `chunk_start` (i64) as `chunk_list` makes them.
#[derive(Clone, Copy, Debug)]
pub struct TensorList {
    pub table: u64,
    pub chunk_tensor: u64,
    pub chunk_start: u64,
    pub chunks: usize,
}

impl TensorList {
    /// An error naming `what` where an address is null.
    fn check(&self, what: &str) -> Result<()> {
        if [self.table, self.chunk_tensor, self.chunk_start].contains(&0) {
            return Err(Error::other(format!("{what}: a null table or chunk list")));
        }
        Ok(())
    }
    /// A grid-stride launch over the chunks: up to 4 blocks an SM.
    fn grid(&self, rt: &CudaRuntime) -> Grid {
        Grid::new(self.chunks.min(rt.sms as usize * 4).max(1) as u32, 256)
    }
    /// The kernels' first five arguments: the table, the chunk lists, their length, CHUNK.
    fn args(&self) -> [KArg; 5] {
        [
            KArg::Ptr(self.table),
            KArg::Ptr(self.chunk_tensor),
            KArg::Ptr(self.chunk_start),
            KArg::I64(self.chunks as i64),
            KArg::I64(CHUNK as i64),
        ]
    }
}

/// Queues Adam/AdamW (`h.decoupled`) with f32 gradients on `stream` over the tensors of `list`
/// (`AdamTensor`s).
///
/// # Safety
/// The table and chunk lists must be device memory of the runtime's context, holding what they
/// describe, with every parameter, gradient and moment address live f32 device memory of its
/// `n` elements, distinct from the others, until the queued update has run.
pub unsafe fn adam_f32(rt: &CudaRuntime, stream: CUstream, list: &TensorList, h: &AdamHyper) -> Result<()> {
    if list.chunks == 0 {
        return Ok(());
    }
    list.check("adam_f32")?;
    let s = AdamScalars::of(h);
    let mut args = list.args().to_vec();
    args.extend([
        KArg::F32(s.w1),
        KArg::F32(s.beta2),
        KArg::F32(s.w2),
        KArg::F32(s.eps),
        KArg::F32(s.weight_decay),
        KArg::F32(s.decay),
        KArg::F32(s.step_size),
        KArg::F32(s.bc2_sqrt),
        KArg::I32(h.decoupled as i32),
        KArg::I32(h.maximize as i32),
    ]);
    rt.launch(stream, "adam_f32", list.grid(rt), &args)
}

/// Queues torch.nn.utils.clip_grad_norm_ (L2) over the f32 gradients of `list` (`GradTensor`s)
/// on `stream`: the squares summed per chunk into `partial` (f64, one a chunk), the total norm
/// and the coefficient min(1, max_norm / (norm + 1e-6)) written to `norm` and `coef` (one f32
/// each) by one block, every gradient multiplied by the coefficient read on the device: no host
/// synchronisation.
///
/// # Safety
/// `list` as for `adam_f32`, every gradient live f32 device memory of its `n` elements, distinct
/// from the others; `partial`, `norm` and `coef` device memory of those sizes, not aliasing the
/// gradients; all live until the queued launches have run.
pub unsafe fn clip_f32(
    rt: &CudaRuntime,
    stream: CUstream,
    list: &TensorList,
    max_norm: f32,
    partial: u64,
    norm: u64,
    coef: u64,
) -> Result<()> {
    list.check("clip_f32")?;
    if norm == 0 || coef == 0 || (list.chunks > 0 && partial == 0) {
        return Err(Error::other("clip_f32: a null output"));
    }
    let over_chunks = |out: u64| {
        let mut args = list.args().to_vec();
        args.push(KArg::Ptr(out));
        args
    };
    rt.launch(stream, "sum_squares_f32", list.grid(rt), &over_chunks(partial))?;
    let norm_args = [KArg::Ptr(partial), KArg::I64(list.chunks as i64), KArg::F32(max_norm), KArg::Ptr(norm), KArg::Ptr(coef)];
    rt.launch(stream, "grad_norm_f64", Grid::new(1, 256), &norm_args)?;
    rt.launch(stream, "scale_by_f32", list.grid(rt), &over_chunks(coef))
}

#[cfg(test)]
mod tests {
    use super::{chunk_list, CHUNK};

    #[test]
    fn chunks_cover_every_element_once() {
        let (t, s) = chunk_list(&[CHUNK + 1, 0, 5, 2 * CHUNK]);
        assert_eq!(t, vec![0, 0, 2, 3, 3]);
        assert_eq!(s, vec![0, CHUNK as i64, 0, 0, CHUNK as i64]);
    }
}
