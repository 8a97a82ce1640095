"""Write the tool demo's data: RL problems (3-digit x 3-digit products), a held-out evaluation set and
two SFT cold starts on the same problems, one that calls the python tool and one that multiplies in
its head (long multiplication written out), for the `tool_use` experiment's two arms.

    python examples/tool_demo_data.py OUT_DIR [N_TRACES]

problems.jsonl, eval.jsonl and the traces hold disjoint operand pairs of one seeded draw.
sft_tool.jsonl: prompt (template short_python) -> tool call -> tool output (masked) -> answer.
sft_direct.jsonl: prompt (template short) -> long multiplication and answer.
"""
import dataclasses
import sys
from pathlib import Path

from megatron_rl.data.prompts import get_template
from megatron_rl.data.synthetic import multiplication_pairs, multiplication_traces, write_multiplication_problems
from megatron_rl.env import PythonTool
from megatron_rl.train.hf_source import resolve_model

TRAIN, EVAL = 2000, 64

out = Path(sys.argv[1])
n_traces = int(sys.argv[2]) if len(sys.argv) > 2 else 64
out.mkdir(parents=True, exist_ok=True)
pairs = multiplication_pairs(TRAIN + EVAL + n_traces, seed=0)
write_multiplication_problems(out / "problems.jsonl", pairs[:TRAIN])
write_multiplication_problems(out / "eval.jsonl", pairs[TRAIN:TRAIN + EVAL], first_index=TRAIN)
tokenizer = resolve_model("smollm2-135m").tokenizer()
traces = pairs[TRAIN + EVAL:]
# rendered as a run with env.name python renders its prompts (control/episodes.prompt_template: the tools'
# schemas go to the chat template, which SmolLM2's ignores; the system prompt spells the format out)
with_tools = dataclasses.replace(get_template("short_python"), chat_template_kwargs={"tools": PythonTool.tools})
multiplication_traces(out / "sft_tool.jsonl", tokenizer, with_tools, traces, tool=True)
multiplication_traces(out / "sft_direct.jsonl", tokenizer, get_template("short"), traces, tool=False)
print(f"tool demo data in {out}")
