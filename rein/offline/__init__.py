"""Offline inference: run an OpenAI batch file through an in-process engine."""

from rein.offline.run_batch import BatchSummary, format_summary, run_batch

__all__ = ["BatchSummary", "format_summary", "run_batch"]
