//! ONNX: protobuf messages (prost, no protoc), import into the IR, export back to ONNX.

mod export;
mod import;
pub mod pad;
pub mod proto;
pub mod recompute_meta;
mod sequence;
mod tensor_proto;
pub mod variadic;

pub use export::export_model;
pub use import::{import_bytes, import_file, ImportOptions};
pub use tensor_proto::{tensor_from_proto, tensor_to_proto};
