"""Real Megatron-Core on gloo: TP=2 forward/backward equals TP=1 (2 processes, torchrun)."""
from pathlib import Path

from support.torchrun import run_two_ranks

SCRIPT = Path(__file__).parent / "scripts" / "megatron_tp_smoke.py"


def test_tp2_matches_tp1():
    run_two_ranks(SCRIPT, expect="max|dlogits|")  # each rank prints its TP=2 vs TP=1 differences
