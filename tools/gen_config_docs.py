#!/usr/bin/env python
"""Regenerate docs/config.md from megatron_rl/config/ (`--check`: exit 1 if it is out of date)."""
import sys
from pathlib import Path

from megatron_rl.config.docs import render

TARGET = Path(__file__).resolve().parents[1] / "docs" / "config.md"

if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        ok = TARGET.is_file() and TARGET.read_text() == text
        print(f"{TARGET}: {'up to date' if ok else 'OUT OF DATE: run python tools/gen_config_docs.py'}")
        sys.exit(0 if ok else 1)
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
