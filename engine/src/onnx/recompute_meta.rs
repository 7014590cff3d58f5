//! The checkpointed parts of a model as the exporter records them (pyext export/checkpoints.py):
//! the ModelProto metadata entry `ortrain.recompute_segments`, one part per line,
//! `module path TAB input names TAB output names`, the names separated by U+001F. Read into
//! `Graph::recompute` for passes/recompute_segments.rs.

use super::proto::StringStringEntryProto;
use crate::error::{Error, Result};
use crate::ir::RecomputeSegment;

pub const KEY: &str = "ortrain.recompute_segments";
const NAMES: char = '\u{1f}';

/// The parts listed in the metadata value `text`; an error names the line that is malformed.
pub fn parse(text: &str) -> Result<Vec<RecomputeSegment>> {
    let names = |field: &str| field.split(NAMES).filter(|n| !n.is_empty()).map(str::to_string).collect::<Vec<_>>();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [name, inputs, outputs] = fields[..] else {
            return Err(Error::onnx(
                format!("metadata_props '{KEY}' line {}", i + 1),
                format!("expected 3 tab-separated fields (module, inputs, outputs), got {}", fields.len()),
            ));
        };
        out.push(RecomputeSegment { name: name.to_string(), inputs: names(inputs), outputs: names(outputs) });
    }
    Ok(out)
}

/// The metadata entry listing `parts` (None for none): what `parse` reads back.
pub fn entry(parts: &[RecomputeSegment]) -> Option<StringStringEntryProto> {
    let names = |v: &[String]| v.join(&NAMES.to_string());
    let lines: Vec<String> = parts.iter().map(|p| format!("{}\t{}\t{}", p.name, names(&p.inputs), names(&p.outputs))).collect();
    (!lines.is_empty()).then(|| StringStringEntryProto { key: KEY.into(), value: lines.join("\n") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_read_line_by_line() {
        let parts = parse("layers.0\tx\u{1f}mask\tadd\nlayers.1\tadd\tadd_1\n").expect("parsed");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].inputs, vec!["x", "mask"]);
        assert_eq!((parts[1].name.as_str(), parts[1].outputs.as_slice()), ("layers.1", &["add_1".to_string()][..]));
        assert_eq!(parse(&entry(&parts).expect("entry").value).expect("read back"), parts);
        let e = parse("layers.0\tx").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("3 tab-separated fields"), "{e}");
    }
}
