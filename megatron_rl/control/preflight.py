"""What `megatron-rl train` checks before any rank starts work: rewards it could not compute must not
become a run that trains on nothing (every code group dropped as a grading failure).

`check_config` holds the checks of config keys that must run code to be checked (the reward plug-in
loads, the prompt template exists): the config package validates values only and imports nothing of
the rest of megatron_rl. Its errors are the same one-line ConfigErrors naming the key.

The check runs where it is called: in the launching process and on rank 0. Verifier ranks on other
nodes are not probed here; if their sandbox cannot run, the controller stops the run once no sample
can be graded (control.grading.GradingLedger).
"""
from __future__ import annotations

from megatron_rl.config import Config, ConfigError
from megatron_rl.log import get_logger
from megatron_rl.reward.sandbox import SandboxUnavailable

# Sources whose tasks can be code: a JSONL or parquet file, and HumanEval (which the data loader refuses for
# training with its own message). reasoning_gym and champ build math tasks only.
_MAY_HOLD_CODE = ("jsonl", "parquet", "humaneval")


def code_languages(cfg: Config) -> list[str]:
    """Languages of the code tasks of the configured problem set and evaluation set (empty: none).
    Raises DataError on a problem set that cannot be loaded."""
    from megatron_rl.data import iter_problems, read_problems

    problems = list(iter_problems(cfg.data)) if cfg.data.source in _MAY_HOLD_CODE else []
    if cfg.run.eval_every:  # the evaluation set (data.eval_path) is graded by the same sandbox
        problems += read_problems(cfg.data.eval_path, cfg.data, key="data.eval_path")
    return sorted({p.task.get("language", "python") for p in problems if p.task.get("kind") == "code"})


def check_config(cfg: Config) -> None:
    """ConfigError naming the key when reward.custom or env.name cannot be loaded here, env.args do not
    fit the environment, or data.system_prompt is no known template (nor text) or data.system_prompt_file
    cannot be read."""
    from megatron_rl.data.prompts import get_template
    from megatron_rl.env import EnvLoadError, make_environment
    from megatron_rl.reward.custom import plugin_error

    if cfg.reward.custom is not None:  # load it now: a typo fails before launch, naming the key
        why = plugin_error(cfg.reward.custom)
        if why is not None:
            raise ConfigError(f"reward.custom: {why}")
    from megatron_rl.control.episodes import environment_args

    try:  # one environment made and closed: its class loads and takes env.args
        env = make_environment(cfg.env.name, environment_args(cfg))
    except EnvLoadError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # the constructor's own check of its arguments
        raise ConfigError(f"env.args: {cfg.env.name} refused them: {type(e).__name__}: {e}") from None
    try:
        env.close()
    except Exception as e:  # every episode would end the same way
        raise ConfigError(f"env.name: {cfg.env.name}: close() of an environment never reset raised "
                          f"{type(e).__name__}: {e}") from None
    try:
        get_template(cfg.data)
    except ValueError as e:
        if str(e).startswith("data.system_prompt_file"):
            raise ConfigError(f"data.system_prompt_file: {str(e).removeprefix('data.system_prompt_file ')}") from None
        raise ConfigError(f"data.system_prompt: {e}") from None


def check_model(cfg: Config) -> None:
    """ModelUnavailable (one line) when trainer.model or algo.teacher cannot be found here (no downloads)
    or is of a family the trainer does not build (the supported ones are listed); ConfigError when
    trainer.precision has no attention under the layer spec this machine gives the trainers, when the
    teacher's tokenizer is not the student's, when algo.routing_replay is on for a dense model, or when
    trainer.lora does not fit the model (check_lora)."""
    from megatron_rl.train.hf_cache import check_family
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.model import check_precision
    from megatron_rl.train.teacher import check_same_vocab

    check_precision(cfg.trainer.precision)
    sources = [resolve_model(name) for name in (cfg.trainer.model, cfg.algo.teacher) if name is not None]
    for source in sources:
        if not source.gguf_file:  # the shipped GGUF model is a Llama
            check_family(source.path)
    if cfg.algo.routing_replay:
        check_routing_replay(sources[0])
    if cfg.algo.teacher is not None:
        check_same_vocab(sources[0].tokenizer(), sources[1].tokenizer(), cfg.algo.teacher)
    if cfg.trainer.lora.rank:
        check_lora(cfg, sources[0])


def check_lora(cfg: Config, source) -> None:
    """ConfigError naming the trainer.lora key when the model or this machine's layer spec cannot take the
    adapters (a rank larger than a projection, MoE experts, Transformer Engine, dropout under full
    recompute; the adapter push on an MoE model): refused before any rank starts, as the trainers would
    refuse it (train/lora.py)."""
    from megatron_rl.platform import te_available
    from megatron_rl.train.lora import LoraSpec, check_model as check_lora_model
    from megatron_rl.train.model import model_dims

    dims = model_dims(source.config(), cfg.trainer.tensor_parallel)
    check_lora_model(LoraSpec.from_config(cfg.trainer.lora), dims, te_available(), cfg.trainer.recompute)
    if cfg.trainer.lora.push == "adapter":
        from megatron_rl.train.moe import MOE_MODEL_TYPES

        family = model_family(source)
        if family in MOE_MODEL_TYPES:
            raise ConfigError(f"trainer.lora.push: adapter on an MoE model ({family}) is not supported (SGLang's "
                              "LoRA with this project's MoE families is unverified); use merged")


def model_family(source) -> str:
    """The trained model's family (its HF model_type; a GGUF checkpoint is a Llama)."""
    from megatron_rl.train.hf_cache import check_family

    return "llama" if source.gguf_file else check_family(source.path)


def check_routing_replay(source) -> None:
    """ConfigError naming algo.routing_replay when the trained model has no MoE router to replay."""
    from megatron_rl.train.moe import MOE_MODEL_TYPES

    family = model_family(source)
    if family not in MOE_MODEL_TYPES:
        raise ConfigError(f"algo.routing_replay: trainer.model is a dense {family} model; routing replay needs an "
                          f"MoE family ({', '.join(MOE_MODEL_TYPES)})")


def warn_slow_bf16(cfg: Config) -> str | None:
    """A warning (logged, and returned) when the run computes in bf16 on a CPU without bf16 arithmetic:
    every matmul of the trainers and the generators is then converted, tens of times slower than fp32."""
    from megatron_rl.platform import cpu_has_fast_bf16, has_cuda

    if cfg.trainer.precision != "bf16" or has_cuda() or cpu_has_fast_bf16() is not False:
        return None
    why = ("trainer.precision: bf16 on a CPU without AVX512-BF16 or AMX: its matmuls run tens of times slower "
           "than fp32 here (trainers and generators); fp32 is faster on this machine")
    get_logger(__name__).warning(why)
    return why


def check_code_sandbox(cfg: Config) -> None:
    """The checks before any rank starts: the keys that need code to check (check_config), the model
    (check_model), then SandboxUnavailable (one line, with the probe's own error) when the problem set
    has code tasks and the sandbox cannot grade a program of their language here."""
    from megatron_rl.reward.code import sandbox_probe

    check_config(cfg)
    check_model(cfg)

    for language in code_languages(cfg):
        ok, why = sandbox_probe(language)
        if not ok:
            raise SandboxUnavailable(f"{cfg.data.path} has {language} code tasks but the code sandbox cannot "
                                     f"run here ({why}); `megatron-rl doctor` checks it")
    warn_slow_bf16(cfg)  # last: a run refused above needs no advice on its speed
