"""`Generator.completions()` (all pending) ends only once every submitted sample was delivered, also while
the last finished sample's worker still flushes a stale prefix cache (an HTTP call after a weight push):
the server here is a stand-in (no SGLang needed for the bookkeeping), the flush is made slow on purpose."""
import time
from types import SimpleNamespace

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout.generator import Generator


class _Client:
    def __init__(self, flush_s: float):
        self.flush_s = flush_s
        self.flushes = 0

    def generate(self, body: dict) -> dict:
        ids = [7, 8, 9]
        return {"output_ids": ids, "text": "",
                "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids], "weight_version": "0",
                              "finish_reason": {"type": "length"}}}

    def flush_cache(self) -> bool:
        self.flushes += 1
        time.sleep(self.flush_s)
        return True


def _generator(flush_s: float) -> Generator:
    server = SimpleNamespace(spec=SimpleNamespace(initial_version=0), incarnation=0, client=_Client(flush_s),
                             alive=lambda: False, stop=lambda: None)
    gen = Generator(server, RolloutConfig(group_size=4, n_async=8))
    gen.cache.dirty = True  # as after a weight push: the last finisher flushes before going idle
    return gen


def test_completions_waits_for_a_sample_whose_worker_is_still_flushing():
    gen = _generator(flush_s=0.5)
    try:
        gen.submit("g", [1, 2, 3])
        got = [(r.group_id, r.sample_index) for r in gen.completions(timeout=10)]
        assert sorted(got) == [("g", i) for i in range(4)]
        assert gen.server.client.flushes >= 1 and gen.in_flight == 0
    finally:
        gen.close()

