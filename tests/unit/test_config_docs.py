"""docs/config.md is generated from megatron_rl/config/ and must be up to date."""
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.config.docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_config_table_is_up_to_date():
    assert DOC.read_text() == render(), "docs/config.md is stale: run python tools/gen_config_docs.py"


def test_every_key_has_a_row_with_its_default_and_a_meaning():
    from test_config_keys_read import config_keys  # nested blocks (trainer.lora) give one row per key

    text = render()
    for key in config_keys(Config):
        rows = [l for l in text.splitlines() if l.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        assert not rows[0].rstrip().endswith("|  |"), f"{key} has no meaning"
