"""Structured outputs: decoding constrained to a JSON schema, any JSON object, a regex, a
list of choices or a grammar.

A request asks for it with one plain-JSON `structured` spec (SamplingParams.structured;
`rein.engine.structured.spec`, which refuses what cannot be enforced with a StructuredSpecError
naming where the spec came from). The wire's spellings (OpenAI's `response_format`, vLLM's
`structured_outputs` and older `guided_*` fields) become that spec in
rein.openai.structured_fields, above the engine. The engine keeps a `rein.engine.structured.decoding.StructuredDecoding`
(`engine.grammars`): a cache of compiled grammars (compiled once per distinct spec, in a
background thread, never on the step loop) and, every step, the token masks of the
constrained rows applied to their logits (`rein.engine.structured.kernels`: torch on CPU, a
Triton kernel on CUDA).

Library: llguidance, chosen over xgrammar by measurement (SmolLM2-135M's tokenizer,
49,152 tokens, one CPU thread, llguidance 1.9.1 vs xgrammar 0.2.9):

* Correctness. llguidance refuses JSON-schema keywords it cannot enforce (`not`,
  `uniqueItems`, `contains`, `propertyNames`, `dependentRequired`, `if`/`then`/`else`, and
  `oneOf` whose branches overlap), which becomes a refusal naming them (a 400 at the API).
  xgrammar accepts them and silently ignores them: constrained outputs of `allOf`, `not`, `contains` and
  `if/then` schemas failed `jsonschema` validation (3/3, 2/3, 6/6, 2/6 of the sampled
  outputs). Every output llguidance let through validated. "Every output validates" is the
  promise, so the library that refuses what it cannot keep wins.
* Torch-free. `import xgrammar` imports torch (1.4 s); llguidance does not (0.05 s), so
  the API process validates schemas at intake with the very compiler the engine uses.
* Compile time. llguidance builds its lexer lazily: 0.8-1.1 ms per representative schema
  (xgrammar 4-21 ms); 1,000 distinct small schemas 0.42 s (xgrammar 1.64 s); including the
  first mask, 0.5 ms per schema (xgrammar 1.7 ms).
* Mask time is xgrammar's strength: fill + accept about 4 us per row and token against
  llguidance's 15-110 us (mean per schema; 1.6 ms for 32 rows per step, about 5 ms for 32
  rows inside long JSON strings). A decode step of a 32-row batch of SmolLM2 on one CPU
  thread takes a few hundred milliseconds, so it is within the 10% budget:
  bench/structured.py measured 32 requests x 64 tokens constrained by one schema at 140.8
  output tok/s against 139.6 unconstrained (ratio 1.01; mask fill + apply 2.0% of the time).
  A run-batch of 1,000 lines with 1,000 different schemas: 1,000 compiles, 1.0 s of compile
  time in the background pool, 152.9 s wall against 163.1 s for the same lines sharing one
  schema (every finished output validated).
* Both leave the mask application to the caller's kernel (xgrammar ships CPU/CUDA/Triton
  kernels, llguidance a torch.compile one); rein has its own (rein.engine.structured.kernels).

This package's `__init__` imports nothing: `rein.engine.structured.spec` is imported by the
torch-free API process.
"""
