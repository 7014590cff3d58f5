"""Turns measured runs into the comparison: per-system statistics (median / p10 / p90 ms per
step, speedups against eager and torch.compile, first step, peak RSS and its growth over the
process after its imports, final loss), the printed table, and the JSON document."""
from __future__ import annotations

import math
import statistics

FINAL_LOSS_STEPS = 10  # "final loss": mean of the last this-many timed steps (dropout makes one step noisy)


def quantile(values: list, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run) -> dict:
    """Statistics of one SystemRun (bench/rounds.py); empty for a run without timed steps."""
    times = run.step_ms
    if run.status != "ok" or not times:
        return {}
    peak = run.finish.get("peak_rss_mib")
    base = run.rss_after_import_mib
    tail = run.losses[-FINAL_LOSS_STEPS:]
    return {
        "steps": len(times),
        "median_ms": statistics.median(times),
        "p10_ms": quantile(times, 0.10),
        "p90_ms": quantile(times, 0.90),
        "first_step_ms": run.setup.get("first_step_ms"),
        "peak_rss_mib": peak,
        "rss_after_import_mib": base,
        "rss_growth_mib": peak - base if peak is not None and base is not None else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
    }


def add_ratios(summaries: dict) -> None:
    """speedup_vs_<s> = median of s / median of this system (> 1: this one is faster)."""
    for ref in ("eager", "compile"):
        ref_ms = summaries.get(ref, {}).get("median_ms")
        for s in summaries.values():
            if s and ref_ms:
                s[f"speedup_vs_{ref}"] = ref_ms / s["median_ms"]


_COLUMNS = [  # (heading, key, format)
    ("median ms", "median_ms", "{:.1f}"),
    ("p10", "p10_ms", "{:.1f}"),
    ("p90", "p90_ms", "{:.1f}"),
    ("x eager", "speedup_vs_eager", "{:.2f}"),
    ("x compile", "speedup_vs_compile", "{:.2f}"),
    ("first step s", "first_step_ms", "{:.2f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
    ("growth MiB", "rss_growth_mib", "{:.0f}"),
    ("final loss", "final_loss", "{:.4f}"),
]


def _cell(summary: dict, key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    return fmt.format(value / 1e3 if key == "first_step_ms" else value)


def table(name: str, title: str, params: int | None, runs: dict, summaries: dict) -> str:
    head = f"== {name}: {title}" + (f"; {params / 1e6:.2f} M parameters" if params else "")
    widths = [max(len(h), 9) for h, _, _ in _COLUMNS]
    lines = [head, "system   " + " ".join(h.rjust(w) for (h, _, _), w in zip(_COLUMNS, widths))]
    for system, run in runs.items():
        if run.status != "ok":
            lines.append(f"{system:8s} {run.status.upper()}: {run.error}")
            continue
        s = summaries[system]
        cells = [_cell(s, key, fmt).rjust(w) for (_, key, fmt), w in zip(_COLUMNS, widths)]
        lines.append(f"{system:8s} " + " ".join(cells))
        for note in run.setup.get("notes", []):
            lines.append(f"         note: {note}")
    return "\n".join(lines)


def workload_json(title: str, precision: str, runs: dict, summaries: dict) -> dict:
    params = next((r.setup.get("params") for r in runs.values() if r.setup.get("params")), None)
    return {
        "title": title,
        "precision": precision,
        "params": params,
        "systems": {
            s: {
                "status": r.status,
                "error": r.error,
                "error_detail": r.error_detail or None,
                "summary": summaries.get(s, {}),
                "step_ms": r.step_ms,
                "losses": r.losses,
                "round_step_ms": [x["step_ms"] for x in r.rounds],
                "first_step_ms": r.setup.get("first_step_ms"),
                "warmup_ms": r.setup.get("warmup_ms", []),
                "warmup_losses": r.setup.get("warmup_losses", []),
                "build_s": r.setup.get("build_s"),
                "rss_after_import_mib": r.rss_after_import_mib,
                "rss_after_setup_mib": r.setup.get("rss_after_setup_mib"),
                "peak_rss_mib": r.finish.get("peak_rss_mib"),
                "notes": r.setup.get("notes", []),
                "describe": r.finish.get("describe") or None,
                "warnings": r.finish.get("warnings", []),
                "versions": r.versions,
            }
            for s, r in runs.items()
        },
    }
