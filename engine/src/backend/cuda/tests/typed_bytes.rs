//! Tensors as typed bytes for the parity tests: a kernel dtype suffix's size, encoding and
//! decoding, CPU tensors built from and read back to those bytes, numpy broadcasting's shapes and
//! strides, and byte-exact or tolerance comparisons of two outputs.

use super::support::{assert_close, bf16_bits, bf16_value, f16_bits, f16_value, rtol, Rng};
use crate::backend::cuda::abi::{Strides, MAX_DIMS};
use crate::tensor::{DType, Tensor};

/// numpy broadcast of `shapes` (right-aligned; a 1 or a missing dimension stretches).
pub fn bshape(shapes: &[&[usize]]) -> Vec<usize> {
    let r = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; r];
    for s in shapes {
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[r - s.len() + i];
            assert!(d == *o || d == 1 || *o == 1, "shapes {shapes:?} do not broadcast");
            if d != 1 {
                *o = d;
            }
        }
    }
    out
}

/// Contiguous element strides of `shape`.
pub fn contiguous(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as i64;
    }
    s
}

/// `Strides` of a contiguous output `out` (not collapsed) whose operands 0, 1, 2 are contiguous
/// tensors of `shapes` broadcast to it: stride 0 on a dimension of size 1 or missing; bases 0.
pub fn bcast(out: &[usize], shapes: &[&[usize]]) -> Strides {
    assert!(out.len() <= MAX_DIMS && shapes.len() <= 3, "rank {} / {} operands", out.len(), shapes.len());
    let mut s = Strides { rank: out.len() as i32, ..Default::default() };
    for (d, &n) in out.iter().enumerate() {
        s.dims[d] = n as i64;
    }
    for (k, sh) in shapes.iter().enumerate() {
        let (off, cs) = (out.len() - sh.len(), contiguous(sh));
        for i in 0..sh.len() {
            assert!(sh[i] == out[off + i] || sh[i] == 1, "{sh:?} does not broadcast to {out:?}");
            s.stride[k][off + i] = if sh[i] == 1 { 0 } else { cs[i] };
        }
    }
    s
}

/// Bytes per element of a kernel dtype suffix (bool is one byte).
pub fn size_of(t: &str) -> usize {
    match t {
        "f64" | "i64" | "u64" => 8,
        "f32" | "i32" | "u32" => 4,
        "bf16" | "f16" | "u16" => 2,
        "u8" | "i8" | "bool" => 1,
        _ => panic!("unknown dtype {t}"),
    }
}

pub fn is_float(t: &str) -> bool {
    matches!(t, "f32" | "f64" | "bf16" | "f16")
}

/// `vals` stored as kernel dtype `t`: 16-bit floats rounded to nearest even, integers by Rust
/// `as` (so saturating), bool as `!= 0`.
pub fn encode(t: &str, vals: &[f64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(vals.len() * size_of(t));
    for &v in vals {
        match t {
            "f64" => b.extend(v.to_le_bytes()),
            "f32" => b.extend((v as f32).to_le_bytes()),
            "bf16" => b.extend(bf16_bits(v as f32).to_le_bytes()),
            "f16" => b.extend(f16_bits(v as f32).to_le_bytes()),
            "i64" | "u64" => b.extend((v as i64).to_le_bytes()),
            "i32" | "u32" => b.extend((v as i32).to_le_bytes()),
            "u16" => b.extend((v as u16).to_le_bytes()),
            "u8" => b.push(v as u8),
            "i8" => b.push(v as i8 as u8),
            "bool" => b.push((v != 0.0) as u8),
            _ => panic!("unknown dtype {t}"),
        }
    }
    b
}

/// Elements of dtype `t` as f64 (exact except i64/u64 beyond 2^53).
pub fn decode(t: &str, b: &[u8]) -> Vec<f64> {
    let w = size_of(t);
    assert_eq!(b.len() % w, 0);
    b.chunks_exact(w)
        .map(|c| match t {
            "f64" => f64::from_le_bytes(c.try_into().unwrap()),
            "f32" => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            "bf16" => bf16_value(u16::from_le_bytes(c.try_into().unwrap())) as f64,
            "f16" => f16_value(u16::from_le_bytes(c.try_into().unwrap())) as f64,
            "i64" => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            "u64" => u64::from_le_bytes(c.try_into().unwrap()) as f64,
            "i32" => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            "u32" => u32::from_le_bytes(c.try_into().unwrap()) as f64,
            "u16" => u16::from_le_bytes(c.try_into().unwrap()) as f64,
            "u8" | "bool" => c[0] as f64,
            "i8" => c[0] as i8 as f64,
            _ => panic!("unknown dtype {t}"),
        })
        .collect()
}

/// The CPU reference's dtype for kernel dtype `t`: bf16/f16 are computed in F32.
pub fn cpu_dtype(t: &str) -> DType {
    match t {
        "f32" | "bf16" | "f16" => DType::F32,
        "f64" => DType::F64,
        "i64" => DType::I64,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "i8" => DType::I8,
        "bool" => DType::Bool,
        _ => panic!("no CPU dtype for {t}"),
    }
}

/// A CPU tensor of the elements in `bytes` (dtype `t`); 16-bit floats become F32 of the same
/// values (exact).
pub fn cpu_tensor(t: &str, shape: &[usize], bytes: &[u8]) -> Tensor {
    match t {
        "bf16" | "f16" => Tensor::from_f32(shape.to_vec(), decode(t, bytes).into_iter().map(|v| v as f32).collect()),
        _ => Tensor::from_bytes(cpu_dtype(t), shape.to_vec(), bytes).unwrap_or_else(|e| panic!("{e}")),
    }
}

/// A CPU result as dtype-`t` bytes: for bf16/f16 the F32 result rounded to nearest even (what
/// the kernel's store does), otherwise the tensor's own bytes.
pub fn cpu_bytes(t: &str, r: &Tensor) -> Vec<u8> {
    match t {
        "bf16" | "f16" => encode(t, &r.to_f64_vec()),
        _ => {
            assert_eq!(r.dtype(), cpu_dtype(t), "the CPU reference has dtype {:?}, expected {t}", r.dtype());
            r.as_bytes().to_vec()
        }
    }
}

/// Asserts dtype-`t` elements are identical (floats: same value or both NaN, so -0 == 0 is not
/// accepted either: bits must match except NaN payloads), naming the first mismatch.
pub fn assert_same(what: &str, t: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: {} bytes, expected {}", got.len(), want.len());
    let w = size_of(t);
    let (gv, wv) = (decode(t, got), decode(t, want));
    for (i, (g, e)) in got.chunks_exact(w).zip(want.chunks_exact(w)).enumerate() {
        let ok = g == e || (is_float(t) && gv[i].is_nan() && wv[i].is_nan());
        assert!(ok, "{what}: element {i}: got {} (bytes {g:02x?}), expected {} (bytes {e:02x?})", gv[i], wv[i]);
    }
}

/// `assert_close` of dtype-`t` elements with the dtype's `rtol` and the given `atol`; exact
/// (assert_same) for non-float dtypes.
pub fn assert_close_t(what: &str, t: &str, got: &[u8], want: &[u8], atol: f64) {
    if is_float(t) {
        assert_close(what, &decode(t, got), &decode(t, want), rtol(t), atol);
    } else {
        assert_same(what, t, got, want);
    }
}

/// Random elements of a bit-moving width `w` (u8 u16 u32 u64), as i64 (the CPU reference runs
/// the op on I64 tensors: the op only moves values), and the same as dtype-`w` bytes.
pub fn random_bits(rng: &mut Rng, w: &str, n: usize) -> (Vec<i64>, Vec<u8>) {
    let bits = 8 * size_of(w) as u32;
    let v: Vec<i64> = (0..n).map(|_| if bits == 64 { rng.next_u64() as i64 } else { (rng.next_u64() >> (64 - bits)) as i64 }).collect();
    let b = narrow(w, &v);
    (v, b)
}

/// i64 values truncated to width `w`, as bytes.
pub fn narrow(w: &str, v: &[i64]) -> Vec<u8> {
    let k = size_of(w);
    v.iter().flat_map(|x| x.to_le_bytes()[..k].to_vec()).collect()
}

/// An I64 CPU tensor.
pub fn i64_tensor(shape: &[usize], v: Vec<i64>) -> Tensor {
    Tensor::from_i64(shape.to_vec(), v)
}
