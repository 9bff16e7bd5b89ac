"""Sweep reports (markdown/CSV/PNG from a Hydra sweep folder) and the time-to-target measurement."""
from lit_speed.reporting.sweep_report import build_rows, find_job_dirs, load_job, to_markdown, write_report
from lit_speed.reporting.sweep_report_callback import SweepReportCallback
from lit_speed.reporting.time_to_target import TimeToTarget, target_met

__all__ = ["SweepReportCallback", "TimeToTarget", "build_rows", "find_job_dirs", "load_job", "target_met",
           "to_markdown", "write_report"]
