"""One summary of a run's metrics lines, used for both sides of a benchmark pair: the Python
reference's own lines and our binary's metrics.jsonl. Standard library only."""

import json
import statistics

TIME_KEYS = ["tokens_per_s", "time/total", "time/data", "time/forward", "time/backward", "time/update"]


def read_jsonl(path):
    with open(path) as fp:
        return [json.loads(line) for line in fp if line.strip()]


def summarize(records, warmup_steps):
    """Medians over the log lines after the first warmup_steps global steps (allocation, first
    touches and compilation in the first steps must not decide the figure), and the highest
    peak RSS over all lines (each line's peak covers the steps since the previous line)."""
    if not records:
        raise ValueError("no metrics lines")
    measured = [r for r in records if r["global_step"] > warmup_steps] or records
    out = {k: statistics.median(r[k] for r in measured) for k in TIME_KEYS if all(k in r for r in measured)}
    out["peak_rss_gb"] = max(r.get("peak_rss_gb", 0.0) for r in records)
    before = [r["global_step"] for r in records if r["global_step"] < measured[0]["global_step"]]
    out["measured_steps"] = measured[-1]["global_step"] - max(before, default=0)
    out["last_step"] = records[-1]["global_step"]
    out["last_loss"] = records[-1]["running_loss"]
    return out
