"""On-policy distillation in the trainer, against HF transformers: the teacher (another family, size and
padded vocabulary, the student's tokenizer) scores the sampled tokens as HF does, every sampled token's
advantage is exactly the normalised reward advantage + coef * (teacher - student at the update start),
distill_only drops the reward part, a teacher equal to the student adds exactly 0, and a teacher with
another tokenizer is refused naming algo.teacher (tests/e2e/test_distill_run.py: the student moves
toward the teacher in a real run)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from megatron_rl.config import ConfigError, config_from_dict
from megatron_rl.records import Batch, TrainSequence
from support.policies import completion_logprobs, hf_model, hf_policy, make_trainer, sample_groups
from support.train_models import make_tiny_hf

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def teacher_dir(tiny_llama_dir, tmp_path_factory):
    """A 3-layer Qwen3 (hidden 48) with 400 vocabulary rows and the tiny Llama's tokenizer files."""
    folder = make_tiny_hf(tmp_path_factory.mktemp("teacher"), family="qwen3", layers=3, vocab=400, seed=3)
    for f in tiny_llama_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    return folder


def make_seqs(model, seed=0) -> list[TrainSequence]:
    """Real samples of `model` in 2 groups of 3, scored as if sampled at TEMPERATURE (the passes temper)."""
    return [dataclasses.replace(s, temperature=TEMPERATURE)
            for s in sample_groups(model, seed=seed, n_groups=2, group_size=3, new_tokens=5)]


def normalised(seqs) -> list[float]:
    """Token-weighted minibatch normalisation (Magistral), written out."""
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    mean = (adv * lens).sum() / lens.sum()
    return ((adv - mean) / ((((adv - mean) ** 2) * lens).sum() / lens.sum()).sqrt()).tolist()


def prepared_advantages(trainer, seqs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the advantages and the teacher logprobs of its sampled tokens, as the step will read them."""
    from megatron_rl.train.update import prepare_update

    (prepared,) = prepare_update(trainer.model, trainer.reference, [seqs], trainer.ctx, trainer.teacher)
    adv, teacher = [None] * len(seqs), [None] * len(seqs)
    for mb in prepared.packed.micro_batches:
        for j, local in enumerate(mb.seq_indices):
            sel = (mb.segment_ids == j) & (mb.loss_mask[0] > 0)
            adv[prepared.share[local]] = mb.advantages[0, sel].double()
            teacher[prepared.share[local]] = mb.teacher_logprobs[0, sel].double()
    return adv, teacher


def moved_trainer(tiny_llama_dir, algo):
    """A trainer one plain update away from its initial weights, so that student != behaviour model."""
    trainer = make_trainer(tiny_llama_dir, algo={"drop_non_diverse_groups": False, **algo}, micro_batch_tokens=64)
    trainer.train_on(Batch(make_seqs(hf_model(tiny_llama_dir), seed=9), n_mini=1, policy_version=0))
    return trainer


@pytest.mark.parametrize("only", [False, True])
def test_each_sampled_token_gains_coef_times_teacher_minus_student(tiny_llama_dir, teacher_dir, only):
    coef = 0.5
    trainer = moved_trainer(tiny_llama_dir, {"teacher": str(teacher_dir), "distill_coef": coef, "distill_only": only})
    student, teacher = hf_policy(trainer, tiny_llama_dir), hf_model(teacher_dir)
    seqs = make_seqs(hf_model(tiny_llama_dir), seed=1)
    with torch.no_grad():
        want_teacher = [completion_logprobs(teacher, s, TEMPERATURE).double() for s in seqs]
        want_student = [completion_logprobs(student, s, TEMPERATURE).double() for s in seqs]
    got_adv, got_teacher = prepared_advantages(trainer, seqs)
    reward = [0.0] * len(seqs) if only else normalised(seqs)
    for k in range(len(seqs)):
        torch.testing.assert_close(got_teacher[k], want_teacher[k], rtol=1e-5, atol=1e-5)
        want = reward[k] + coef * (want_teacher[k] - want_student[k])
        torch.testing.assert_close(got_adv[k], want, rtol=1e-5, atol=1e-5)
    kl = torch.cat([s - t for s, t in zip(want_student, want_teacher)])
    assert float(kl.abs().mean()) > 1e-2  # the teacher really differs from the student
    metrics = trainer.train_on(Batch(seqs, n_mini=1, policy_version=1))
    assert metrics["distill/teacher_kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert metrics["distill/advantage_abs"] == pytest.approx(coef * float(kl.abs().mean()), rel=1e-4)


def test_a_teacher_equal_to_the_student_adds_exactly_nothing(tiny_llama_dir):
    trainer = make_trainer(tiny_llama_dir, algo={"teacher": str(tiny_llama_dir), "distill_coef": 3.0},
                           micro_batch_tokens=64)
    seqs = make_seqs(hf_model(tiny_llama_dir), seed=2)
    got, _ = prepared_advantages(trainer, seqs)
    reward = torch.tensor(normalised(seqs), dtype=torch.float32).double()
    for k in range(len(seqs)):
        assert torch.all(got[k] == reward[k])  # same weights, same numerics: teacher - student == 0
    assert trainer.train_on(Batch(seqs, n_mini=1, policy_version=0))["distill/teacher_kl"] == 0.0


class _Tokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_key():
    from megatron_rl.train.teacher import check_same_vocab

    check_same_vocab(_Tokenizer({"a": 0, "b": 1}), _Tokenizer({"b": 1, "a": 0}), "t")
    with pytest.raises(ConfigError, match=r"^algo.teacher: big does not share the student's tokenizer \(2 tokens"):
        check_same_vocab(_Tokenizer({"a": 0, "b": 1}), _Tokenizer({"a": 1, "b": 0}), "big")
    with pytest.raises(ConfigError, match="1 tokens differ, e.g. 'c': None vs 2"):
        check_same_vocab(_Tokenizer({"a": 0, "b": 1}), _Tokenizer({"a": 0, "b": 1, "c": 2}), "big")


@pytest.mark.parametrize("algo, key", [
    ({"distill_coef": 1.0}, "algo.distill_coef"),
    ({"teacher": "m", "distill_coef": -1.0}, "algo.distill_coef"),
    ({"teacher": "m", "distill_only": True, "drop_non_diverse_groups": False}, "algo.distill_only"),
    ({"teacher": "m", "distill_coef": 1.0, "distill_only": True}, "algo.distill_only"),
    ({"teacher": "m", "distill_coef": 1.0, "distill_only": True, "drop_non_diverse_groups": False,
      "kl_mode": "reward"}, "algo.distill_only"),
    ({"teacher": " "}, "algo.teacher"),
])
def test_refused_distillation_settings_name_their_key(algo, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        config_from_dict({"algo": algo})
