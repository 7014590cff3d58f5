//! TensorProto <-> host Tensor, including external data files.

use std::path::Path;

use super::proto::{data_type, TensorProto};
use crate::error::{Error, Result};
use crate::tensor::{DType, Data, Tensor};

/// Decodes a TensorProto; `base_dir` resolves external data locations. `field` names the place in
/// the model for error messages (e.g. "graph.initializer[3] 'fc.weight'").
pub fn tensor_from_proto(t: &TensorProto, base_dir: Option<&Path>, field: &str) -> Result<Tensor> {
    let dtype = DType::from_onnx(t.data_type).ok_or_else(|| {
        let what = match t.data_type {
            data_type::FLOAT16 => "float16".to_string(),
            data_type::BFLOAT16 => "bfloat16".to_string(),
            other => format!("code {other}"),
        };
        Error::onnx(format!("{field}.data_type"), format!("element type {what} is not supported yet"))
    })?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        if d < 0 {
            return Err(Error::onnx(format!("{field}.dims"), format!("negative dimension {d}")));
        }
        shape.push(d as usize);
    }
    let n: usize = shape.iter().product();
    if t.data_location == 1 {
        let raw = read_external(t, base_dir, field)?;
        return Tensor::from_bytes(dtype, shape, &raw).map_err(|e| Error::onnx(format!("{field}.external_data"), e.to_string()));
    }
    if !t.raw_data.is_empty() || n == 0 {
        return Tensor::from_bytes(dtype, shape, &t.raw_data).map_err(|e| Error::onnx(format!("{field}.raw_data"), e.to_string()));
    }
    let data = match dtype {
        DType::F32 => Data::F32(t.float_data.clone()),
        DType::F64 => Data::F64(t.double_data.clone()),
        DType::I64 => Data::I64(t.int64_data.clone()),
        DType::I32 => Data::I32(t.int32_data.clone()),
        DType::Bool => Data::Bool(t.int32_data.iter().map(|&x| (x != 0) as u8).collect()),
        DType::U8 => Data::U8(t.int32_data.iter().map(|&x| x as u8).collect()),
        DType::I8 => Data::I8(t.int32_data.iter().map(|&x| x as i8).collect()),
        // 16-bit floats are stored as their bit patterns in int32_data
        DType::BF16 => Data::BF16(t.int32_data.iter().map(|&x| half::bf16::from_bits(x as u16)).collect()),
        DType::F16 => Data::F16(t.int32_data.iter().map(|&x| half::f16::from_bits(x as u16)).collect()),
    };
    Tensor::new(shape, data).map_err(|e| Error::onnx(format!("{field} typed data"), e.to_string()))
}

fn read_external(t: &TensorProto, base_dir: Option<&Path>, field: &str) -> Result<Vec<u8>> {
    let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.as_str());
    let location = get("location").ok_or_else(|| Error::onnx(format!("{field}.external_data"), "no 'location' entry"))?;
    let parse = |k: &str| -> Result<Option<u64>> {
        get(k)
            .map(|v| v.parse::<u64>().map_err(|_| Error::onnx(format!("{field}.external_data.{k}"), format!("not a number: {v:?}"))))
            .transpose()
    };
    let offset = parse("offset")?.unwrap_or(0);
    let length = parse("length")?;
    if Path::new(location).is_absolute() || location.split(['/', '\\']).any(|c| c == "..") {
        return Err(Error::onnx(
            format!("{field}.external_data.location"),
            format!("{location:?} must be a relative path inside the model's folder"),
        ));
    }
    let base = base_dir.ok_or_else(|| {
        Error::onnx(format!("{field}.external_data"), "external data needs the model loaded from a file (its folder holds the data)")
    })?;
    let path = base.join(location);
    let bytes =
        std::fs::read(&path).map_err(|e| Error::onnx(format!("{field}.external_data.location"), format!("{}: {e}", path.display())))?;
    let start = offset as usize;
    let end = match length {
        Some(l) => start + l as usize,
        None => bytes.len(),
    };
    if start > end || end > bytes.len() {
        return Err(Error::onnx(
            format!("{field}.external_data"),
            format!("offset {start}..{end} is past the end of {} ({} bytes)", path.display(), bytes.len()),
        ));
    }
    Ok(bytes[start..end].to_vec())
}

pub fn tensor_to_proto(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        dims: t.shape.iter().map(|&d| d as i64).collect(),
        data_type: t.dtype().onnx_code(),
        name: name.to_string(),
        raw_data: t.as_bytes().to_vec(),
        ..Default::default()
    }
}
