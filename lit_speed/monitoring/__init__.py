"""Device statistics, throughput, MFU and a bottleneck verdict (:class:`DeviceStatsLogger`)."""
from lit_speed.monitoring.device_stats_logger import METRICS, DeviceStatsLogger
from lit_speed.monitoring.diagnosis import RunStats, diagnose

__all__ = ["DeviceStatsLogger", "METRICS", "RunStats", "diagnose"]
