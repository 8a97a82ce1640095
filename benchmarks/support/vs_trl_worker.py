"""TRL's side of benchmarks/vs_trl.py: Hugging Face TRL's `GRPOTrainer` on the work of our config's RL run.

Runs in the TRL virtual environment (`.venv-trl/`, made by `benchmarks/vs_trl.py --setup`), never in the
project's own: TRL is a benchmark dependency only. Our package is imported by path for what must be the
same on both sides: the config (the same file and overrides as our run), the problem files and their
order (`data.sources.read_jsonl`, `control.problems.ProblemQueue`), the prompt rendering
(`data.prompts`, system prompt and assistant prefix included) and the grading (`reward.score`, called in
this process on `assistant prefix + completion`, as our controller grades).

    .venv-trl/bin/python benchmarks/support/vs_trl_worker.py RESULT.json --config examples/cpu_demo.yaml \
        [--seed-offset 0] [--threads 2] [--out-dir DIR] [key=value ...]

Writes RESULT.json: the wall-clock time of each optimizer step's end, per step the seconds in generation
(`GRPOTrainer._generate`) and grading (`_calculate_rewards`), the held-out pass@1 after the last update
(one sample per problem, HF generate with the training's sampling settings), the GRPOConfig fields set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_LAUNCH = time.time()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="where to write the result JSON")
    p.add_argument("--config", default="examples/cpu_demo.yaml")
    p.add_argument("--seed-offset", type=int, default=0, help="added to trainer.seed and data.seed")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out-dir", default=None, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--eval-batch", type=int, default=16, help="held-out prompts per HF generate call")
    p.add_argument("overrides", nargs="*", help="config overrides, as for megatron-rl train")
    return p.parse_intermixed_args(argv)


def grpo_fields(cfg, seed: int, out_dir: str) -> dict:
    """GRPOConfig keyword arguments for the work our config describes (one optimizer step per
    `rollout.n_mini` minibatch of `n_batch / n_mini` completions, `n_batch / group_size` prompts per update)."""
    r, t, a = cfg.rollout, cfg.trainer, cfg.algo
    if r.n_batch % r.group_size or r.n_batch % r.n_mini:
        raise SystemExit(f"rollout.n_batch ({r.n_batch}) must be a multiple of group_size and of n_mini")
    if a.kl_mode != "none":
        raise SystemExit("algo.kl_mode is not none: TRL's beta is a k3 KL term, not the same objective; "
                         "compare without KL")
    return dict(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=t.precision == "bf16", seed=seed, data_seed=seed,
        max_steps=cfg.run.updates * r.n_mini,
        # one generation batch of n_batch completions per update, n_mini optimizer steps on it
        per_device_train_batch_size=r.n_batch // r.n_mini, gradient_accumulation_steps=1,
        steps_per_generation=r.n_mini, num_iterations=1, num_generations=r.group_size,
        shuffle_dataset=False,  # the dataset is already in our ProblemQueue's order
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=1e-8, max_grad_norm=t.grad_clip,
        optim="adamw_torch",
        loss_type="dapo", epsilon=a.eps_low, epsilon_high=a.eps_high, beta=0.0,
        scale_rewards={"minibatch": "batch", "group": "group", "none": "none"}[a.adv_norm],
        mask_truncated_completions=False,
        model_init_kwargs={"dtype": "bfloat16" if t.precision == "bf16" else "float32"},
    )


def render(tokenizer, problems, template) -> list[str]:
    """Prompt texts as our rollouts render them (data.prompts.render_prompt_ids before tokenizing); TRL
    tokenizes a plain-text prompt with the tokenizer's defaults, so the ids are checked against ours."""
    from megatron_rl.data.prompts import build_messages, render_prompt_ids

    texts = []
    for p in problems:
        text = tokenizer.apply_chat_template(build_messages(p, template), tokenize=False, add_generation_prompt=True,
                                             **template.chat_template_kwargs) + template.assistant_prefix
        if tokenizer(text)["input_ids"] != render_prompt_ids(tokenizer, p, template):
            raise SystemExit(f"prompt of {p.problem_id}: TRL's tokenization differs from our rollouts'")
        texts.append(text)
    return texts


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from transformers import AutoTokenizer, TrainerCallback

    from megatron_rl.config import load_config
    from megatron_rl.control.problems import ProblemQueue
    from megatron_rl.data.prompts import get_template
    from megatron_rl.data.sources import read_jsonl
    from megatron_rl.reward import score

    cfg = load_config(args.config, args.overrides)
    seed = cfg.trainer.seed + args.seed_offset
    data_seed = cfg.data.seed + args.seed_offset
    if cfg.data.source != "jsonl" or not cfg.data.eval_path:
        raise SystemExit("needs data.source jsonl and a data.eval_path (the demo's)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model)
    template = get_template(cfg.data)
    problems = read_jsonl(cfg.data.path, cfg.data, key="data.path")
    queue = ProblemQueue(problems, data_seed)
    need = cfg.run.updates * (cfg.rollout.n_batch // cfg.rollout.group_size)
    ordered = [queue.next() for _ in range(max(need, len(problems)))]  # our controller's issue order
    eval_problems = read_jsonl(cfg.data.eval_path, cfg.data, key="data.eval_path")
    if cfg.run.eval_max_problems:
        eval_problems = eval_problems[: cfg.run.eval_max_problems]
    train = datasets.Dataset.from_list([{"prompt": text, "task_json": json.dumps(p.task)}
                                        for p, text in zip(ordered, render(tokenizer, ordered, template))])

    prefix = template.assistant_prefix
    grade_s: list[float] = []

    def reward(prompts, completions, completion_ids, task_json, **_):
        t0 = time.perf_counter()
        out = [score(json.loads(task), prefix + text, cfg.reward, num_tokens=len(ids)).total
               for text, ids, task in zip(completions, completion_ids, task_json)]
        grade_s.append(time.perf_counter() - t0)
        return out

    fields = grpo_fields(cfg, seed, args.out_dir or str(Path(args.result).parent / "trl_out"))
    step_end: list[float] = []
    trl_logs: list[dict] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            step_end.append(time.time())

        def on_log(self, a, state, control, logs=None, **kw):  # TRL's own per-step metrics (reward, lengths, ...)
            if logs:
                trl_logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    t_init = time.time()
    trainer = GRPOTrainer(model=cfg.trainer.model, reward_funcs=reward, args=GRPOConfig(**fields),
                          train_dataset=train, processing_class=tokenizer, callbacks=[Stamps()])
    gen_s: list[float] = []
    generate = trainer._generate  # timed: HF generate of one generation batch (prompts -> completion ids)

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_s.append(time.perf_counter() - t0)

    trainer._generate = timed_generate
    t_train = time.time()
    trainer.train()
    t_trained = time.time()
    held_out = evaluate(trainer, tokenizer, eval_problems, render(tokenizer, eval_problems, template), cfg, prefix,
                        args.eval_batch, score)
    result = {
        "t_launch": T_LAUNCH, "t_init": t_init, "t_train": t_train, "t_trained": t_trained, "t_end": time.time(),
        "step_end": step_end, "generate_s": gen_s, "grade_s": grade_s, "logs": trl_logs, "eval": held_out,
        "grpo_config": fields, "threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 0


def evaluate(trainer, tokenizer, problems, texts, cfg, prefix, batch, score) -> dict:
    """pass@1 on the held-out problems, one sample each, graded by our reward.score (correct > 0, as
    control/evaluation.py counts), sampled as in training unless run.eval_temperature says otherwise."""
    import copy

    import torch

    t0 = time.time()
    model = trainer.model
    model.eval()
    gen_cfg = copy.deepcopy(trainer.generation_config)
    temperature = cfg.rollout.temperature if cfg.run.eval_temperature is None else cfg.run.eval_temperature
    if temperature == 0:
        gen_cfg.do_sample, gen_cfg.temperature = False, None
    else:
        gen_cfg.temperature = temperature
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    correct = fmt = 0
    eos = set(trainer.eos_token_ids) if hasattr(trainer, "eos_token_ids") else {tokenizer.eos_token_id}
    try:
        for start in range(0, len(texts), batch):
            enc = tokenizer(texts[start:start + batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**enc, generation_config=gen_cfg)
            for row, p in zip(out[:, enc["input_ids"].shape[1]:].tolist(), problems[start:start + batch]):
                ids = []
                for tok in row:
                    ids.append(tok)
                    if tok in eos:
                        break
                text = tokenizer.decode(ids, skip_special_tokens=True)
                b = score(p.task, prefix + text, cfg.reward, num_tokens=len(ids))
                correct += bool(b.correct)
                fmt += bool(b.format_ok)
    finally:
        tokenizer.padding_side = side
    n = len(problems)
    return {"problems": n, "pass@1": correct / n, "format_rate": fmt / n, "wall_s": time.time() - t0}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
