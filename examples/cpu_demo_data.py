"""Write the CPU demo's data: RL problems (two-digit additions) and SFT cold-start traces.

    python examples/cpu_demo_data.py OUT_DIR
"""
import sys
from pathlib import Path

from megatron_rl.data.synthetic import addition_problems, addition_traces
from megatron_rl.train.hf_source import resolve_model

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
addition_problems(out / "problems.jsonl", 2000, seed=0)
addition_traces(out / "sft.jsonl", resolve_model("smollm2-135m").tokenizer(), 32, template="short", seed=1)
print(f"demo data in {out}")
