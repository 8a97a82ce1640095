"""Routing replay on the generator side: SGLang's routed experts (base64 int32 [rows, layers, topk]) into
uint8 / uint16 ids, a turn's routes from the position it asked from, an episode's routes over its turns,
and the compact record through a controller checkpoint (JSON)."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from megatron_rl.records import Rollout, RoutedExperts, TrainSequence
from megatron_rl.rollout.episode import Episode
from megatron_rl.rollout.outputs import MalformedOutput, Turn
from megatron_rl.rollout.routing import MissingRoutes, RoutingShape

SHAPE = RoutingShape(layers=3, topk=2, experts=8)


def sglang_routes(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode()


def answer(ids, prompt_tokens, routes=None, fr="stop"):
    meta = {"finish_reason": {"type": fr}, "weight_version": "0", "prompt_tokens": prompt_tokens,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    if routes is not None:
        meta["routed_experts"] = sglang_routes(routes)
    return {"output_ids": ids, "meta_info": meta}


def rows(n: int, seed: int, experts: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, experts, (n, SHAPE.layers, SHAPE.topk))


def test_ids_take_one_byte_up_to_256_experts_and_two_beyond():
    routes = rows(5, 0)
    got = SHAPE.decode({"routed_experts": sglang_routes(routes)}, 5)
    assert got.dtype == np.uint8 and np.array_equal(got, routes)
    assert SHAPE.record(got).bytes_per_position == 6
    wide = RoutingShape(3, 2, 300)
    big = rows(4, 1, experts=300)
    record = wide.record(wide.decode({"routed_experts": sglang_routes(big)}, 4))
    assert record.itemsize == 2 and record.positions == 4
    assert np.array_equal(np.frombuffer(record.ids, "<u2").reshape(4, 3, 2), big)
    with pytest.raises(MissingRoutes, match="--enable-return-routed-experts"):
        SHAPE.decode({}, 5)
    with pytest.raises(MissingRoutes, match="routed expert ids"):
        SHAPE.decode({"routed_experts": sglang_routes(routes)}, 4)


def test_turn_takes_the_rows_from_where_it_asked():
    routes = rows(7, 2)  # prompt 5 + output 4 - 1 - start 1
    turn = Turn.of(answer([1, 2, 3, 4], 5, routes), SHAPE, routes_from=1)
    assert np.array_equal(turn.routes, routes)
    with pytest.raises(MalformedOutput, match="no routed_experts"):
        Turn.of(answer([1, 2], 5), SHAPE)
    assert Turn.of(answer([1, 2], 5, fr="abort"), SHAPE).routes is None  # aborted: never collected
    assert Turn.of(answer([1, 2], 5, rows(6, 0))).routes is None  # not asked for


def test_episode_strings_its_turns_routes():
    first, second = rows(5 + 3 - 1, 3), rows(1 + 2 + 3 - 1, 4)
    ep = Episode([9] * 5)
    ep.add_turn(Turn([1, 2, 3], [-0.1] * 3, [0] * 3, "stop", routes=first))
    ep.add_observation([], [7, 7])  # the second turn asks from position 7: turn 1's last token, 2 observation
    ep.add_turn(Turn([4, 5, 6], [-0.1] * 3, [0] * 3, "stop", routes=second))
    assert len(ep.routes) == len(ep.prompt_ids) + len(ep.ids) - 1
    assert np.array_equal(ep.routes, np.concatenate([first, second]))
    rerouted = rows(len(ep.prompt_ids) + len(ep.ids) + 2 - 1, 5)  # a resumed episode's turn asks from position 0
    ep.add_turn(Turn([3, 3], [-0.1] * 2, [0] * 2, "stop", routes=rerouted))
    assert np.array_equal(ep.routes, rerouted)
    ep.add_turn(Turn([8], [-0.1], [0], "abort"))  # no routes: the trainer routes the whole episode itself
    assert ep.routes is None


def test_routes_survive_a_checkpoint_and_must_cover_the_sequence():
    record = SHAPE.record(rows(7, 5))
    r = Rollout("g", 0, [1, 2, 3], [4, 5, 6, 7, 8], [-0.1] * 5, [0] * 5, "stop", routed_experts=record)
    back = Rollout.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.routed_experts == record
    with pytest.raises(ValueError, match="expected 6"):
        Rollout("g", 0, [1, 2], [4, 5, 6, 7, 8], [-0.1] * 5, [0] * 5, "stop", routed_experts=record)
    with pytest.raises(ValueError, match="expected 8"):
        TrainSequence(list(range(9)), 3, [0.0] * 6, 1.0, routed_experts=record)
    with pytest.raises(ValueError, match="no whole number"):
        RoutedExperts(b"\x00" * 5, 3, 2)


def test_metrics_lines_carry_the_routes_bytes_and_the_agreement():
    from megatron_rl.control.metrics import batch_stats, train_values
    from megatron_rl.records import Batch

    seqs = [TrainSequence(list(range(9)), 3, [0.0] * 6, 1.0, routed_experts=SHAPE.record(rows(8, 6))),
            TrainSequence(list(range(5)), 2, [0.0] * 3, -1.0)]
    assert batch_stats(Batch(seqs, 1, 0))["batch/routed_experts_bytes"] == 8 * 6
    assert "batch/routed_experts_bytes" not in batch_stats(Batch(seqs[1:], 1, 0))
    assert train_values({"routing_agreement": 0.98, "other": 1.0}) == {"routing_agreement": 0.98}
