//! What the case-folder tests (node_cases.rs, grad_cases.rs) share: a folder named by an
//! environment variable and written by a Python exporter, its `cases.txt` list, tensors stored
//! as TensorProto files, and the tally of a run in which a few cases are expected to be refused
//! with a given error.

use std::path::{Path, PathBuf};

use prost::Message;

use crate::onnx::proto::TensorProto;
use crate::tensor::Tensor;

/// The folder `var` names; panics with how to write it (`how`) when unset.
pub fn cases_dir(var: &str, how: &str) -> PathBuf {
    PathBuf::from(std::env::var(var).unwrap_or_else(|_| panic!("set {var} to a folder written by `{how}`")))
}

/// The case names of `dir/cases.txt`, one per non-empty line; at least `min` of them.
pub fn case_names(dir: &Path, min: usize) -> Vec<String> {
    let path = dir.join("cases.txt");
    let list = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let names: Vec<String> = list.lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    assert!(names.len() >= min, "{}: only {} cases", dir.display(), names.len());
    names
}

/// A TensorProto file's tensor; None when there is no such file.
pub fn read_tensor(path: &Path) -> Option<Tensor> {
    let bytes = std::fs::read(path).ok()?;
    let proto = TensorProto::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Some(crate::onnx::tensor_from_proto(&proto, None, &path.display().to_string()).unwrap_or_else(|e| panic!("{e}")))
}

/// The outcome of a run over the cases.
#[derive(Default)]
pub struct Tally {
    pub failed: Vec<String>,
    pub refused: usize,
}

impl Tally {
    /// Records case `name`: `problem` (None: it passed) against `refusal`, the part of the error
    /// the case is expected to fail with (None: it must pass). An expected refusal counts as
    /// refused; any other problem, or a refused case that passes, as a failure.
    pub fn record(&mut self, name: &str, problem: Option<String>, refusal: Option<&str>) {
        match (problem, refusal) {
            (Some(why), Some(expected)) if why.contains(expected) => {
                println!("refused as expected: {name}: {why}");
                self.refused += 1;
            }
            (Some(why), _) => {
                println!("FAIL {name}: {why}");
                self.failed.push(format!("{name}: {why}"));
            }
            (None, Some(_)) => self.failed.push(format!("{name}: passes now; take it off the expected refusals")),
            (None, None) => {}
        }
    }
}
