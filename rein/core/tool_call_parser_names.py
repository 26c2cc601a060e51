"""The `--tool-call-parser` names (vLLM's), defined once and import-free: the settings, the flags
(rein.engine.options) and the parsers themselves (rein.openai.tool_call_parsers) use them.
"""

from __future__ import annotations

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
QWEN3_CODER = "qwen3_coder"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER)
