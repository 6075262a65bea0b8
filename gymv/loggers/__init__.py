"""Where metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, or a plugin's logger.

metrics.jsonl stays the source of truth: every row is written and fsynced there first, then handed to each
logger. A logger that fails later (a network error) is switched off with one warning; training goes on.
"""

from gymv.loggers.base import GROUP, LOGGERS, MetricsLogger, available, build_loggers, logger_classes, register_logger

__all__ = ["GROUP", "LOGGERS", "MetricsLogger", "available", "build_loggers", "logger_classes", "register_logger"]
