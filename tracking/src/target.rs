//! Where metrics go: an `http(s)://` MLflow server or Databricks (`databricks` /
//! `databricks://PROFILE`), with the host and token from DATABRICKS_HOST / DATABRICKS_TOKEN or
//! `~/.databrickscfg`. The token is a [`Secret`]: it never appears in Debug output or errors.

use crate::error::{Error, Result};
use std::fmt;
use std::path::{Path, PathBuf};

/// A credential that prints as `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The raw value, for the Authorization header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A resolved tracking destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `scheme://host[:port][/prefix]`, without a trailing slash.
    pub base_url: String,
    /// Bearer token (Databricks), if any.
    pub token: Option<Secret>,
    /// Whether this is a Databricks workspace.
    pub databricks: bool,
}

impl Target {
    /// Resolves a tracking URI. `http(s)://…` is used as is; `databricks[://PROFILE]` reads
    /// DATABRICKS_HOST / DATABRICKS_TOKEN, then `~/.databrickscfg`.
    pub fn from_uri(uri: &str) -> Result<Self> {
        let uri = uri.trim();
        if uri.starts_with("http://") || uri.starts_with("https://") {
            return Ok(Target { base_url: uri.trim_end_matches('/').to_string(), token: None, databricks: false });
        }
        if uri == "databricks" || uri.starts_with("databricks://") {
            let profile = uri.strip_prefix("databricks://").unwrap_or("").trim_matches('/');
            let profile = if profile.is_empty() { "DEFAULT" } else { profile };
            let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
            let cfg_path =
                env("DATABRICKS_CONFIG_FILE").map(PathBuf::from).or_else(|| env("HOME").map(|h| Path::new(&h).join(".databrickscfg")));
            return Self::databricks(profile, env("DATABRICKS_HOST"), env("DATABRICKS_TOKEN"), cfg_path);
        }
        Err(Error::Config(format!("unsupported tracking URI {uri:?}: use http(s)://HOST:PORT of an MLflow server or 'databricks'")))
    }

    fn databricks(profile: &str, env_host: Option<String>, env_token: Option<String>, cfg_path: Option<PathBuf>) -> Result<Self> {
        let (mut host, mut token) = if profile == "DEFAULT" { (env_host, env_token) } else { (None, None) };
        if host.is_none() || token.is_none() {
            if let Some(path) = cfg_path.as_deref().filter(|p| p.exists()) {
                let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
                let section = parse_ini_section(&text, profile);
                host = host.or_else(|| section.iter().find(|(k, _)| k == "host").map(|(_, v)| v.clone()));
                token = token.or_else(|| section.iter().find(|(k, _)| k == "token").map(|(_, v)| v.clone()));
            }
        }
        let host = host.ok_or_else(|| {
            Error::Config(format!(
                "tracking URI 'databricks' needs a workspace host: set DATABRICKS_HOST or 'host' in profile [{profile}] of ~/.databrickscfg"
            ))
        })?;
        let token = token.ok_or_else(|| {
            Error::Config(format!(
                "tracking URI 'databricks' needs an access token: set DATABRICKS_TOKEN or 'token' in profile [{profile}] of ~/.databrickscfg"
            ))
        })?;
        let host = host.trim().trim_end_matches('/');
        let base_url =
            if host.starts_with("http://") || host.starts_with("https://") { host.to_string() } else { format!("https://{host}") };
        Ok(Target { base_url, token: Some(Secret::new(token.trim())), databricks: true })
    }
}

/// The `key = value` pairs of one `[section]` of an INI file (keys lower-cased).
fn parse_ini_section(text: &str, section: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') && line.ends_with(']') {
            inside = line[1..line.len() - 1].trim() == section;
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_uri_is_used_as_is() {
        let t = Target::from_uri("http://127.0.0.1:5000/").unwrap();
        assert_eq!(t.base_url, "http://127.0.0.1:5000");
        assert!(t.token.is_none());
        assert!(Target::from_uri("file:///tmp/mlruns").is_err());
    }

    #[test]
    fn databricks_from_env_and_cfg_never_prints_the_token() {
        let t = Target::databricks("DEFAULT", Some("adb-1.azuredatabricks.net/".into()), Some("dapiSECRET".into()), None).unwrap();
        assert_eq!(t.base_url, "https://adb-1.azuredatabricks.net");
        assert!(!format!("{t:?}").contains("dapiSECRET"));
        assert_eq!(t.token.as_ref().unwrap().expose(), "dapiSECRET");

        let dir = std::env::temp_dir().join(format!("ortrain-dbcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("cfg");
        std::fs::write(&cfg, "[DEFAULT]\nhost = https://a.cloud.databricks.com\ntoken = dapiA\n[dev]\nhost=https://b\ntoken=dapiB\n")
            .unwrap();
        let a = Target::databricks("DEFAULT", None, None, Some(cfg.clone())).unwrap();
        assert_eq!((a.base_url.as_str(), a.token.unwrap().expose()), ("https://a.cloud.databricks.com", "dapiA"));
        let b = Target::databricks("dev", Some("ignored".into()), None, Some(cfg.clone())).unwrap();
        assert_eq!(b.base_url, "https://b");
        let e = Target::databricks("nope", None, None, Some(cfg)).unwrap_err().to_string();
        assert!(e.contains("DATABRICKS_HOST") && e.contains("[nope]"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }
}
