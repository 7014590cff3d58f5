//! The launch ABI shared with kernels/*.cu: the `#[repr(C)]` mirrors of the structs the kernels
//! take by value or read from device memory, and the parameter kinds of every kernel signature.
//! The registry gives each group of kernels its signature ([`Arg`] list); a test compares the
//! C layout computed here with the parameter layout NVRTC wrote into each CUBIN
//! (`.nv.info`, see [`super::elf::kernel_params`]), so a struct or signature that drifts on one
//! side fails without a GPU.

/// Dimensions of `Strides` / `Reduce` (kernels/prelude.cuh `ORT_MAX_DIMS`).
pub const MAX_DIMS: usize = 8;

/// kernels/prelude.cuh `Strides`: a contiguous index space of `dims` and, per operand, element
/// strides (0 on broadcast dimensions, negative allowed) and a base offset. `magic`, `shift`
/// and `narrow` are filled at launch ([`Strides::fill_dividers`]) from `dims`; left at zero,
/// the kernels divide in 64 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strides {
    pub rank: i32,
    pub dims: [i64; MAX_DIMS],
    pub stride: [[i64; MAX_DIMS]; 3],
    pub base: [i64; 3],
    pub magic: [u32; MAX_DIMS],
    pub shift: [u32; MAX_DIMS],
    pub narrow: i32,
}

/// Largest numerator (and divisor) for which [`divider`]'s multiply-and-shift is exact.
pub const NARROW_LIMIT: u64 = 1 << 31;

/// (magic, shift) such that ⌊j / d⌋ = (umulhi(j, magic) + j) >> shift for every j < 2³¹, for
/// 1 ≤ d ≤ 2³¹ (Granlund and Montgomery's division by invariant integers, with the sum kept in
/// 32 bits because j < 2³¹): shift = ⌈log₂ d⌉, magic = ⌊2³²·(2^shift − d)/d⌋ + 1.
/// None outside that range. A 64-bit division is a long software sequence on the GPU; this is
/// a multiply-high and an add, once per dimension and element of every strided kernel.
pub fn divider(d: u64) -> Option<(u32, u32)> {
    if d == 0 || d > NARROW_LIMIT {
        return None;
    }
    let shift = 64 - (d - 1).leading_zeros();
    let magic = ((1u64 << 32) * ((1u64 << shift) - d)) / d + 1;
    Some((u32::try_from(magic).ok()?, shift))
}

/// The quotient the kernels' narrow path computes (prelude.cuh `strided_offsets`).
pub fn narrow_quotient(j: u32, magic: u32, shift: u32) -> u32 {
    let hi = ((j as u64 * magic as u64) >> 32) as u32;
    hi.wrapping_add(j) >> shift
}

impl Strides {
    /// Fills the per-dimension dividers from `dims` and sets `narrow` when every dimension has
    /// one (the kernels then divide indices below 2³¹ by multiplying); otherwise clears
    /// `narrow`, and the kernels divide in 64 bits.
    pub fn fill_dividers(&mut self) {
        self.narrow = 0;
        let rank = (self.rank.max(0) as usize).min(MAX_DIMS);
        for d in 0..rank {
            match divider(self.dims[d].max(0) as u64) {
                Some((m, s)) => (self.magic[d], self.shift[d]) = (m, s),
                None => return,
            }
        }
        self.narrow = 1;
    }

    /// Host mirror of prelude.cuh `strided_offsets` on the launched value (dividers filled as a
    /// launch fills them): the offsets of index-space element `i` in operands 0..3. Dry runs of
    /// the GPU tests emulate the bit-moving kernels with it.
    #[cfg(test)]
    pub fn offsets(&self, i: i64) -> [i64; 3] {
        let mut s = *self;
        s.fill_dividers();
        let mut off = s.base;
        let rank = s.rank.max(0) as usize;
        if rank <= 1 {
            for (k, o) in off.iter_mut().enumerate() {
                *o += i * s.stride[k][0];
            }
            return off;
        }
        if s.narrow != 0 && (i as u64) < NARROW_LIMIT {
            let mut j = i as u32;
            for d in (0..rank).rev() {
                let q = narrow_quotient(j, s.magic[d], s.shift[d]);
                let c = j.wrapping_sub(q.wrapping_mul(s.dims[d] as u32));
                j = q;
                for (k, o) in off.iter_mut().enumerate() {
                    *o += c as i64 * s.stride[k][d];
                }
            }
            return off;
        }
        let mut i = i;
        for d in (0..rank).rev() {
            let (q, c) = (i / s.dims[d], i % s.dims[d]);
            i = q;
            for (k, o) in off.iter_mut().enumerate() {
                *o += c * s.stride[k][d];
            }
        }
        off
    }
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

/// kernels/attention.cuh `AttnShape`: the full batch (padded to 4 dims with leading 1s), each
/// input's batch strides (0 where broadcast), those of O/dO and of the three gradients, the
/// matrix sizes, the mask's row/column strides, the strides inside the matrices
/// (`ops::attention::RowStrides`) and the probabilities' dropout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnShape {
    pub dims: [i64; 4],
    pub q: [i64; 4],
    pub k: [i64; 4],
    pub v: [i64; 4],
    pub m: [i64; 4],
    pub o: [i64; 4],
    pub gq: [i64; 4],
    pub gk: [i64; 4],
    pub gv: [i64; 4],
    pub t: i64,
    pub s: i64,
    pub d: i64,
    pub dv: i64,
    pub mask_t: i64,
    pub mask_s: i64,
    pub q_t: i64,
    pub k_s: i64,
    pub k_d: i64,
    pub v_s: i64,
    pub o_t: i64,
    /// The probabilities' dropout: the device address of its stream key (an int64 DropoutKey
    /// wrote; 0: none), its ratio and 1 / (1 − ratio).
    pub drop_key: u64,
    pub drop_p: f32,
    pub drop_scale: f32,
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
        // i32 + pad + 8 + 24 + 3 i64, 8 + 8 u32, i32 + pad
        assert_eq!(std::mem::size_of::<Strides>(), 8 + 8 * 8 + 3 * 8 * 8 + 3 * 8 + 2 * 8 * 4 + 8);
        assert_eq!(std::mem::size_of::<Reduce>(), 8 + 4 * 8 * 8 + 2 * 8);
        assert_eq!(std::mem::size_of::<AttnShape>(), (9 * 4 + 12) * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<Win2d>(), 15 * 8);
        assert_eq!(std::mem::size_of::<AdamTensor>(), 40);
        assert_eq!(std::mem::size_of::<SgdTensor>(), 32);
        assert_eq!(std::mem::size_of::<GradTensor>(), 16);
    }

    #[test]
    fn layout_aligns_each_parameter() {
        use Arg::*;
        assert_eq!(layout(&[Ptr, I32, I64, F32, Strides]), vec![(0, 8), (8, 4), (16, 8), (24, 4), (32, 360)]);
    }

    /// The narrow path's quotients are exact: every divisor up to 4096, the powers of two and
    /// their neighbours, and large divisors, against numerators from 0 up, around multiples of
    /// the divisor and up to 2³¹ − 1.
    #[test]
    fn dividers_give_exact_quotients_below_two_to_the_31() {
        let mut divisors: Vec<u64> = (1..=4096).collect();
        for p in 1..=31 {
            divisors.extend([(1u64 << p) - 1, 1 << p, (1 << p) + 1]);
        }
        divisors.extend([3 * 1024 * 1024, 50257, 16 * 1024 * 768, 1_000_000_007, NARROW_LIMIT - 1]);
        divisors.retain(|&d| d <= NARROW_LIMIT);
        let top = (NARROW_LIMIT - 1) as u32;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for &d in &divisors {
            let (m, s) = divider(d).unwrap_or_else(|| panic!("no divider for {d}"));
            let mut check = |j: u32| assert_eq!(narrow_quotient(j, m, s) as u64, j as u64 / d, "{j} / {d}");
            (0..2048).chain(top - 2048..=top).for_each(&mut check);
            for q in [1u64, 2, 7, 1000, 65_535, 1 << 20] {
                let at = q * d;
                if at < NARROW_LIMIT {
                    (at.saturating_sub(2)..(at + 2).min(NARROW_LIMIT)).for_each(|j| check(j as u32));
                }
            }
            for _ in 0..256 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                check((state % NARROW_LIMIT) as u32);
            }
        }
        assert_eq!(divider(0), None);
        assert_eq!(divider(NARROW_LIMIT + 1), None);
    }

    #[test]
    fn strides_are_narrow_only_when_every_dimension_has_a_divider() {
        let mut s = Strides { rank: 3, ..Default::default() };
        s.dims[..3].copy_from_slice(&[16, 12, 1024]);
        s.fill_dividers();
        assert_eq!((s.narrow, s.shift[2], s.magic[2]), (1, 10, 1));
        s.dims[1] = 1 << 40;
        s.fill_dividers();
        assert_eq!(s.narrow, 0);
    }
}
