"""`--max-model-len auto` (rein.model.capacity.fit_max_model_len, rein.engine.model_runner): the
longest context the KV cache holds, in whole blocks, up to the model's own; the value through
the flag, the settings and EngineConfig; and an engine that fits it, on the CPU by default when
the model's own context does not fit, and refuses a set length that does not."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from rein.core.settings import SettingsError, load_engine_settings
from rein.engine.config import EngineConfig
from rein.engine.model_runner import CapacityError
from rein.engine.options import max_model_len_value
from rein.model.capacity import fit_max_model_len, kv_capacity
from rein.model.spec import ModelSpec

BLOCK = 16


def spec(max_positions: int = 32768, windows: tuple[int | None, ...] = ()) -> ModelSpec:
    return ModelSpec(architecture="X", family="llama", vocab_size=100, hidden_size=64, num_layers=6, num_heads=4,
                     num_kv_heads=1, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=max_positions, rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
                     qk_norm=False, sliding_window=None, hidden_act="silu", layer_windows=windows)


def test_a_fitting_context_stays_the_models():
    model = spec(max_positions=1024)
    memory = model.kv_bytes_per_token(torch.float32) * 4096
    capacity = fit_max_model_len(model, memory, torch.float32, BLOCK, 1024)
    assert capacity.max_model_len == 1024 and capacity.num_tokens == 4096


def test_a_context_that_does_not_fit_is_what_the_cache_holds_in_whole_blocks():
    model = spec()
    per_token = model.kv_bytes_per_token(torch.float32)
    memory = per_token * 29120 + per_token * 7          # 29120 tokens and a part of a block
    capacity = fit_max_model_len(model, memory, torch.float32, BLOCK, 32768)
    assert capacity.max_model_len == 29120 == capacity.num_tokens
    assert capacity.max_model_len % BLOCK == 0 and capacity.max_full_requests == 1
    assert fit_max_model_len(model, per_token * 5, torch.float32, BLOCK, 32768).max_model_len == 0


def test_windowed_pools_are_fitted_again_at_the_shorter_context():
    """Gemma 3-like: five windowed layers to one full. Windowed storage pays off only when the
    window is shorter than the context, so a fit shorter than the window changes the pools."""
    model = spec(windows=(512, 512, 512, 512, 512, None))
    per_token = model.kv_bytes_per_token(torch.float32)
    for tokens in (300, 2000, 40000):
        memory = per_token * tokens
        capacity = fit_max_model_len(model, memory, torch.float32, BLOCK, 32768, max_num_seqs=4,
                                     max_num_batched_tokens=256)
        assert 0 < capacity.max_model_len <= capacity.num_tokens and capacity.max_model_len % BLOCK == 0
        again = kv_capacity(model, memory, torch.float32, BLOCK, capacity.max_model_len, 4, 256)
        assert again == capacity                       # the pools of the context it settled on
        longer = kv_capacity(model, memory, torch.float32, BLOCK, capacity.max_model_len + BLOCK, 4, 256)
        assert capacity.max_model_len == 32768 or longer.num_tokens < capacity.max_model_len + BLOCK


def test_the_value_of_the_flag_and_the_variable():
    assert max_model_len_value("auto") == "auto" and max_model_len_value("AUTO") == "auto"
    assert max_model_len_value("4096") == 4096
    for bad in ("0", "lots", "-5"):
        with pytest.raises(argparse.ArgumentTypeError):
            max_model_len_value(bad)
    assert load_engine_settings(max_model_len="auto").max_model_len == "auto"
    assert load_engine_settings(max_model_len="2048").max_model_len == 2048
    with pytest.raises(SettingsError, match="REIN_MAX_MODEL_LEN"):
        load_engine_settings(max_model_len="most")
    assert EngineConfig(model="m", device="cpu", max_model_len="auto").max_model_len == "auto"
    with pytest.raises(ValueError, match="number of tokens or 'auto'"):
        EngineConfig(model="m", device="cpu", max_model_len="most")


# -- an engine that fits it --------------------------------------------------------------------

def _engine(model_dir, **config):
    from rein.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=2, **config))


def test_a_cpu_engine_fits_its_context(tiny_models, caplog):
    model_dir = tiny_models("llama")
    full = _engine(model_dir, kv_cache_memory="32MiB").max_model_len      # the model's own fits
    per_token = _engine(model_dir, kv_cache_memory="32MiB", max_model_len=64).runner.capacity.bytes_per_token
    memory = per_token * (full // 2 + 5)                                 # half the context and a bit
    with caplog.at_level(logging.INFO, logger="rein.engine.model_runner"):
        auto = _engine(model_dir, kv_cache_memory=memory, max_model_len="auto")
    assert auto.max_model_len == full // 2 // BLOCK * BLOCK
    assert f"max_model_len auto: {auto.max_model_len} of the model's {full} fit the KV cache" in caplog.text
    assert _engine(model_dir, kv_cache_memory=memory).max_model_len == auto.max_model_len   # unset, on the CPU
    with pytest.raises(CapacityError, match="--max-model-len auto"):
        _engine(model_dir, kv_cache_memory=memory, max_model_len=full)   # asked for: refused, as on CUDA
    # the engine answers within its fitted context and refuses beyond it
    from rein.engine.errors import ContextLengthExceeded
    from rein.engine.sampling_params import SamplingParams
    with pytest.raises(ContextLengthExceeded):
        auto.add_request("long", [5] * auto.max_model_len, SamplingParams(max_tokens=1))
    auto.add_request("short", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    finished = []
    while auto.has_unfinished():
        finished += [o for o in auto.step() if o.finished]
    assert [o.request_id for o in finished] == ["short"]


@pytest.mark.parametrize("requested,device,fits", [
    ("auto", "cpu", True), ("auto", "cuda", True),
    (None, "cpu", True),          # unset on the CPU: the most that fits
    (None, "cuda", False),        # unset on CUDA: refused, as vLLM does
    (4096, "cpu", False), (4096, "cuda", False),   # a length asked for is kept or refused
])
def test_which_contexts_are_fitted_rather_than_refused(requested, device, fits):
    from types import SimpleNamespace

    from rein.engine.model_runner import ModelRunner

    runner = SimpleNamespace(config=SimpleNamespace(max_model_len=requested), device=torch.device(device))
    assert ModelRunner._fits_automatically(runner) is fits
