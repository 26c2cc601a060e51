"""`quantized_activations="int8"` reaches the model: a GGUF file's quantized weights (the
projections, the LM head and the embedding) are repacked for the int8-activation kernel
(rein.kernels.quantized.Int8Panels) after load, and the engine's greedy run stays close to the
file dequantized (int8 activations are not exact: their kernel's own error is
tests/kernels/test_int8_activations.py's)."""

from __future__ import annotations

from test_packed_gguf_models import KV
from test_quantized_models import run

from rein.kernels.quantized import Int8Panels
from rein.model.architectures.linear import Linear


def test_int8_activations_reach_every_quantized_weight(tiny_models, tmp_path):
    from rein.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tiny_models("llama", preset="small"), tmp_path / "q4_1.gguf", "Q4_1")
    engine, tokens, logprobs = run(path, kv_cache_memory=KV, quantized_activations="int8")
    model = engine.runner.model
    held = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert len(held) == 4 * engine.spec.num_layers + 1   # qkv, o, gate/up, down; the LM head
    assert all(isinstance(w, Int8Panels) for w in held)
    assert isinstance(model.embed_tokens.quantized, Int8Panels)
    _, want_tokens, want_logprobs = run(path, "none", kv_cache_memory=KV)
    # Each request's first token comes from the same context in both: its choice agrees and its
    # logprob within the activations' rounding (0.15 here: this random model's logits are flat;
    # weights taken in a wrong layout give unrelated tokens).
    for i in want_tokens:
        assert tokens[i][0] == want_tokens[i][0]
        assert abs(logprobs[i][0] - want_logprobs[i][0]) < 0.3
