"""A batch through nrvna's OpenAI Batch API with the `openai` package, unchanged.

    nrvna daemon models/SmolLM2-135M-Instruct.Q4_1.gguf ws &
    nrvna serve ws --port 8000 &
    python examples/openai_batch.py http://127.0.0.1:8000/v1

Uploads a file of requests, creates the batch, polls it until it ends, and prints each answer
from the output file (and each failure from the error file). The key is NRVNA_API_KEY, when the
server was given one. Kill the server (or the daemon) while it runs and start it again: the
batch goes on under the same ID, every line once.
"""

import json
import os
import sys
import time

from openai import OpenAI

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish."]

client = OpenAI(base_url=sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1",
                api_key=os.environ.get("NRVNA_API_KEY", "none"))
model = client.models.list().data[0].id  # a model a live daemon of the workspace serves
requests = [{"custom_id": f"question-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24,
                      "temperature": 0}}
            for i, question in enumerate(QUESTIONS)]
upload = client.files.create(file=("questions.jsonl", "".join(json.dumps(r) + "\n" for r in requests).encode()),
                             purpose="batch")
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"example": "openai_batch.py"})
print(f"batch {batch.id}: {batch.status}", file=sys.stderr)
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
counts = batch.request_counts
print(f"batch {batch.id}: {batch.status}, {counts.completed} of {counts.total} done", file=sys.stderr)
if batch.output_file_id:
    for line in client.files.content(batch.output_file_id).text.splitlines():
        result = json.loads(line)
        print(f"{result['custom_id']}: {result['response']['body']['choices'][0]['message']['content']!r}")
if batch.error_file_id:
    for line in client.files.content(batch.error_file_id).text.splitlines():
        result = json.loads(line)
        print(f"{result['custom_id']} failed: {result['error']['code']}: {result['error']['message']}")
sys.exit(0 if batch.status == "completed" else 1)
