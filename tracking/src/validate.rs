//! Key validation with MLflow's rules, so a bad key fails at the call site with a clear error
//! naming the key, instead of failing a whole batch on the server later.

use crate::error::{Error, Result};

/// Longest key MLflow accepts.
pub const MAX_KEY_LEN: usize = 250;

/// Checks a metric/param/tag key: non-empty, at most 250 characters, only alphanumerics,
/// `_ - . space : /`, not an absolute path and without `..` components.
pub fn validate_key(kind: &'static str, key: &str) -> Result<()> {
    let bad = |reason: String| Err(Error::InvalidKey { kind, key: key.to_string(), reason });
    if key.is_empty() {
        return bad("keys must not be empty".into());
    }
    if key.chars().count() > MAX_KEY_LEN {
        return bad(format!("keys are at most {MAX_KEY_LEN} characters"));
    }
    if let Some(c) = key.chars().find(|c| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ' ' | ':' | '/'))) {
        return bad(format!("character {c:?} is not allowed; use alphanumerics, '_', '-', '.', ' ', ':' or '/'"));
    }
    if key.starts_with('/') || key.split('/').any(|part| part == "..") {
        return bad("keys must be relative paths without '..'".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_mlflow_keys() {
        for k in ["loss", "batch_time_ms", "train/loss", "a.b-c d:e", "ppl2"] {
            validate_key("metric", k).unwrap();
        }
    }

    #[test]
    fn rejects_with_the_key_named() {
        for k in ["", "bad key!", "/abs", "a/../b", &"x".repeat(251)] {
            let e = validate_key("metric", k).unwrap_err().to_string();
            assert!(e.contains("invalid metric key"), "{e}");
            assert!(e.contains(&format!("{k:?}")), "{e}");
        }
    }
}
