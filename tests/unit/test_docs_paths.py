"""Every repository path the docs and the README name (in `backticks`) exists, so a move of a module,
script or test cannot leave the docs pointing at nothing. Placeholders (NAME, ARM, seedK, ...) are
matched as globs; `path:line` and `path::test` name the path part."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("megatron_rl", "tests", "examples", "benchmarks", "env", "csrc", "tools", "docs", "experiments")
PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./*-]*)(?:[:`])" % "|".join(TOP))
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*[A-Z]\b|seedK|K\b")  # NAME, ARM, seedK: any name there


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths(text: str) -> set[str]:
    return {m.group(1).rstrip(".") for m in PATH.finditer(text)}


def exists(path: str) -> bool:
    pattern = PLACEHOLDER.sub("*", path.rstrip("/"))
    return any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()


def test_every_path_named_in_the_docs_exists():
    missing = {f"{doc.relative_to(ROOT)}: {p}" for doc in doc_files() for p in named_paths(doc.read_text())
               if not exists(p)}
    assert not missing, "\n".join(sorted(missing))


def test_the_check_sees_paths_and_misses():
    text = "see `megatron_rl/records.py`, `tests/unit/test_docs_paths.py::test_x` and `megatron_rl/nowhere.py`"
    assert named_paths(text) == {"megatron_rl/records.py", "tests/unit/test_docs_paths.py", "megatron_rl/nowhere.py"}
    assert exists("megatron_rl/records.py") and not exists("megatron_rl/nowhere.py")
    assert exists("experiments/NAME/experiment.yaml")
