"""Print each question of a chat batch input file next to its answer from the output file.

    python examples/show_answers.py examples/questions.jsonl demo/answers.jsonl
"""

import json
import sys


def main(input_path: str, output_path: str) -> None:
    with open(output_path, encoding="utf-8") as f:
        answers = {}
        for line in f:
            record = json.loads(line)
            response = record.get("response") or {}
            body = response.get("body") or {}
            choices = body.get("choices") or [{}]
            answers[record["custom_id"]] = (choices[0].get("message") or {}).get("content") \
                or f"(error: {(record.get('error') or {}).get('message')})"
    with open(input_path, encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            question = request["body"]["messages"][-1]["content"]
            answer = " ".join(answers.get(request["custom_id"], "(no answer)").split())
            print(f"Q: {question}\nA: {answer}\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
