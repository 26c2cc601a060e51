"""The caps rein puts on a chat or completions request's fields, in one place: request parsing
enforces them (rein.openai.request and the modules it calls) and the API's OpenAPI schema
states them (rein.api.schemas).
"""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# vLLM's range. Past it the penalty scales float32 logits to infinity (or to zero).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# Caps on what a request may hold, checked before the costly work (tokenizing, templating):
# far beyond what a real request needs, small enough that no request can hog the API.
MAX_MESSAGES = 1024
MAX_CHARS_PER_TOKEN = 64          # a prompt longer than context x this cannot fit in any tokenizer
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_TOKENS = 1024      # a logit_bias map: far more tokens than a real request biases

# What one response may repeat: every returned choice carries the echoed prompt and its logprobs,
# and its own token logprobs with their alternatives (a 1,024-token prompt, n=4 and
# prompt_logprobs=20 made 6.7 MB of JSON; n=128 on an 8K prompt would be gigabytes). Counted
# in entries (a token with its logprob, or one alternative), about 80 bytes of JSON each.
MAX_ECHOED_PROMPT_ENTRIES = 262_144
MAX_LOGPROB_ENTRIES = 1_048_576
