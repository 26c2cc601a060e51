"""rein: a message-queue-driven batch inference service for large language models."""

__version__ = "0.1.0"
