"""Evaluation: sampling completions for problems (sampling: an SGLang server or a file of completions made
elsewhere) and scoring them with the project's verifiers (scoring: pass@1 / pass@k per task kind and
language). Offline `megatron-rl evaluate` and the evaluation during training (control/evaluation.py)
aggregate with the same `scoring.problem_result` and `summarize`; `filter difficulty` samples with it."""
