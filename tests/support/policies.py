"""Policies for trainer tests: a Trainer on a local HF model, HF copies of its weights, HF-side
logprobs, real samples of a policy and the exact per-token KL between two HF models."""
from __future__ import annotations

import torch

from megatron_rl.config import config_from_dict
from megatron_rl.records import TrainSequence

EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_trainer(model_dir, algo=None, **trainer):
    from megatron_rl.train.trainer import Trainer

    base = {"model": str(model_dir), "precision": "fp32", "micro_batch_tokens": 24, "lr": 1e-3, "grad_clip": 1e6}
    base.update(trainer)
    algo = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, **(algo or {})}
    return Trainer(config_from_dict({"trainer": base, "algo": algo}))


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_policy(trainer, model_dir):
    """An HF copy of the trainer's CURRENT weights."""
    from megatron_rl.train.hf_weights import export_hf_tensors

    model = hf_model(model_dir)
    state = dict(export_hf_tensors(trainer.model_chunks, dtype=torch.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def completion_logprobs(model, seq: TrainSequence, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor(seq.token_ids)[None]
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    pos = torch.arange(seq.prompt_len - 1, len(seq.token_ids) - 1)
    return logp[pos, ids[0, pos + 1]]


def sample_groups(policy, seed: int, n_groups=4, group_size=4, new_tokens=6) -> list[TrainSequence]:
    """Real samples of the HF policy (T=1, no top-k), rewarded for even token ids, group-centred."""
    torch.manual_seed(seed)
    seqs = []
    for k in range(n_groups):
        prompt = torch.randint(3, policy.config.vocab_size, (3,))
        with torch.no_grad():
            out = policy.generate(prompt[None].repeat(group_size, 1), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=0)
        rewards = (out[:, 3:] % 2 == 0).float().mean(1)
        for ids, r in zip(out.tolist(), (rewards - rewards.mean()).tolist()):
            s = TrainSequence(ids, 3, [0.0] * new_tokens, advantage=r, group_id=f"{seed}/{k}")
            with torch.no_grad():
                s.behaviour_logprobs = completion_logprobs(policy, s).tolist()
            seqs.append(s)
    return seqs


def exact_token_kl(policy, ref, seqs) -> float:
    """Mean over sequences of sum_t KL(policy(.|prefix) || ref(.|prefix)) with full distributions."""
    total = 0.0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s.token_ids)[None]
            pos = torch.arange(s.prompt_len - 1, len(s.token_ids) - 1)
            lp = torch.log_softmax(policy(ids).logits[0, pos].double(), -1)
            lr = torch.log_softmax(ref(ids).logits[0, pos].double(), -1)
            total += float((lp.exp() * (lp - lr)).sum())
    return total / len(seqs)
