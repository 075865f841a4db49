"""Metrics: the MetricLogger (console, JSONL, TensorBoard, goodput), its reader, sinks and reports."""

from lmforge.metrics.logger import GOODPUT_CATEGORIES, PROCESS_START, MetricLogger, format_train_line, to_python

__all__ = ["GOODPUT_CATEGORIES", "PROCESS_START", "MetricLogger", "format_train_line", "to_python"]
