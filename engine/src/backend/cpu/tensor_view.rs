//! Views of tensors in arena or borrowed memory, as kernels see them: element type, shape and a
//! raw pointer. Typed slices are handed out after checking the element type.

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Element types kernels are generic over.
pub trait Elem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
}
macro_rules! elem {
    ($t:ty, $d:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
        }
    };
}
elem!(f32, F32);
elem!(f64, F64);
elem!(i64, I64);
elem!(i32, I32);
elem!(u8, U8);
elem!(i8, I8);
elem!(half::bf16, BF16);
elem!(half::f16, F16);

/// Read-only input view.
#[derive(Clone, Copy, Debug)]
pub struct In<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    ptr: *const u8,
}

// SAFETY: an `In` is a read-only view; the executor guarantees that no kernel writes the memory
// while views of it exist (the memory plan never overlaps live tensors).
unsafe impl Send for In<'_> {}
unsafe impl Sync for In<'_> {}

/// Output view, written by exactly one kernel.
#[derive(Debug)]
pub struct Out<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    ptr: *mut u8,
}

// SAFETY: see `In`; an output range is written only by the kernel that owns this view.
unsafe impl Send for Out<'_> {}
unsafe impl Sync for Out<'_> {}

fn check(dtype: DType, want: DType) -> Result<()> {
    if dtype == want || (dtype == DType::Bool && want == DType::U8) {
        Ok(())
    } else {
        Err(Error::other(format!("kernel expected {} data, got {}", want.name(), dtype.name())))
    }
}

impl<'a> In<'a> {
    /// # Safety
    /// `ptr` must point to `numel(shape) * dtype.size()` readable bytes, aligned for `dtype`,
    /// valid and unmodified for `'a`.
    pub unsafe fn from_raw(dtype: DType, shape: &'a [usize], ptr: *const u8) -> Self {
        In { dtype, shape, ptr }
    }
    pub fn of(t: &'a Tensor) -> Self {
        In { dtype: t.dtype(), shape: &t.shape, ptr: t.as_bytes().as_ptr() }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The addresses of the bytes this view covers.
    pub fn addr_range(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.numel() * self.dtype.size()
    }
    pub fn slice<T: Elem>(&self) -> Result<&'a [T]> {
        check(self.dtype, T::DTYPE)?;
        if self.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: the constructor's contract: numel elements of T, aligned, live for 'a.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.numel()) })
    }
    pub fn bytes(&self) -> &'a [u8] {
        // SAFETY: as for `slice`, viewed as bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.numel() * self.dtype.size()) }
    }
    /// The same memory under another shape of as many elements.
    pub fn reshaped<'b>(&self, shape: &'b [usize]) -> In<'b>
    where
        'a: 'b,
    {
        assert_eq!(shape.iter().product::<usize>(), self.numel(), "reshape must keep the element count");
        In { dtype: self.dtype, shape, ptr: self.ptr }
    }
    /// Reads the tensor into an owned host Tensor.
    pub fn to_tensor(&self) -> Tensor {
        Tensor::from_bytes(self.dtype, self.shape.to_vec(), self.bytes()).expect("sizes match by construction")
    }
}

impl<'a> Out<'a> {
    /// # Safety
    /// `ptr` must point to `numel(shape) * dtype.size()` writable bytes, aligned for `dtype`,
    /// not read or written by anyone else for `'a`.
    pub unsafe fn from_raw(dtype: DType, shape: &'a [usize], ptr: *mut u8) -> Self {
        Out { dtype, shape, ptr }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The addresses of the bytes this view covers.
    pub fn addr_range(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.numel() * self.dtype.size()
    }
    /// A second view of the same output, borrowing this one.
    pub fn reborrow(&mut self) -> Out<'_> {
        Out { dtype: self.dtype, shape: self.shape, ptr: self.ptr }
    }
    /// What the output's memory holds now, as an input view borrowing this one.
    pub fn as_input(&mut self) -> In<'_> {
        In { dtype: self.dtype, shape: self.shape, ptr: self.ptr }
    }
    pub fn slice<T: Elem>(&mut self) -> Result<&mut [T]> {
        check(self.dtype, T::DTYPE)?;
        if self.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the constructor's contract: exclusive, aligned, numel elements of T.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.numel()) })
    }
    /// The same memory under another shape of as many elements (borrowing this view).
    pub fn reshaped<'b>(&'b mut self, shape: &'b [usize]) -> Out<'b> {
        assert_eq!(shape.iter().product::<usize>(), self.numel(), "reshape must keep the element count");
        Out { dtype: self.dtype, shape, ptr: self.ptr }
    }
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: as for `slice`, viewed as bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.numel() * self.dtype.size()) }
    }
}

/// Dispatches a generic kernel body over the float types.
#[macro_export]
macro_rules! dispatch_float {
    ($dtype:expr, $node:expr, $f:ident :: <T> ($($arg:expr),*)) => {
        match $dtype {
            $crate::tensor::DType::F32 => $f::<f32>($($arg),*),
            $crate::tensor::DType::F64 => $f::<f64>($($arg),*),
            d => Err($node.err(format!("element type {} is not supported by this kernel", d.name()))),
        }
    };
}

/// Dispatches a generic kernel body over every numeric type.
#[macro_export]
macro_rules! dispatch_num {
    ($dtype:expr, $node:expr, $f:ident :: <T> ($($arg:expr),*)) => {
        match $dtype {
            $crate::tensor::DType::F32 => $f::<f32>($($arg),*),
            $crate::tensor::DType::F64 => $f::<f64>($($arg),*),
            $crate::tensor::DType::I64 => $f::<i64>($($arg),*),
            $crate::tensor::DType::I32 => $f::<i32>($($arg),*),
            $crate::tensor::DType::U8 | $crate::tensor::DType::Bool => $f::<u8>($($arg),*),
            $crate::tensor::DType::I8 => $f::<i8>($($arg),*),
            d @ ($crate::tensor::DType::BF16 | $crate::tensor::DType::F16) => Err($node.err(format!(
                "element type {} reached a kernel without 16-bit floats (they run widened to f32: backend/cpu/widen.rs)",
                d.name()
            ))),
        }
    };
}
