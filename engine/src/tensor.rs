//! Element types and owned host tensors (constants, initializers, folded values).

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    I64,
    I32,
    Bool,
    U8,
    I8,
    /// bfloat16 (ONNX BFLOAT16): the 16-bit activations of mixed-precision plans
    BF16,
    /// IEEE half (ONNX FLOAT16)
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::BF16 | DType::F16 => 2,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }
    /// A 16-bit float type (bf16 or fp16): stored in 16 bits, computed in f32.
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }
    /// The ONNX TensorProto.DataType code.
    pub fn onnx_code(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::Bool => 9,
            DType::F64 => 11,
            DType::F16 => 10,
            DType::BF16 => 16,
        }
    }
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            6 => DType::I32,
            7 => DType::I64,
            9 => DType::Bool,
            11 => DType::F64,
            10 => DType::F16,
            16 => DType::BF16,
            _ => return None,
        })
    }
    pub fn from_name(name: &str) -> Option<DType> {
        [DType::F32, DType::F64, DType::I64, DType::I32, DType::Bool, DType::U8, DType::I8, DType::BF16, DType::F16]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

/// Typed storage of a host tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    Bool(Vec<u8>),
    U8(Vec<u8>),
    I8(Vec<i8>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Data) -> Result<Tensor> {
        let t = Tensor { shape, data };
        if t.len() != t.numel() {
            return Err(Error::other(format!("tensor of shape {:?} needs {} elements, got {}", t.shape, t.numel(), t.len())));
        }
        Ok(t)
    }
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Tensor {
        let n: usize = shape.iter().product();
        let data = match dtype {
            DType::F32 => Data::F32(vec![0.0; n]),
            DType::F64 => Data::F64(vec![0.0; n]),
            DType::I64 => Data::I64(vec![0; n]),
            DType::I32 => Data::I32(vec![0; n]),
            DType::Bool => Data::Bool(vec![0; n]),
            DType::U8 => Data::U8(vec![0; n]),
            DType::I8 => Data::I8(vec![0; n]),
            DType::BF16 => Data::BF16(vec![half::bf16::ZERO; n]),
            DType::F16 => Data::F16(vec![half::f16::ZERO; n]),
        };
        Tensor { shape, data }
    }
    pub fn scalar_f32(v: f32) -> Tensor {
        Tensor { shape: vec![], data: Data::F32(vec![v]) }
    }
    pub fn from_i64(shape: Vec<usize>, v: Vec<i64>) -> Tensor {
        Tensor { shape, data: Data::I64(v) }
    }
    pub fn from_f32(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        Tensor { shape, data: Data::F32(v) }
    }
    pub fn dtype(&self) -> DType {
        match &self.data {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::I64(_) => DType::I64,
            Data::I32(_) => DType::I32,
            Data::Bool(_) => DType::Bool,
            Data::U8(_) => DType::U8,
            Data::I8(_) => DType::I8,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::Bool(v) | Data::U8(v) => v.len(),
            Data::I8(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F16(v) => v.len(),
        }
    }
    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype().size()
    }
    /// Raw bytes of the elements, in native (little-endian) order.
    pub fn as_bytes(&self) -> &[u8] {
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: plain-old-data element types; the byte view covers exactly the vector's
            // initialised elements and lives as long as the borrow of `v`.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        match &self.data {
            Data::F32(v) => bytes(v),
            Data::F64(v) => bytes(v),
            Data::I64(v) => bytes(v),
            Data::I32(v) => bytes(v),
            Data::Bool(v) | Data::U8(v) => v,
            Data::I8(v) => bytes(v),
            Data::BF16(v) => bytes(v),
            Data::F16(v) => bytes(v),
        }
    }
    /// Mutable raw bytes of the elements.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        fn bytes<T>(v: &mut [T]) -> &mut [u8] {
            // SAFETY: plain-old-data element types (every bit pattern is valid); the byte view
            // covers exactly the vector's elements and holds the unique borrow of `v`.
            unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
        }
        match &mut self.data {
            Data::F32(v) => bytes(v),
            Data::F64(v) => bytes(v),
            Data::I64(v) => bytes(v),
            Data::I32(v) => bytes(v),
            Data::Bool(v) | Data::U8(v) => v,
            Data::I8(v) => bytes(v),
            Data::BF16(v) => bytes(v),
            Data::F16(v) => bytes(v),
        }
    }
    /// Builds a tensor from little-endian raw bytes.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, raw: &[u8]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if raw.len() != n * dtype.size() {
            return Err(Error::other(format!(
                "raw data has {} bytes, shape {:?} of {} needs {}",
                raw.len(),
                shape,
                dtype.name(),
                n * dtype.size()
            )));
        }
        macro_rules! conv {
            ($t:ty, $w:literal) => {
                raw.chunks_exact($w).map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or([0; $w]))).collect()
            };
        }
        let data = match dtype {
            DType::F32 => Data::F32(conv!(f32, 4)),
            DType::F64 => Data::F64(conv!(f64, 8)),
            DType::I64 => Data::I64(conv!(i64, 8)),
            DType::I32 => Data::I32(conv!(i32, 4)),
            DType::Bool => Data::Bool(raw.iter().map(|&b| (b != 0) as u8).collect()),
            DType::U8 => Data::U8(raw.to_vec()),
            DType::I8 => Data::I8(raw.iter().map(|&b| b as i8).collect()),
            DType::BF16 => Data::BF16(raw.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()),
            DType::F16 => Data::F16(raw.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()),
        };
        Ok(Tensor { shape, data })
    }
    /// The elements as i64 (integer and bool tensors; used for shape arithmetic).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match &self.data {
            Data::I64(v) => v.clone(),
            Data::I32(v) => v.iter().map(|&x| x as i64).collect(),
            Data::Bool(v) | Data::U8(v) => v.iter().map(|&x| x as i64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as i64).collect(),
            Data::F32(_) | Data::F64(_) | Data::BF16(_) | Data::F16(_) => return None,
        })
    }
    /// The elements as f64 (any dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F64(v) => v.clone(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) | Data::U8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }
}
