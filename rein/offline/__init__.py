"""Offline inference in this process: an OpenAI batch file (`run_batch`) or Python calls
(`LLM`), both through the same engine loop (`rein.offline.driver`). Importing this package
does not import torch; building an engine does."""

from rein.offline.llm import LLM
from rein.offline.llm_outputs import CompletionOutput, GenerationOutput, Logprob
from rein.offline.run_batch import BatchSummary, format_summary, run_batch

__all__ = ["LLM", "BatchSummary", "CompletionOutput", "GenerationOutput", "Logprob", "format_summary", "run_batch"]
