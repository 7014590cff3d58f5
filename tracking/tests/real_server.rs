//! The tracking client and background logger against a real `mlflow server` (one per test binary
//! run, started here and stopped at the end): experiments, runs, params, tags, non-finite values,
//! the log-batch limits, key validation, artifacts (proxied and local), the logger, and a server
//! killed mid-run and restarted with the spill file replayed so that no metric is lost.

mod common;

use ortrain_tracking::*;
use std::time::{Duration, Instant};

#[test]
fn tracking_against_a_real_mlflow_server() {
    let Some(mut server) = common::MlflowServer::start("client") else {
        return;
    };
    let client = Client::new(&server.uri()).unwrap();
    let t = Instant::now();
    let exp = experiments(&client);
    runs_params_tags(&client, &exp);
    batching_limits(&client, &exp);
    invalid_keys(&client, &exp);
    artifacts(&client, &exp, &server);
    background_logger(&client, &exp);
    server_killed_mid_run(&client, &exp, &mut server);
    eprintln!("all checks in {:.1}s", t.elapsed().as_secs_f64());
}

fn experiments(c: &Client) -> String {
    assert!(c.get_experiment_by_name("ortrain-test").unwrap().is_none());
    let id = c.get_or_create_experiment("ortrain-test").unwrap();
    assert_eq!(c.get_or_create_experiment("ortrain-test").unwrap(), id);
    assert_eq!(c.get_experiment_by_name("ortrain-test").unwrap().unwrap().experiment_id, id);
    id
}

fn runs_params_tags(c: &Client, exp: &str) {
    let parent = c.create_run(exp, Some("parent"), &[Tag { key: "ortrain.mode".into(), value: "compare".into() }], None).unwrap();
    assert_eq!(parent.status, RunStatus::Running);
    let child = c.create_run(exp, Some("child"), &[], Some(&parent.run_id)).unwrap();
    c.set_tag(&child.run_id, "ortrain.role", "baseline").unwrap();
    c.log_param(&child.run_id, "optimizer", "Adam").unwrap();
    let nan = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 2.5];
    let metrics: Vec<Metric> = nan
        .iter()
        .enumerate()
        .map(|(i, v)| Metric { key: "loss".into(), value: MetricValue(*v), timestamp: now_ms(), step: i as i64 })
        .collect();
    assert_eq!(c.log_batch(&child.run_id, &metrics, &[], &[]).unwrap(), 1);
    let h = c.get_metric_history(&child.run_id, "loss").unwrap();
    assert_eq!(h.len(), 4);
    assert!(h[0].value.0.is_nan());
    assert!(h[1].value.0 > 1e300, "+inf stored as a huge value or inf: {:?}", h[1].value);
    assert!(h[2].value.0 < -1e300);
    assert_eq!(h[3].value.0, 2.5);
    c.update_run(&child.run_id, RunStatus::Killed, None).unwrap();
    c.update_run(&parent.run_id, RunStatus::Finished, None).unwrap();
    let run = c.get_run(&child.run_id).unwrap();
    assert_eq!(run.info.status, RunStatus::Killed);
    assert!(run.info.end_time.is_some());
    assert_eq!(run.tag("mlflow.parentRunId"), Some(parent.run_id.as_str()));
    assert_eq!(run.tag("ortrain.role"), Some("baseline"));
    assert_eq!(run.param("optimizer"), Some("Adam"));
    let kids = c.search_runs(&[exp], &format!("tags.mlflow.parentRunId = '{}'", parent.run_id)).unwrap();
    assert_eq!(kids.len(), 1);
}

fn batching_limits(c: &Client, exp: &str) {
    let run = c.create_run(exp, Some("batching"), &[], None).unwrap();
    let ts = now_ms();
    let metrics: Vec<Metric> =
        (0..2500).map(|i| Metric { key: "m".into(), value: MetricValue(i as f64), timestamp: ts, step: i }).collect();
    let params: Vec<Param> = (0..150).map(|i| Param { key: format!("p{i}"), value: i.to_string() }).collect();
    let tags: Vec<Tag> = (0..120).map(|i| Tag { key: format!("t{i}"), value: i.to_string() }).collect();
    assert_eq!(c.log_batch(&run.run_id, &metrics, &[], &[]).unwrap(), 3, "2500 metrics -> 3 requests");
    assert_eq!(c.log_batch(&run.run_id, &[], &params, &tags).unwrap(), 2);
    let h = c.get_metric_history(&run.run_id, "m").unwrap();
    assert_eq!(h.len(), 2500);
    let mut steps: Vec<i64> = h.iter().map(|m| m.step).collect();
    steps.sort();
    assert_eq!(steps, (0..2500).collect::<Vec<_>>());
    let r = c.get_run(&run.run_id).unwrap();
    assert_eq!(r.data.params.len(), 150);
    assert!(r.data.tags.len() >= 120);
}

fn invalid_keys(c: &Client, exp: &str) {
    let run = c.create_run(exp, None, &[], None).unwrap();
    let bad = Metric { key: "bad key!".into(), value: MetricValue(1.0), timestamp: 0, step: 0 };
    let e = c.log_batch(&run.run_id, &[bad], &[], &[]).unwrap_err();
    assert!(matches!(e, Error::InvalidKey { .. }) && e.to_string().contains("\"bad key!\""), "{e}");
    let e = c.log_param(&run.run_id, "a/../b", "x").unwrap_err();
    assert!(e.to_string().contains("invalid param key \"a/../b\""), "{e}");
    // a server-side rejection is a Server error, not retryable
    let e = c.update_run("0123456789abcdef0123456789abcdef", RunStatus::Finished, None).unwrap_err();
    assert!(matches!(e, Error::Server { .. }) && !e.is_retryable(), "{e}");
}

fn artifacts(c: &Client, exp: &str, server: &common::MlflowServer) {
    let file = server.dir.join("summary one.json");
    std::fs::write(&file, b"{\"speedup\": 2.0}").unwrap();
    // proxied (mlflow-artifacts:/) store
    let run = c.create_run(exp, Some("artifacts"), &[], None).unwrap();
    assert!(run.artifact_uri.starts_with("mlflow-artifacts:"), "{}", run.artifact_uri);
    c.log_artifact(&run.run_id, &file, Some("compare")).unwrap();
    let files = c.list_artifacts(&run.run_id, "compare").unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(files[0].path, "compare/summary one.json");
    assert_eq!(files[0].file_size, Some(16));
    // local store: an experiment whose artifact location is a directory on this machine
    let local = server.dir.join("local-artifacts");
    let lexp = c.create_experiment("local-store", Some(&format!("file://{}", local.display()))).unwrap();
    let lrun = c.create_run(&lexp, None, &[], None).unwrap();
    c.log_artifact(&lrun.run_id, &file, None).unwrap();
    let stored = local.join(&lrun.run_id).join("artifacts").join("summary one.json");
    assert_eq!(std::fs::read(&stored).unwrap(), b"{\"speedup\": 2.0}");
    let _ = exp;
}

fn background_logger(c: &Client, exp: &str) {
    let run = c.create_run(exp, Some("logger"), &[], None).unwrap();
    let opts = LoggerOptions { flush_interval: Duration::from_millis(50), ..Default::default() };
    let mut log = BackgroundLogger::start(c.clone(), &run.run_id, opts).unwrap();
    let t = Instant::now();
    for i in 0..3000 {
        log.log_metric("batch_time_ms", i as f64, i, None).unwrap();
    }
    let queued = t.elapsed();
    assert!(queued < Duration::from_millis(500), "queuing 3000 metrics took {queued:?}");
    log.log_param("model", "TransformerModel").unwrap();
    log.set_tag("ortrain.mode", "baseline").unwrap();
    assert!(log.log_metric("no good?", 1.0, 0, None).is_err());
    let stats = log.close().unwrap();
    assert_eq!((stats.metrics_sent, stats.metrics_spilled), (3000, 0), "{stats:?}");
    assert_eq!(c.get_metric_history(&run.run_id, "batch_time_ms").unwrap().len(), 3000);
    let r = c.get_run(&run.run_id).unwrap();
    assert_eq!(r.param("model"), Some("TransformerModel"));
    assert_eq!(r.tag("ortrain.mode"), Some("baseline"));
}

fn server_killed_mid_run(c: &Client, exp: &str, server: &mut common::MlflowServer) {
    let run = c.create_run(exp, Some("killed"), &[], None).unwrap();
    let spill = server.dir.join("spill.jsonl");
    let opts = LoggerOptions {
        flush_interval: Duration::from_millis(20),
        max_retries: 2,
        initial_backoff: Duration::from_millis(20),
        spill_path: Some(spill.clone()),
    };
    let mut log = BackgroundLogger::start(c.clone(), &run.run_id, opts).unwrap();
    for i in 0..100 {
        log.log_metric("loss", 1.0 / (i + 1) as f64, i, None).unwrap();
    }
    log.flush().unwrap();
    server.kill();
    for i in 100..250 {
        let t = Instant::now();
        log.log_metric("loss", 1.0 / (i + 1) as f64, i, None).unwrap();
        assert!(t.elapsed() < Duration::from_millis(50), "log_metric blocked with the server down");
    }
    log.log_metric("loss", f64::NAN, 250, None).unwrap();
    let stats = log.end_run(RunStatus::Finished).unwrap();
    assert_eq!(stats.metrics_spilled, 151, "{stats:?}");
    assert_eq!(stats.spill_path.as_deref(), Some(spill.as_path()));
    assert!(stats.last_error.unwrap().contains("cannot reach MLflow"));
    server.launch();
    for i in 251..300 {
        log.log_metric("loss", 0.5, i, None).unwrap();
    }
    let stats = log.close().unwrap();
    assert_eq!(stats.metrics_sent, 149, "{stats:?}");
    let replayed = replay(c, &spill).unwrap();
    assert_eq!((replayed.metrics, replayed.runs_ended), (151, 1));
    assert_eq!(c.get_run(&run.run_id).unwrap().info.status, RunStatus::Finished);
    let h = c.get_metric_history(&run.run_id, "loss").unwrap();
    let mut steps: Vec<i64> = h.iter().map(|m| m.step).collect();
    steps.sort();
    assert_eq!(steps, (0..300).collect::<Vec<_>>(), "no metric lost after replay");
    assert!(h.iter().any(|m| m.step == 250 && m.value.0.is_nan()));
}
