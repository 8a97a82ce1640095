"""The blocks of docs/getting_started.md, your_model_and_data.md and environments.md, run as a reader
runs them, so the docs cannot drift from the code.

Each doc's blocks run in order, one pytest case per block, in one folder per doc: getting_started in
a copy of the working tree (its commands use `examples/` and `./dev` from the repository root),
the others in an empty folder (a user's own project: nothing from the repository may be
needed). Blocks, by their fence:
- ```bash: run with `bash -e -o pipefail`; exported variables carry over to the doc's next blocks;
- a block whose first line is `$ command`: a transcript; each command runs (its exit status is not
  checked: transcripts show errors too) and each line under it must appear in its output, in
  order, with `...` matching anything and the log lines' `HH:MM:SS ` time left out on both sides;
- a block whose first line is `# NAME.ext` (python, yaml, ...): the file the reader writes, NAME;
- any other block is prose (sample output, formats) and is not a case.
A block that needs a GPU, a cluster, an endpoint or more time than CI has follows the line
`<!-- docs-test: skip REASON -->` and is skipped with that reason. A block needs the ones before it
(files, exports): select whole docs (`-k your_model_and_data`), not single blocks.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("getting_started.md", "your_model_and_data.md", "environments.md")
IN_CLONE = {"getting_started.md"}
BLOCK_TIMEOUT_S = 600
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(.+?)\s*-->\s*$")
FILE_NAME = re.compile(r"#\s+([\w.-]+\.(?:py|yaml|yml|json|jsonl|txt|toml))\s*$")
LOG_TIME = re.compile(r"^\d\d:\d\d:\d\d ")

pytestmark = [pytest.mark.long, pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)]


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    kind: str  # "shell", "transcript" or "file"
    text: str
    skip: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}-{self.kind}"


def _kind(lang: str, text: str) -> str | None:
    first = text.split("\n", 1)[0]
    if lang in ("bash", "sh"):
        return "shell"
    if first.startswith("$ "):
        return "transcript"
    return "file" if FILE_NAME.fullmatch(first) else None


def doc_blocks(doc: str, source: str) -> list[Block]:
    blocks = []
    for m in FENCE.finditer(source):
        kind = _kind(m.group(1), m.group(2))
        if kind is None:
            continue
        before = source[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = SKIP.search(before)
        blocks.append(Block(doc, source.count("\n", 0, m.start()) + 1, kind, m.group(2),
                            marker.group(1) if marker else None))
    return blocks


def _cases():
    for doc in DOCS:
        for b in doc_blocks(doc, (ROOT / "docs" / doc).read_text()):
            marks = [pytest.mark.skip(reason=b.skip)] if b.skip else []
            yield pytest.param(b, id=b.id, marks=marks)


class DocSession:
    """One doc's folder and exported environment, shared by its blocks in order."""

    def __init__(self, doc: str, tmp: Path):
        self.cwd = tmp / "clone" if doc in IN_CLONE else tmp / "work"
        self.env_file = tmp / "exported.sh"
        self.failed: str | None = None
        if doc in IN_CLONE:
            _copy_working_tree(self.cwd)
        else:
            self.cwd.mkdir()
        # the reader's shell: the project's environment active, as the docs ask
        venv_bin = Path(sys.executable).parent
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HF_HOME", "HF_HUB_CACHE"))}
        env["PATH"] = f"{venv_bin}:{env['PATH']}"
        env["VIRTUAL_ENV"] = str(venv_bin.parent)
        self.env_file.write_text("".join(f"export {k}={_quote(v)}\n" for k, v in env.items()))

    def bash(self, script: str, keep_exports: bool = True) -> subprocess.CompletedProcess:
        """`script` after the exports of the blocks before it; its own exports are kept for the next."""
        save = f'\nexport -p > "{self.env_file}"' if keep_exports else ""
        wrapped = f'set -e -o pipefail\nsource "{self.env_file}"\n{script}{save}\n'
        return subprocess.run(["bash", "-c", wrapped], cwd=self.cwd, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S, env={"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]})


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def _copy_working_tree(dest: Path) -> None:
    """The files a clone has, as they are in the working tree now (tracked and new, not ignored),
    with the project's environment as its `.venv`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(Path(sys.executable).parent.parent)


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """doc -> its DocSession, made when the doc's first selected block runs."""
    made: dict[str, DocSession] = {}

    def session(doc: str) -> DocSession:
        if doc not in made:
            made[doc] = DocSession(doc, tmp_path_factory.mktemp(doc.removesuffix(".md")))
        return made[doc]

    return session


def transcript(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each `$ command` of a transcript block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif line.strip() != "...":
            steps[-1][1].append(line)
    return steps


def _pattern(expected: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in LOG_TIME.sub("", expected).split("...")))


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines that do not match, in order, a line of `output` (all matched: [])."""
    actual = iter(LOG_TIME.sub("", line.rstrip()) for line in output.split("\n"))
    for i, want in enumerate(expected):
        pattern = _pattern(want)
        if not any(pattern.fullmatch(line) for line in actual):
            return expected[i:]
    return []


def _run(block: Block, session: DocSession) -> None:
    if block.kind == "file":
        name = FILE_NAME.fullmatch(block.text.split("\n", 1)[0]).group(1)
        (session.cwd / name).write_text(block.text)
    elif block.kind == "shell":
        done = session.bash(block.text)
        assert done.returncode == 0, \
            f"exit {done.returncode}\n{block.text}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    else:
        for command, expected in transcript(block.text):
            done = session.bash(command, keep_exports=False)
            output = done.stdout + done.stderr
            missing = missing_lines(expected, output)
            assert not missing, f"$ {command}\nnot in its output: {missing[0]!r}\noutput:\n{output[-6000:]}"


@pytest.mark.parametrize("block", list(_cases()))
def test_doc_block(block: Block, sessions):
    session = sessions(block.doc)
    if session.failed:
        pytest.skip(f"an earlier block of {block.doc} failed ({session.failed})")
    try:
        _run(block, session)
    except BaseException:
        session.failed = block.id
        raise


def test_the_parser_finds_each_kind_and_the_skip_reason():
    source = ("Intro\n```bash\necho hi\n```\n<!-- docs-test: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n"
              "```python\n# a.py\nprint(1)\n```\n```\n$ echo hi\n... hi\n```\n```\nsample output\n```\n")
    got = [(b.line, b.kind, b.skip) for b in doc_blocks("x.md", source)]
    assert got == [(2, "shell", None), (6, "shell", "needs a GPU"), (9, "file", None), (13, "transcript", None)]
    assert transcript("$ echo a\n...\na\n$ true\n") == [("echo a", ["a"]), ("true", [])]
    assert missing_lines(["00:00:00 [x] ERROR a ... c"], "12:34:56 [x] ERROR a b c\n") == []
    assert missing_lines(["b", "a"], "a\nb\n") == ["a"]  # order matters
