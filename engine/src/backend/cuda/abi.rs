//! The launch ABI shared with kernels/*.cu: the `#[repr(C)]` mirrors of the structs the kernels
//! take by value or read from device memory, and the parameter kinds of every kernel signature.
//! The registry gives each group of kernels its signature ([`Arg`] list); a test compares the
//! C layout computed here with the parameter layout NVRTC wrote into each CUBIN
//! (`.nv.info`, see [`super::elf::kernel_params`]), so a struct or signature that drifts on one
//! side fails without a GPU.

/// Dimensions of `Strides` / `Reduce` (kernels/prelude.cuh `ORT_MAX_DIMS`).
pub const MAX_DIMS: usize = 8;

/// kernels/prelude.cuh `Strides`: a contiguous index space of `dims` and, per operand, element
/// strides (0 on broadcast dimensions, negative allowed) and a base offset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strides {
    pub rank: i32,
    pub dims: [i64; MAX_DIMS],
    pub stride: [[i64; MAX_DIMS]; 3],
    pub base: [i64; 3],
}

/// kernels/reduce.cu `Reduce`: kept (output) and reduced dimensions with their input strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reduce {
    pub out_rank: i32,
    pub red_rank: i32,
    pub out_dims: [i64; MAX_DIMS],
    pub out_stride: [i64; MAX_DIMS],
    pub red_dims: [i64; MAX_DIMS],
    pub red_stride: [i64; MAX_DIMS],
    pub outputs: i64,
    pub count: i64,
}

/// kernels/attention.cu `AttnShape`: the full batch (padded to 4 dims with leading 1s), each
/// input's batch strides (0 where broadcast), the matrix sizes and the mask's row/column strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnShape {
    pub dims: [i64; 4],
    pub q: [i64; 4],
    pub k: [i64; 4],
    pub v: [i64; 4],
    pub m: [i64; 4],
    pub t: i64,
    pub s: i64,
    pub d: i64,
    pub dv: i64,
    pub mask_t: i64,
    pub mask_s: i64,
}

/// kernels/prelude.cuh `Win2d`: a sliding window over two spatial axes (Conv's im2col, the
/// pools), from `crate::ops::window::Window::as_2d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Win2d {
    pub channels: i64,
    pub in_h: i64,
    pub in_w: i64,
    pub out_h: i64,
    pub out_w: i64,
    pub k_h: i64,
    pub k_w: i64,
    pub stride_h: i64,
    pub stride_w: i64,
    pub dil_h: i64,
    pub dil_w: i64,
    pub pad_h: i64,
    pub pad_w: i64,
    pub pad_end_h: i64,
    pub pad_end_w: i64,
}

impl Win2d {
    /// The kernels' view of `w` (any rank up to 2: a 1-D window gets a height of 1) over
    /// `channels` channels.
    pub fn new(w: &crate::ops::window::Window, channels: usize) -> Win2d {
        let w = w.as_2d();
        let i = |v: usize| v as i64;
        Win2d {
            channels: i(channels),
            in_h: i(w.input[0]),
            in_w: i(w.input[1]),
            out_h: i(w.output[0]),
            out_w: i(w.output[1]),
            k_h: i(w.kernel[0]),
            k_w: i(w.kernel[1]),
            stride_h: i(w.strides[0]),
            stride_w: i(w.strides[1]),
            dil_h: i(w.dilations[0]),
            dil_w: i(w.dilations[1]),
            pad_h: i(w.pad_begin[0]),
            pad_w: i(w.pad_begin[1]),
            pad_end_h: i(w.pad_end[0]),
            pad_end_w: i(w.pad_end[1]),
        }
    }
}

/// kernels/optim.cu `AdamTensor` (in device memory; pointers are device addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AdamTensor {
    pub p: u64,
    pub g: u64,
    pub m: u64,
    pub v: u64,
    pub n: i64,
}

/// kernels/optim.cu `SgdTensor` (`buf` 0: no momentum buffer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SgdTensor {
    pub p: u64,
    pub g: u64,
    pub buf: u64,
    pub n: i64,
}

/// kernels/optim.cu `GradTensor`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GradTensor {
    pub g: u64,
    pub n: i64,
}

/// One kernel parameter, as the host passes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    /// A device pointer (8 bytes).
    Ptr,
    I32,
    I64,
    U64,
    F32,
    F64,
    Strides,
    Reduce,
    AttnShape,
    Win2d,
}

impl Arg {
    pub fn size(self) -> usize {
        match self {
            Arg::I32 | Arg::F32 => 4,
            Arg::Ptr | Arg::I64 | Arg::U64 | Arg::F64 => 8,
            Arg::Strides => std::mem::size_of::<Strides>(),
            Arg::Reduce => std::mem::size_of::<Reduce>(),
            Arg::AttnShape => std::mem::size_of::<AttnShape>(),
            Arg::Win2d => std::mem::size_of::<Win2d>(),
        }
    }
    pub fn align(self) -> usize {
        match self {
            Arg::Strides => std::mem::align_of::<Strides>(),
            Arg::Reduce => std::mem::align_of::<Reduce>(),
            Arg::AttnShape => std::mem::align_of::<AttnShape>(),
            Arg::Win2d => std::mem::align_of::<Win2d>(),
            scalar => scalar.size(),
        }
    }
}

/// (offset, size) of each parameter in the kernel parameter buffer, by C layout rules.
pub fn layout(args: &[Arg]) -> Vec<(usize, usize)> {
    let mut at = 0usize;
    args.iter()
        .map(|a| {
            at = at.div_ceil(a.align()) * a.align();
            let r = (at, a.size());
            at += a.size();
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_match_the_c_layouts() {
        // i32 + pad + 8 + 24 + 3 i64
        assert_eq!(std::mem::size_of::<Strides>(), 8 + 8 * 8 + 3 * 8 * 8 + 3 * 8);
        assert_eq!(std::mem::size_of::<Reduce>(), 8 + 4 * 8 * 8 + 2 * 8);
        assert_eq!(std::mem::size_of::<AttnShape>(), 26 * 8);
        assert_eq!(std::mem::size_of::<Win2d>(), 15 * 8);
        assert_eq!(std::mem::size_of::<AdamTensor>(), 40);
        assert_eq!(std::mem::size_of::<SgdTensor>(), 32);
        assert_eq!(std::mem::size_of::<GradTensor>(), 16);
    }

    #[test]
    fn layout_aligns_each_parameter() {
        use Arg::*;
        assert_eq!(layout(&[Ptr, I32, I64, F32, Strides]), vec![(0, 8), (8, 4), (16, 8), (24, 4), (32, 288)]);
    }
}
