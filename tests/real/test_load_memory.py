"""What an engine process holds for Gemma 3 270M's tokenizer, measured in a fresh process
(VmRSS): parsing its 33 MB tokenizer.json touches about 290 MiB, of which the Rust tokenizer
keeps 97 MiB; rein.model.tokenizer_files.load_tokenizer hands the rest back to the system
(malloc_trim), where glibc used to keep it until the process ended (bench/quantized.py's peak
RSS: the weights' large buffers are fresh mappings, which never reuse it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from real_support import REPORT

pytestmark = pytest.mark.real

# The Rust tokenizer's 97 MiB and its Python object, with room; without the trim: about 315 MiB.
TOKENIZER_BYTES = 160 << 20

PROBE = """
import json, sys
from rein.model.files import resolve_model
from rein.model.tokenizer_files import load_tokenizer

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

directory = resolve_model(sys.argv[1]).directory
# Modules first: what they hold is not the tokenizer's.
import torch  # noqa: F401
from transformers import AutoTokenizer, TokenizersBackend  # noqa: F401
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name  # noqa: F401
before = rss()
tokenizer = load_tokenizer(directory)
print(json.dumps({"held": rss() - before, "vocabulary": len(tokenizer)}))
"""


def test_the_tokenizer_holds_the_rust_tokenizer_only(gemma_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(gemma_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    REPORT.append(f"{gemma_path.name}: tokenizer ({figures['vocabulary']} tokens) holds "
                  f"{figures['held'] >> 20} MiB after loading")
    assert figures["held"] <= TOKENIZER_BYTES
