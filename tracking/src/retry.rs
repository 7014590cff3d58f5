//! Retries with exponential backoff for artifact transfers: connection failures, HTTP 5xx and 429
//! (the same rule as [`Error::is_retryable`] and the background logger). Anything else fails at
//! once.

use crate::error::Result;
use std::time::Duration;

/// How often and how patiently a failed request is tried again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first failed attempt.
    pub max_retries: u32,
    /// First wait; doubled after each retry.
    pub initial_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { max_retries: 4, initial_backoff: Duration::from_millis(500) }
    }
}

impl RetryPolicy {
    /// Runs `attempt` until it succeeds, fails with a non-retryable error, or the retries run out
    /// (then the last error is returned).
    pub fn run<T>(&self, mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
        let mut backoff = self.initial_backoff;
        let mut retries = 0;
        loop {
            match attempt() {
                Err(e) if e.is_retryable() && retries < self.max_retries => {
                    std::thread::sleep(backoff);
                    backoff = backoff.saturating_mul(2);
                    retries += 1;
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn retries_only_transient_errors() {
        let p = RetryPolicy { max_retries: 2, initial_backoff: Duration::from_millis(1) };
        let mut n = 0;
        let r: Result<()> = p.run(|| {
            n += 1;
            Err(Error::Server { endpoint: "x".into(), status: 503, code: String::new(), message: String::new() })
        });
        assert!(r.is_err());
        assert_eq!(n, 3, "first attempt + 2 retries");
        n = 0;
        let r: Result<()> = p.run(|| {
            n += 1;
            Err(Error::Server { endpoint: "x".into(), status: 403, code: String::new(), message: String::new() })
        });
        assert!(r.is_err());
        assert_eq!(n, 1, "403 is not retried");
        n = 0;
        let r = p.run(|| {
            n += 1;
            if n < 2 {
                Err(Error::Server { endpoint: "x".into(), status: 429, code: String::new(), message: String::new() })
            } else {
                Ok(7)
            }
        });
        assert_eq!(r.unwrap(), 7);
    }
}
