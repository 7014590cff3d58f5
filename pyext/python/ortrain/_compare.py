"""The outcome of `%%ort compare`: per-run summary (median/p90 ms per batch, final/mean loss,
ppl, peak memory), the speedup, an inline table, a plot (loss vs step for both runs; ms/batch vs
step), and the summary JSON + plot stored as artifacts of the parent run. The plot uses
matplotlib's object API (no pyplot, no global backend change)."""
from __future__ import annotations

import html
import json
import math
import os
import tempfile


def _pct(values: list, q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(label: str, run) -> dict:
    """Summary of one RunLog's history."""
    hist = run.history
    ms = [h["batch_time_ms"] for h in hist]
    losses = [h["loss"] for h in hist if "loss" in h]
    ppl = [h["ppl"] for h in hist if "ppl" in h]
    rss = [h.get("_rss") for h in hist if h.get("_rss")]
    return {
        "label": label,
        "run_id": run.run_id,
        "url": run.exp.url(run.run_id) if run.run_id else None,
        "status": run.ended_status,
        "steps": len(hist),
        "median_ms": _pct(ms, 0.5),
        "p90_ms": _pct(ms, 0.9),
        "final_loss": losses[-1] if losses else None,
        "mean_loss": sum(losses) / len(losses) if losses else None,
        "final_ppl": ppl[-1] if ppl else None,
        "peak_rss_mb": max(rss) / 2**20 if rss else None,
    }


def _fmt(v, nd=2):
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.{nd}f}"
    return str(v)


def table(summaries: list, speedup: float | None):
    """(plain text, html) of the comparison table."""
    cols = ["run", "steps", "median ms", "p90 ms", "speedup", "final loss", "mean loss", "final ppl",
            "peak RSS MB", "MLflow run"]
    rows = []
    for i, s in enumerate(summaries):
        rows.append([s["label"], str(s["steps"]), _fmt(s["median_ms"]), _fmt(s["p90_ms"]),
                     "1.00x" if i == 0 else (f"{speedup:.2f}x" if speedup else "–"),
                     _fmt(s["final_loss"], 4), _fmt(s["mean_loss"], 4), _fmt(s["final_ppl"], 1),
                     _fmt(s["peak_rss_mb"], 0), s["url"] or "–"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    text = "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = ""
    for r in rows:
        cells = [html.escape(x) for x in r[:-1]]
        link = r[-1]
        cells.append(f'<a href="{html.escape(link)}" target="_blank">run</a>' if link.startswith("http") else html.escape(link))
        body += "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
    return text, f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def plot(runs: list, path: str) -> None:
    """Loss vs step (both runs) and ms/batch vs step, saved as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=100)
    ax_loss, ax_ms = fig.subplots(1, 2)
    for label, run in runs:
        steps = list(range(len(run.history)))
        ax_loss.plot(steps, [h.get("loss", math.nan) for h in run.history], label=label)
        ax_ms.plot(steps, [h["batch_time_ms"] for h in run.history], label=label)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_ms.set(title="time per batch", xlabel="step", ylabel="ms/batch")
    for ax in (ax_loss, ax_ms):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def report(parent, runs: list, display) -> dict:
    """Builds the summary, shows table and plot through `display`, stores the artifacts."""
    summaries = [summarize(label, run) for label, run in runs]
    base, acc = summaries[0]["median_ms"], summaries[-1]["median_ms"]
    speedup = base / acc if len(summaries) > 1 and acc and not math.isnan(acc) and acc > 0 else None
    summary = {"runs": summaries, "speedup": speedup, "parent_run_id": parent.run_id}
    text, html_table = table(summaries, speedup)
    display({"text/plain": text, "text/html": html_table}, raw=True)
    with tempfile.TemporaryDirectory(prefix="ortrain-compare-") as d:
        png = os.path.join(d, "loss_and_batch_time.png")
        js = os.path.join(d, "summary.json")
        plot(runs, png)
        with open(js, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        with open(png, "rb") as f:
            import base64

            data = base64.b64encode(f.read()).decode()
        display({"image/png": data, "text/plain": "<ortrain compare plot>"}, raw=True)
        if parent.run_id:
            try:
                for p in (png, js):
                    parent.exp.client.log_artifact(parent.run_id, p, "compare")
            except (OSError, ValueError, RuntimeError) as e:  # both runs are logged; say what is missing
                from ortrain._runlog import warn

                warn(f"the comparison plot and summary could not be stored as artifacts: {e}")
    return summary
