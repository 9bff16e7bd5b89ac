"""Turn a Hydra sweep folder into one comparison table: ``sweep_report.md``, ``.csv`` and ``.png``.

Plain functions on folders and dicts, usable without Hydra or Lightning::

    from lit_speed.reporting import write_report
    write_report("logs/train/multiruns/2026-11-22_01-00-00")

Each job folder (``<sweep>/<n>/``) holds ``.hydra/overrides.yaml`` and, when the job finished,
``summary.json`` (written by :func:`lit_speed.run.runner.train`). A job without ``summary.json`` is a
failed (or unfinished) job and still gets a row, so a sweep never hides its failures.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

REPORT_STEM = "sweep_report"
ERROR_FILE = "error.txt"  # written into a job folder by SweepReportCallback when the job raised
CSV_FIELDS = ["job", "variation", "status", "throughput", "throughput_unit", "diff_pct", "samples_per_sec",
              "tokens_per_sec", "peak_rss_mib", "final_train_loss", "monitor", "best_val", "final_val",
              "time_to_target_s", "target_step", "fit_wall_time_s", "global_step", "error"]


def _job_sort_key(path: Path) -> tuple[int, int | str]:
    return (0, int(path.name)) if path.name.isdigit() else (1, path.name)


def find_job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """Job folders of a sweep (those holding ``.hydra/overrides.yaml``), in job-number order."""
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        raise FileNotFoundError(f"sweep_dir {str(sweep)!r} is not a folder; pass the folder Hydra printed as "
                                "'[HYDRA] Launching ... jobs' (hydra.sweep.dir)")
    jobs = [p for p in sweep.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()]
    return sorted(jobs, key=_job_sort_key)


def load_job(job_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"job", "overrides", "summary" (or None), "error" (or None)}`` for one job folder."""
    job = Path(job_dir)
    overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
    summary_path = job / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    error_path = job / ERROR_FILE
    error = error_path.read_text().strip() if error_path.is_file() else None
    if summary is None and error is None:
        error = "no summary.json (the job raised or did not finish; see its log)"
    return {"job": job.name, "overrides": [str(o) for o in overrides], "summary": summary, "error": error}


def _time_to_target(summary: dict[str, Any]) -> tuple[float | None, int | None, bool]:
    """(seconds, step, measured) from the component that measured it (TimeToTarget, or early stopping's stop_at)."""
    parts = [p for p in (summary.get("components") or {}).values() if isinstance(p, dict)]
    for part in parts:  # TimeToTarget: seconds since fit start
        if "time_to_target_s" in part:
            return part["time_to_target_s"], part.get("target_step"), True
    for part in parts:  # CurriculumEarlyStopping(stop_at=...): seconds of training
        if part.get("target") is not None and "target_time_s" in part:
            return part["target_time_s"], part.get("target_step"), True
    return None, None, False


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def build_rows(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job; ``diff_pct`` compares throughput with the first finished job (the baseline).

    The throughput unit is tokens/s when every finished job counted tokens, else samples/s, so all
    rows are compared in the same unit. ``variation`` lists only the overrides that differ between
    jobs (those shared by all jobs are reported once, by :func:`common_overrides`).
    """
    common = set(common_overrides(jobs))
    done = [j["summary"] for j in jobs if j["summary"] is not None]
    use_tokens = bool(done) and all(s.get("tokens_per_sec") for s in done)
    unit = "tokens/s" if use_tokens else "samples/s"
    rows, baseline = [], None
    for job in jobs:
        s = job["summary"]
        row: dict[str, Any] = {f: None for f in CSV_FIELDS}
        row.update(job=job["job"], variation=" ".join(o for o in job["overrides"] if o not in common) or "(baseline)",
                   throughput_unit=unit, error=job["error"])
        if s is None:
            row["status"] = "failed"
            rows.append(row)
            continue
        monitor = s.get("monitor")
        seconds, step, _ = _time_to_target(s)
        row.update(status="ok", samples_per_sec=s.get("samples_per_sec"), tokens_per_sec=s.get("tokens_per_sec"),
                   throughput=s.get("tokens_per_sec" if use_tokens else "samples_per_sec"),
                   peak_rss_mib=round(s["peak_rss_bytes"] / 2**20, 1) if s.get("peak_rss_bytes") else None,
                   final_train_loss=_finite(s.get("final_train_loss")), monitor=monitor,
                   best_val=_finite(s.get("best_val")), final_val=_finite((s.get("final_val") or {}).get(monitor)),
                   time_to_target_s=seconds, target_step=step, fit_wall_time_s=s.get("fit_wall_time_s"),
                   global_step=s.get("global_step"))
        if baseline is None and row["throughput"]:
            baseline, row["is_baseline"] = row["throughput"], True
        if baseline and row["throughput"] is not None:
            row["diff_pct"] = round(100.0 * (row["throughput"] / baseline - 1.0), 1)
        rows.append(row)
    return rows


def common_overrides(jobs: list[dict[str, Any]]) -> list[str]:
    """Overrides every job shares (e.g. ``trainer.max_steps=50``), in the first job's order."""
    if len(jobs) < 2:
        return []
    shared = set(jobs[0]["overrides"]).intersection(*(j["overrides"] for j in jobs[1:]))
    return [o for o in jobs[0]["overrides"] if o in shared]


def _fmt(value: Any, spec: str = ",.1f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def to_markdown(rows: list[dict[str, Any]], common: list[str], title: str = "Sweep report") -> str:
    """A GitHub-markdown table; failed jobs appear as rows marked **failed** with their error."""
    unit = rows[0]["throughput_unit"] if rows else "samples/s"
    monitors = {r["monitor"] for r in rows if r["monitor"]}
    metric = monitors.pop() if len(monitors) == 1 else "val metric"
    show_target = any(r["time_to_target_s"] is not None or r["target_step"] is not None for r in rows)
    head = ["job", "variation", unit, "diff %", "peak RSS (MiB)", "final train loss", f"best {metric}",
            f"final {metric}"] + (["time to target (s)"] if show_target else [])
    lines = [f"# {title}", ""]
    if common:
        lines += [f"Every job: `{' '.join(common)}`", ""]
    lines += ["diff % = throughput relative to the first finished job (the baseline row). "
              "One process per job; throughput counts training batches only (validation excluded).", "",
              "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["job"], f"`{r['variation']}`", "**failed**", "", "", "", "", ""]
            cells += [""] if show_target else []
            cells[-1] = str(r["error"]).replace("|", "\\|").replace("\n", " ")[:200]
        else:
            diff = "baseline" if r.get("is_baseline") else _fmt(r["diff_pct"], "+.1f", " %")
            cells = [r["job"], f"`{r['variation']}`", _fmt(r["throughput"], ",.0f"), diff, _fmt(r["peak_rss_mib"], ",.0f"),
                     _fmt(r["final_train_loss"], ".4f"), _fmt(r["best_val"], ".4f"), _fmt(r["final_val"], ".4f")]
            if show_target:
                reached = r["time_to_target_s"] is not None
                cells.append(f"{r['time_to_target_s']:.1f} (step {r['target_step']})" if reached else "not reached")
        lines.append("| " + " | ".join(cells) + " |")
    failed = sum(r["status"] != "ok" for r in rows)
    lines += ["", f"{len(rows)} job(s), {failed} failed."]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows([{k: ("" if r[k] is None else r[k]) for k in CSV_FIELDS} for r in rows])


def plot(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Two horizontal bar charts, throughput and peak RSS per variation (failed jobs drawn empty, labelled)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    labels = [f"{r['job']}: {r['variation']}"[:60] + (" (failed)" if r["status"] != "ok" else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * max(len(rows), 1)), sharey=True)
    for ax, key, xlabel in ((axes[0], "throughput", rows[0]["throughput_unit"] if rows else ""),
                            (axes[1], "peak_rss_mib", "peak RSS (MiB)")):
        values = [r[key] or 0.0 for r in rows]
        ax.barh(range(len(rows)), values, color=["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows])
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _atomic_write(path: Path, write: Any) -> None:
    # parallel launchers may finish jobs at the same time: never leave a half-written report
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def write_report(sweep_dir: str | os.PathLike, title: str | None = None) -> dict[str, Path]:
    """Gather the jobs of ``sweep_dir`` and write ``sweep_report.{md,csv,png}`` into it.

    Args:
        sweep_dir: The sweep folder (``hydra.sweep.dir``).
        title: Heading of the markdown report (default: the folder name).

    Returns:
        The paths written, keyed ``"md"``, ``"csv"``, ``"png"``.

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a folder.
    """
    sweep = Path(sweep_dir)
    jobs = [load_job(d) for d in find_job_dirs(sweep)]
    rows = build_rows(jobs)
    paths = {ext: sweep / f"{REPORT_STEM}.{ext}" for ext in ("md", "csv", "png")}
    markdown = to_markdown(rows, common_overrides(jobs), title or f"Sweep report: {sweep.name}")
    _atomic_write(paths["md"], lambda p: p.write_text(markdown))
    _atomic_write(paths["csv"], lambda p: write_csv(rows, p))
    _atomic_write(paths["png"], lambda p: plot(rows, p))
    return paths
