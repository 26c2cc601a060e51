"""The wire format: OpenAI's request and response bodies, as rein reads and writes them.

`request` parses and checks a completion or chat body into SamplingParams (each field is
checked where it is parsed), with `fields` (which fields a body may hold, their JSON types),
`prompts` (the prompt's token ids, the chat template), `choice_fields` (n, best_of, echo,
logit_bias, prompt logprobs) and `limits` (the caps). `response` builds the bodies and their
logprobs, `choices` and `choice_bodies` handle n > 1, best_of and echo, `tools` the
function-calling shape, `reasoning` a reasoning model's thinking (reasoning_content),
`embeddings` the embeddings endpoint, `responses` the Responses API (run as chat), `responses_body`
its response object and `responses_stream` its events, `batch_lines` the lines of Batch files,
`endpoints` the paths. `errors` is a leaf the engine shares: the one client-error type
and the one context-length message. Torch-free: the API imports it.
"""
