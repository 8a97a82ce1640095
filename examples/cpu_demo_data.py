"""Write the CPU demo's data: RL problems (two-digit additions), a held-out evaluation slice and SFT
cold-start traces.

    python examples/cpu_demo_data.py OUT_DIR

problems.jsonl holds the first 2000 problems of the seeded draw (the same as before the evaluation
slice existed); eval.jsonl the problems drawn after them whose sum is not among the training prompts.
"""
import json
import sys
from pathlib import Path

from megatron_rl.data.synthetic import addition_problems, addition_traces
from megatron_rl.train.hf_source import resolve_model

TRAIN, EXTRA = 2000, 200

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
drawn = addition_problems(out / "drawn.jsonl", TRAIN + EXTRA, seed=0)
lines = drawn.read_text().splitlines(keepends=True)
drawn.unlink()
train, rest = lines[:TRAIN], lines[TRAIN:]
seen = {json.loads(line)["prompt"] for line in train}
(out / "problems.jsonl").write_text("".join(train))
(out / "eval.jsonl").write_text("".join(line for line in rest if json.loads(line)["prompt"] not in seen))
addition_traces(out / "sft.jsonl", resolve_model("smollm2-135m").tokenizer(), 32, template="short", seed=1)
print(f"demo data in {out}")
