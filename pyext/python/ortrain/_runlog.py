"""One MLflow run of a `%%ort` cell: created lazily at the first optimizer step (a cell that never
steps leaves no run behind), params logged once, per-step metrics queued on the Rust background
logger (never blocking the loop), and always ended FINISHED, FAILED or KILLED. If the server was
unreachable, the spill file and the replay command are printed."""
from __future__ import annotations

import math
import os
import sys
import uuid

from ortrain._steps import Step, step_metrics


def notebook_name(ns: dict | None = None) -> str | None:
    """The notebook's path where the front end tells us (Jupyter, VS Code)."""
    for v in (os.environ.get("JPY_SESSION_NAME"), (ns or {}).get("__vsc_ipynb_file__")):
        if v:
            return str(v)
    return None


def warn(msg: str) -> None:
    """ortrain's user-facing warnings: one line on stderr (quiet, and never an exception)."""
    print(f"ortrain warning: {msg}", file=sys.stderr, flush=True)


class Experiment:
    """The tracking target of one magic invocation: client, URI, experiment (resolved lazily)."""

    def __init__(self, tracking_uri: str | None, name: str):
        from ortrain import tracking

        self.uri = tracking.resolve_tracking_uri(tracking_uri)
        self.client = tracking.client(self.uri)
        if self.client.is_databricks and not name.startswith("/"):
            # Databricks experiments are workspace paths; /Shared always exists
            name = f"/Shared/{name}"
        self.name = name
        self._id = None

    @property
    def id(self) -> str:
        if self._id is None:
            self._id = self.client.get_or_create_experiment(self.name)
        return self._id

    def url(self, run_id: str | None = None) -> str:
        from ortrain.tracking import ui_url

        return ui_url(self.uri, self.id, run_id)


class RunLog:
    """One run. `start()` happens at the first step; `end(status)` always closes what started."""

    def __init__(self, exp: Experiment, *, run_name: str | None, tags: dict, params: dict,
                 parent: "RunLog | None" = None, spill_dir: str | None = None):
        self.exp = exp
        self.run_name = run_name
        self.tags = dict(tags)
        self.params = dict(params)
        self.parent = parent
        self.spill_dir = spill_dir or os.getcwd()
        self.run_id: str | None = None
        self.logger = None
        self.history: list = []
        self.nan_warned = False
        self.ended_status: str | None = None

    @property
    def started(self) -> bool:
        return self.run_id is not None

    def start(self, extra_params: dict | None = None) -> None:
        if self.started:
            return
        from ortrain._ortrain import MetricLogger

        parent_id = None
        if self.parent is not None:
            self.parent.start()
            parent_id = self.parent.run_id
        self.run_id = self.exp.client.create_run(self.exp.id, self.run_name, self.tags, parent_id)
        spill = os.path.join(self.spill_dir, f"ortrain-mlflow-spill-{self.run_id}.jsonl")
        self.logger = MetricLogger(self.exp.client, self.run_id, flush_interval_ms=1000,
                                   max_retries=4, initial_backoff_ms=250, spill_path=spill)
        for k, v in {**self.params, **(extra_params or {})}.items():
            self.logger.log_param(k, _param_value(v))

    def log_step(self, step: Step) -> dict:
        metrics = step_metrics(step)
        loss = metrics.get("loss")
        if loss is not None and not math.isfinite(loss) and not self.nan_warned:
            self.nan_warned = True
            warn(f"loss is {loss} at step {step.index} (logged as is; training continues)")
        if self.logger is not None:
            for k, v in metrics.items():
                self.logger.log_metric(k, float(v), step.index)
        self.history.append({**metrics, "_rss": step.rss_bytes})
        return metrics

    def end(self, status: str) -> dict | None:
        """Flushes and ends the run (no-op if it never started). Returns the logger counters."""
        if not self.started or self.ended_status is not None:
            return None
        self.ended_status = status
        try:
            stats = self.logger.end_run(status)
        finally:
            self.logger.close()
        if stats.get("metrics_spilled") or stats.get("last_error"):
            spill = stats.get("spill_path")
            if spill:
                warn(f"MLflow was unreachable ({stats.get('last_error')}); {stats['metrics_spilled']} metrics "
                     f"(and the run's end) are saved in {spill}; once the server is back, replay them with:\n"
                     f"    python -m ortrain.mlflow replay {spill} --tracking-uri {self.exp.uri}")
            else:
                warn(f"MLflow logging failed: {stats.get('last_error')}")
        return stats


def _param_value(v) -> str:
    s = str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."


def new_group_id() -> str:
    return uuid.uuid4().hex[:12]
