//! MLflow REST entities (metrics, params, tags, runs, experiments) and the encoding of
//! non-finite metric values as MLflow expects: the JSON strings "NaN", "Infinity", "-Infinity".

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A metric value; non-finite values travel as the strings MLflow's protobuf JSON uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricValue(pub f64);

impl Serialize for MetricValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_nan() {
            s.serialize_str("NaN")
        } else if v == f64::INFINITY {
            s.serialize_str("Infinity")
        } else if v == f64::NEG_INFINITY {
            s.serialize_str("-Infinity")
        } else {
            s.serialize_f64(v)
        }
    }
}

impl<'de> Deserialize<'de> for MetricValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(f64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Num(v) => Ok(MetricValue(v)),
            Raw::Str(s) => match s.as_str() {
                "NaN" | "nan" => Ok(MetricValue(f64::NAN)),
                "Infinity" | "inf" => Ok(MetricValue(f64::INFINITY)),
                "-Infinity" | "-inf" => Ok(MetricValue(f64::NEG_INFINITY)),
                other => other.parse::<f64>().map(MetricValue).map_err(|_| serde::de::Error::custom(format!("bad metric value {other:?}"))),
            },
        }
    }
}

/// One metric point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    pub key: String,
    pub value: MetricValue,
    /// Milliseconds since the Unix epoch.
    pub timestamp: i64,
    #[serde(default)]
    pub step: i64,
}

/// A run parameter (logged once per run).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Param {
    pub key: String,
    pub value: String,
}

/// A run or experiment tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tag {
    pub key: String,
    pub value: String,
}

/// The terminal (or running) state of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum RunStatus {
    Running,
    Scheduled,
    Finished,
    Failed,
    Killed,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "RUNNING",
            RunStatus::Scheduled => "SCHEDULED",
            RunStatus::Finished => "FINISHED",
            RunStatus::Failed => "FAILED",
            RunStatus::Killed => "KILLED",
        }
    }

    /// Parses "FINISHED", "failed", ...; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "RUNNING" => Some(RunStatus::Running),
            "SCHEDULED" => Some(RunStatus::Scheduled),
            "FINISHED" => Some(RunStatus::Finished),
            "FAILED" => Some(RunStatus::Failed),
            "KILLED" => Some(RunStatus::Killed),
            _ => None,
        }
    }
}

/// `RunInfo` as the server returns it.
#[derive(Debug, Clone, Deserialize)]
pub struct RunInfo {
    pub run_id: String,
    pub experiment_id: String,
    #[serde(default)]
    pub run_name: String,
    pub status: RunStatus,
    #[serde(default)]
    pub start_time: Option<i64>,
    #[serde(default)]
    pub end_time: Option<i64>,
    #[serde(default)]
    pub artifact_uri: String,
}

/// `RunData` as the server returns it (latest metric values, params, tags).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RunData {
    #[serde(default)]
    pub metrics: Vec<Metric>,
    #[serde(default)]
    pub params: Vec<Param>,
    #[serde(default)]
    pub tags: Vec<Tag>,
}

/// A run: info plus data.
#[derive(Debug, Clone, Deserialize)]
pub struct Run {
    pub info: RunInfo,
    #[serde(default)]
    pub data: RunData,
}

impl Run {
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.data.tags.iter().find(|t| t.key == key).map(|t| t.value.as_str())
    }
    pub fn param(&self, key: &str) -> Option<&str> {
        self.data.params.iter().find(|p| p.key == key).map(|p| p.value.as_str())
    }
}

/// An experiment.
#[derive(Debug, Clone, Deserialize)]
pub struct Experiment {
    pub experiment_id: String,
    pub name: String,
    #[serde(default)]
    pub artifact_location: String,
    #[serde(default)]
    pub lifecycle_stage: String,
}

/// One entry of artifacts/list.
#[derive(Debug, Clone, Deserialize)]
pub struct FileInfo {
    pub path: String,
    #[serde(default)]
    pub is_dir: bool,
    #[serde(default)]
    pub file_size: Option<i64>,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_use_mlflow_strings() {
        let enc = |v: f64| serde_json::to_string(&MetricValue(v)).unwrap();
        assert_eq!(enc(f64::NAN), "\"NaN\"");
        assert_eq!(enc(f64::INFINITY), "\"Infinity\"");
        assert_eq!(enc(f64::NEG_INFINITY), "\"-Infinity\"");
        assert_eq!(enc(1.5), "1.5");
        let dec = |s: &str| serde_json::from_str::<MetricValue>(s).unwrap().0;
        assert!(dec("\"NaN\"").is_nan());
        assert_eq!(dec("\"-Infinity\""), f64::NEG_INFINITY);
        assert_eq!(dec("2"), 2.0);
        assert!(serde_json::from_str::<MetricValue>("\"x\"").is_err());
    }

    #[test]
    fn run_status_round_trips() {
        for s in ["RUNNING", "FINISHED", "FAILED", "KILLED", "SCHEDULED"] {
            assert_eq!(RunStatus::parse(s).unwrap().as_str(), s);
        }
        assert!(RunStatus::parse("DONE").is_none());
    }
}
