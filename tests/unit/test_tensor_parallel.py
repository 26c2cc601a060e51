"""Tensor parallelism at the model level: two gloo ranks on the CPU compute what one rank does.

Each tiny model is loaded sharded over two spawned ranks (one thread each) and driven through
the paged attention by hand -- a prefill step of two requests, then steps mixing their
decodes with a third request's chunked prefill (the second chunk over a cached prefix) --
and every step's logits are compared with the same steps on one rank. The models cover
what sharding must get right: GQA and llama3 rope (llama), q/k/v bias and a tied head
(qwen2), per-head q/k norms and a head_dim of its own (qwen3), Gemma 3's sandwich norms and
windows with a vocabulary that does not split evenly, MoE experts split by their width with
a shared expert (qwen2_moe, also from a checkpoint with the experts stacked) and OLMoE's q/k
norms over all heads. Then: a size that fits neither the heads nor the KV heads is refused
(sizes above the KV heads that replicate them: tests/unit/test_tensor_parallel_kv_replicas.py), and a rank
that is killed or hangs makes the other's collective raise within the timeout.
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from unit_support import save_tiny_hf_model

from rein.model.architectures import native_model_class
from rein.model.attention import AttentionMetadata, LayerCache
from rein.model.files import resolve_model
from rein.model.loader import load_model
from rein.model.parallel import SINGLE_RANK, DistributedGroup, file_init_method, tcp_init_method
from rein.model.parallel.layers import attention_heads
from rein.model.parallel.shm_reduce import SLOT_BYTES
from rein.model.spec import ModelSpec

BLOCK = 8
BLOCKS_PER_REQUEST = 4
PROMPT_LENGTHS = (5, 11, 19)
DECODES = 3
# Steps as (request, start, end) parts, decodes first: request 2 is prefilled in two chunks
# while requests 0 and 1 decode.
STEPS = [
    [(0, 0, 5), (1, 0, 11)],
    [(0, 5, 6), (1, 11, 12), (2, 0, 12)],
    [(0, 6, 7), (1, 12, 13), (2, 12, 19)],
    [(0, 7, 8), (1, 13, 14), (2, 19, 20)],
]
TOLERANCE = 1e-4


def sequences(vocab: int) -> list[list[int]]:
    """Each request's prompt and the tokens it is fed while decoding (fixed, not sampled, so
    both runs see the same inputs)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n + DECODES,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def run_steps(model, spec: ModelSpec, kv_heads: int) -> list[torch.Tensor]:
    """Every row's logits of each of STEPS, over a paged cache of `kv_heads` heads per layer."""
    shape = (len(PROMPT_LENGTHS) * BLOCKS_PER_REQUEST, BLOCK, kv_heads, spec.head_dim)
    caches = [LayerCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    tables = [list(range(r * BLOCKS_PER_REQUEST, (r + 1) * BLOCKS_PER_REQUEST)) for r in range(len(PROMPT_LENGTHS))]
    seqs = sequences(min(spec.vocab_size, 2048))
    logits = []
    with torch.inference_mode():
        for parts in STEPS:
            ids, positions, slots = [], [], []
            for r, start, end in parts:
                ids += seqs[r][start:end]
                positions += range(start, end)
                slots += [tables[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            decodes = [part for part in parts if part[2] - part[1] == 1]
            prefills = [part for part in parts if part[2] - part[1] > 1]
            offsets = [0]
            for _, start, end in prefills:
                offsets.append(offsets[-1] + end - start)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots), num_decode_tokens=len(decodes),
                decode_block_tables=torch.tensor([tables[r] for r, _, _ in decodes], dtype=torch.int32)
                if decodes else None,
                decode_context_lens=torch.tensor([end for _, _, end in decodes], dtype=torch.int32)
                if decodes else None,
                decode_groups=None,
                prefill_block_tables=torch.tensor([tables[r] for r, _, _ in prefills], dtype=torch.int32),
                prefill_cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32),
                prefill_context_lens=torch.tensor([end for _, _, end in prefills], dtype=torch.int32))
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            logits.append(model.compute_logits(hidden).float().clone())
    return logits


def logits_of(directory: Path, group=SINGLE_RANK) -> list[torch.Tensor]:
    files = resolve_model(str(directory))
    spec = ModelSpec.from_dir(files.directory)
    model = load_model(files, spec, 256, torch.float32, torch.device("cpu"), group=group)
    return run_steps(model, spec, attention_heads(spec, group.world_size)[1])


def tp_rank(rank: int, init_method: str, cases: dict[str, str], out: str) -> None:
    """One of two ranks: every case's logits, and what the group's collectives gave, saved to `out`."""
    torch.set_num_threads(1)
    group = DistributedGroup(rank, 2, init_method, timeout_s=60)
    try:
        smallest = group.min_int(10 + rank)
        # Larger than a shared-memory slot: through gloo instead (rein.model.parallel.shm_reduce).
        big = group.all_reduce_(torch.full((SLOT_BYTES // 4 + 1,), float(rank + 1)))
        small = group.all_reduce_(torch.arange(6.0).reshape(2, 3) * (rank + 1))
        gathered = group.all_gather(torch.full((2, 3), float(rank)))
        results = {name: logits_of(Path(directory), group) for name, directory in cases.items()}
        torch.save({"smallest": smallest, "big": (big.min().item(), big.max().item()), "small": small, "gathered": gathered, "logits": results}, Path(out) / f"rank{rank}.pt")
    finally:
        group.close()


def gemma3_dir(source: Path, target: Path) -> Path:
    """A random tiny Gemma 3 whose vocabulary (2051) does not split evenly over two ranks
    (weights drawn wide, as tiny_model's, so the logits spread over several units)."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=2051, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                              max_position_embeddings=512, query_pre_attn_scalar=16, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_tiny_hf_model(config, source, target, spread_norms=True)


def stacked_experts_dir(source: Path, target: Path) -> Path:
    """`source` saved with transformers' in-memory names: experts stacked as mlp.experts.gate_up_proj."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).state_dict()
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def cases(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    built = {arch: tiny_models(arch) for arch in ("llama", "qwen2", "qwen3", "qwen2_moe", "olmoe")}
    built["gemma3"] = gemma3_dir(tiny_models("llama"), root / "gemma3")
    built["qwen2_moe_stacked"] = stacked_experts_dir(tiny_models("qwen2_moe"), root / "qwen2_moe_stacked")
    return built


@pytest.fixture(scope="module")
def two_ranks(cases, tmp_path_factory) -> tuple[dict, dict]:
    """Both ranks' saved results, from one spawn of two processes for all cases."""
    out = tmp_path_factory.mktemp("tp-out")
    init_method = tcp_init_method()
    context = multiprocessing.get_context("spawn")
    paths = {name: str(directory) for name, directory in cases.items()}
    ranks = [context.Process(target=tp_rank, args=(rank, init_method, paths, str(out))) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=300)
            assert process.exitcode == 0, f"a rank ended with exit code {process.exitcode}"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    return tuple(torch.load(out / f"rank{rank}.pt") for rank in range(2))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "qwen2_moe", "qwen2_moe_stacked", "olmoe"])
def test_two_ranks_compute_the_logits_of_one(name, cases, two_ranks):
    want = logits_of(cases[name])
    first, second = (ranks["logits"][name] for ranks in two_ranks)
    vocab = ModelSpec.from_dir(cases[name]).vocab_size
    assert [t.shape for t in first] == [t.shape for t in want] and want[0].shape[-1] == vocab
    diff = max((got - ref).abs().max().item() for got, ref in zip(first, want, strict=True))
    assert diff < TOLERANCE, f"{name}: TP=2 logits differ from TP=1 by up to {diff:.2e}"
    # The gathered logits are the same on every rank (each samples, or rank 0 alone, alike).
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_group_agrees_on_a_minimum_and_gathers_in_rank_order(two_ranks):
    for rank in two_ranks:
        assert rank["smallest"] == 10
        assert rank["big"] == (3.0, 3.0) and torch.equal(rank["small"], torch.arange(6.0).reshape(2, 3) * 3)
        assert torch.equal(rank["gathered"], torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))


@pytest.mark.parametrize(("heads", "kv_heads", "world_size", "refusal", "sizes"), [
    (4, 2, 3, "does not divide the model's 4 attention heads", "1, 2, 4"),
    (4, 2, 8, "does not divide the model's 4 attention heads", "1, 2, 4"),
    # Query heads split by 3, but 3 ranks can neither share 2 KV heads out nor replicate them evenly.
    (6, 2, 3, "neither divides nor is a multiple of the model's 2 KV heads", "1, 2, 6"),
    (12, 4, 6, "neither divides nor is a multiple of the model's 4 KV heads", "1, 2, 4, 12"),
])
def test_a_size_that_fits_neither_the_heads_nor_the_kv_heads_is_refused(tiny_models, heads, kv_heads, world_size,
                                                                        refusal, sizes):
    spec = replace(ModelSpec.from_dir(tiny_models("llama")), num_heads=heads, num_kv_heads=kv_heads)
    group = SimpleNamespace(rank=0, world_size=world_size)
    with torch.device("meta"), pytest.raises(ValueError) as info:
        native_model_class(spec)(spec, 64, group)
    message = str(info.value)
    assert f"tensor parallel size {world_size} {refusal}" in message
    assert message.endswith(f": {sizes}")


def test_the_transformers_backend_refuses_more_than_one_rank(tiny_models):
    spec = ModelSpec.from_dir(tiny_models("llama"))
    files = resolve_model(str(tiny_models("llama")))
    backend = replace(spec, family="transformers")
    with pytest.raises(ValueError, match="Transformers backend"):
        load_model(files, backend, 64, torch.float32, torch.device("cpu"), group=SimpleNamespace(rank=0, world_size=2))


# -- a rank that dies or hangs ---------------------------------------------------------------

def reduce_until_failure(rank: int, init_method: str, timeout_s: float, events) -> None:
    """Rank 1 joins one all-reduce, says so and sleeps (the test kills it, or it stays hung);
    rank 0 keeps reducing and reports the exception it gets and how long it waited."""
    torch.set_num_threads(1)
    group = DistributedGroup(rank, 2, init_method, timeout_s=timeout_s)
    group.all_reduce_(torch.ones(4))
    events.put(("joined", rank))
    if rank == 1:
        time.sleep(600)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 120:
            group.all_reduce_(torch.ones(4))
        events.put(("no error", time.monotonic() - start))
    except Exception as error:   # whatever torch.distributed raises: the point is that it does
        events.put((f"{type(error).__name__}: {error}", time.monotonic() - start))


@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_a_dead_rank_becomes_an_exception_not_a_hang(failure, tmp_path):
    timeout_s = 3.0
    context = multiprocessing.get_context("spawn")
    # A queue per rank: a rank killed while its queue's feeder holds the shared write lock
    # would block the other's reports on one queue.
    events = [context.Queue() for _ in range(2)]
    init_method = file_init_method(tmp_path / "rendezvous")
    ranks = [context.Process(target=reduce_until_failure, args=(rank, init_method, timeout_s, events[rank]))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        assert [queue.get(timeout=120) for queue in events] == [("joined", 0), ("joined", 1)]
        if failure == "killed":
            ranks[1].kill()
        outcome, waited = events[0].get(timeout=120)
        assert outcome != "no error", "the surviving rank's all-reduce never failed"
        assert waited < timeout_s + 30, f"the survivor waited {waited:.1f} s ({outcome})"
        ranks[0].join(timeout=60)
        assert ranks[0].exitcode == 0
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
