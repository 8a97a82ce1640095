"""The records of the rollout path: a group request travels whole (prompt ids once) and is submitted as
is; a rollout brings its length stage back and round-trips through checkpoint JSON; an episode's
environment tokens (loss_mask 0) count nowhere a model token's version or loss would."""
from __future__ import annotations

import json
import pickle

import pytest

from megatron_rl.config import LengthStage
from megatron_rl.control.budget import ReadySequence, token_staleness
from megatron_rl.control.generator_worker import _submit
from megatron_rl.control.metrics import rollout_stats
from megatron_rl.control.protocol import GenerateRequest
from megatron_rl.records import ENV_LOGPROB, ENV_VERSION, GroupRequest, Rollout

STAGE = LengthStage(10, 64, 64, 16)


def _episode(**kw) -> Rollout:
    """Two model turns (versions 3 and 5) with two environment tokens between them."""
    return Rollout("p#1", 0, [1, 2], [7, 8, 20, 21, 9], [-0.1, -0.2, ENV_LOGPROB, ENV_LOGPROB, -0.3],
                   [3, 3, ENV_VERSION, ENV_VERSION, 5], "stop", stage=STAGE, loss_mask=[1, 1, 0, 0, 1], **kw)


def test_a_group_request_carries_its_prompt_once_its_stage_cap_and_its_sampling():
    g = GroupRequest("p#1", list(range(1000)), [0, 1, 2, 3], STAGE, {"temperature": 0.6})
    assert g.keys == [("p#1", i) for i in range(4)]
    assert g.sampling_overrides() == {"max_new_tokens": 64, "temperature": 0.6}
    assert GroupRequest("e", [1], [0], sampling={"max_new_tokens": 5}).sampling_overrides() == {"max_new_tokens": 5}
    one = len(pickle.dumps(GenerateRequest([g])))
    assert one < len(pickle.dumps(list(range(1000)))) * 2  # not once per sample
    with pytest.raises(ValueError, match="distinct"):
        GroupRequest("p#1", [1], [0, 0])
    with pytest.raises(ValueError, match="at least one"):
        GroupRequest("p#1", [1], [])


def test_the_generator_rank_submits_each_group_as_it_came():
    class FakeGenerator:
        def __init__(self):
            self.groups = []

        def submit_group(self, group):
            self.groups.append(group)

    groups = [GroupRequest("a#1", [1, 2], [0, 1], STAGE), GroupRequest("eval@1/0", [3], [2], STAGE, {"temperature": 0.6})]
    gen = FakeGenerator()
    _submit(gen, pickle.loads(pickle.dumps(GenerateRequest(groups))))
    assert gen.groups == groups


def test_a_rollout_keeps_its_stage_and_loss_mask_through_checkpoint_json():
    r = _episode(reward=0.5, reward_components={"correct": 1.0})
    again = Rollout.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r and again.stage == STAGE and again.loss_mask == [1, 1, 0, 0, 1]
    single = Rollout("p#1", 1, [1], [7, 8], [-0.1, -0.2], [4, 4], "stop", stage=STAGE)
    assert Rollout.from_dict(json.loads(json.dumps(single.to_dict()))) == single and single.loss_mask is None


def test_an_episode_validates_its_mask_and_counts_only_the_models_versions():
    r = _episode()
    assert r.model_versions == [3, 3, 5] and r.oldest_version == 3
    assert token_staleness([r], 6) == pytest.approx(6 - 11 / 3)  # environment tokens have no version
    stats = rollout_stats([r], 6)
    assert stats["staleness/max"] == 3.0 and stats["versions_per_sequence/mean"] == 2.0
    assert (stats["length/cap_mean"], stats["length/l_max_mean"]) == (64, 64)
    seq = ReadySequence(r, 0.5, r.group_id).to_train_sequence()
    assert seq.loss_mask == [1, 1, 0, 0, 1] and seq.n_loss_tokens == 3 and seq.completion_len == 5
    assert seq.model_versions == [3, 3, 5]
    single = ReadySequence(Rollout("p#1", 1, [1], [7, 8], [-0.1, -0.2], [4, 4], "stop"), 0.5, "p#1").to_train_sequence()
    assert single.loss_mask is None and single.n_loss_tokens == 2
    with pytest.raises(ValueError, match="loss mask of 4"):
        Rollout("p#1", 0, [1], [7, 8, 9, 10, 11], [0.0] * 5, [0] * 5, "stop", loss_mask=[1, 0, 0, 1])
    with pytest.raises(ValueError, match="0 \\(environment\\) or 1"):
        Rollout("p#1", 0, [1], [7, 8], [0.0] * 2, [0] * 2, "stop", loss_mask=[1, 2])
