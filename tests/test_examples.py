"""Every Python example in the README and the docs runs as written.

* README.md: each ```python block on its own, in a fresh process.
* docs/**/*.md: a page's ```python blocks in order, in one fresh process
  (later blocks see what earlier ones defined), so a page reads top to bottom.

Each runs in an empty folder with no device count set from outside: an example
that needs 8 simulated CPU devices says so itself
(``jax.config.update("jax_num_cpu_devices", 8)``). A block that cannot run here
(a GPU, Weights & Biases online, several hosts) carries
``<!-- not run: why -->`` on the line above its fence; the reason is required
and the block is still checked to compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->\s*$")
TIMEOUT_S = 240

# Runs in the example's process: executes the blocks in order in one namespace
# and names the file and line of the block that fails.
DRIVER = textwrap.dedent(
    """
    import json, sys, traceback
    blocks = json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__"}
    for where, code in blocks:
        try:
            exec(compile(code, where, "exec"), namespace)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            print(f"example failed: {where}", file=sys.stderr)
            sys.exit(1)
    """
)


class Block:
    def __init__(self, path: Path, line: int, code: str, skip: str | None):
        self.path, self.line, self.code, self.skip = path, line, code, skip

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, with the line each starts on."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang, start = len(match.group(1)), match.group(2), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            body.append(lines[i][indent:])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path}:{start + 1}: code fence never closed")
        i += 1
        if lang != "python":
            continue
        skip = None
        if start > 0 and (m := NOT_RUN.match(lines[start - 1].strip())):
            skip = m.group(1)
            assert skip, f"{path}:{start}: 'not run:' needs a reason"
        out.append(Block(path, start + 2, "\n".join(body) + "\n", skip))
    return out


def docs_pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def run_blocks(blocks: list[Block], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS") and not k.startswith("PYTEST")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    payload = json.dumps([(b.where, b.code) for b in blocks if b.skip is None])
    return subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=payload,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=TIMEOUT_S,
        check=False,
    )


README_BLOCKS = blocks_of(ROOT / "README.md")


@pytest.mark.parametrize("block", README_BLOCKS, ids=lambda b: b.where)
def test_readme_block_runs_on_its_own(block, tmp_path):
    compile(block.code, block.where, "exec")
    if block.skip is not None:
        return
    out = run_blocks([block], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


@pytest.mark.parametrize("page", docs_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_page_runs_top_to_bottom(page, tmp_path):
    blocks = blocks_of(page)
    for block in blocks:
        compile(block.code, block.where, "exec")
    if all(b.skip is not None for b in blocks):
        return
    out = run_blocks(blocks, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


def test_skipped_blocks_are_rare_and_explained():
    """A block marked not to run says why, and most examples do run."""
    everything = README_BLOCKS + [b for p in docs_pages() for b in blocks_of(p)]
    skipped = [b for b in everything if b.skip is not None]
    assert everything
    assert len(skipped) <= len(everything) // 4, [b.where for b in skipped]
    for block in skipped:
        assert len(block.skip) >= 8, f"{block.where}: say why it is not run"


def test_the_parser_finds_blocks_lines_and_reasons(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\ntext\n\n<!-- not run: needs a GPU -->\n"
        "```python\ny = 2\n```\n\n```bash\nmake demo\n```\n"
        "- item:\n\n  ```python\n  z = 3\n  ```\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = blocks_of(page)
        assert [(b.line, b.code, b.skip) for b in found] == [
            (4, "x = 1\n", None),
            (11, "y = 2\n", "needs a GPU"),
            (20, "z = 3\n", None),
        ]
        assert found[0].where == "page.md:4"
    finally:
        ROOT = saved
    unclosed = tmp_path / "bad.md"
    unclosed.write_text("```python\nx = 1\n")
    with pytest.raises(AssertionError, match="never closed"):
        blocks_of(unclosed)


def test_a_failing_block_is_named(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nraise ValueError(x)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        out = run_blocks(blocks_of(page), tmp_path)
    finally:
        ROOT = saved
    assert out.returncode == 1
    assert "example failed: p.md:6" in out.stderr
    assert "ValueError: 1" in out.stderr
