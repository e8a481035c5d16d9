"""Every ```python and ```js code block of README.md runs as written against a live server (issue #21 item 7).

Extraction: a block opens with a fence at the start of a line, three backticks and a language tag, and ends at
the next bare fence. ``python`` and ``js`` blocks are run; ``bash`` (commands that install packages, start servers,
build images or talk to Kubernetes), ``go`` and ``cpp`` (they need generated stubs and a toolchain) and untagged
blocks (the layout listing) are not, and any other tag fails :func:`test_block_inventory`, so a block tagged
``py`` or ``javascript`` cannot slip through unrun. A python/js block that cannot run here is marked on the line
just before its fence with ``<!-- readme-test: skip (why; which test covers it) -->``: it is reported as a skipped
test with that reason, its python still has to compile, and the skipped blocks are counted, as are the run ones,
so deleting a block, adding one or breaking the extraction fails :func:`test_block_inventory`.

Running: each block in a fresh interpreter (``sys.executable``, cwd a temporary directory), so a block that lacks
an import or uses a name it never defines fails. The README's server address ``localhost:50051`` (the quick
start's ``advantage-server --port 50051``) is rewritten to the session server's ephemeral address in the test's
copy only, and ``$ADVANTAGE_SERVICE_TARGET`` is set to it for the verl drop-in block, whose one-argument
``get_adv_estimator_fn`` reads it (verl and nemo_rl are not installed: the drop-ins must not need them). A few
lines of assertions (:data:`CHECKS`, keyed by a line of the block) are appended to some blocks to check what they
compute. The JavaScript block runs under ``node`` (CommonJS, from stdin with cwd ``examples/node``: what a script
saved beside ``advantage.js`` sees, as the README says), skipped only where node is missing.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

from test_deploy_node import EXAMPLE, NODE, node_modules  # noqa: F401 - the fixture: npm ci where it is missing

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_ADDRESS = "localhost:50051"

RUN = ("python", "js")
NOT_RUN = ("bash", "go", "cpp", "")
#: How many blocks of each kind README.md holds: change these with the README.
EXPECTED_RUN = {"python": 8, "js": 1}
EXPECTED_SKIPPED = 3

FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!-- readme-test: skip \((.+)\) -->\s*$")

#: a line a block holds -> assertions appended to that block (each must match exactly one run block)
CHECKS = {
    'res = client.compute("gae", {"gae_gamma": 0.99':
        "assert tuple(res.advantages.shape) == (B, T) and res.advantages.dtype == torch.float32\n"
        "assert tuple(res.returns.shape) == (B, T) and res.metrics == {}\n"
        "assert names[:4] == ['areal', 'gae', 'gdpo', 'gigpo'] and 'grpo' in names, names\n",
    'output_dtype="float64", as_numpy=True':
        "assert isinstance(res.advantages, np.ndarray) and res.advantages.dtype == np.float64\n"
        "assert res.advantages.shape == (4, 5)\n",
    "results = asyncio.run(advantages_per_group(groups))":
        "assert len(results) == 4 and all(tuple(x.advantages.shape) == (16, 8) for x in results)\n",
    'res = client.compute("reinforce_plus_plus", {"semantics": "openrlhf"':
        "assert tuple(res.advantages.shape) == (4, 4)\n",
    "cu_seqlens=[0, 5, 12, 14]":
        "assert tuple(res.advantages.shape) == (14,)\n",
    "from advantage_client.verl import get_adv_estimator_fn":
        # verl's GRPO: (score - group mean) / (unbiased group std + 1e-6); groups [1, 0] and [0, 1]
        "expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 ** 0.5 + 1e-6)\n"
        "torch.testing.assert_close(advantages, expected[:, None].expand(4, 3), atol=1e-6, rtol=0)\n"
        "assert returns is advantages\n",
    'RemoteAdvantageEstimator("localhost:50051"':
        "from advantage_client import AdvantageResult\n"
        "assert isinstance(result, AdvantageResult) and adv_estimator.result_format == 'advantage_result'\n"
        "adv = train_data['advantages']\n"
        "assert tuple(adv.shape) == (4, 3) and adv[0, 0] > 0 > adv[1, 0] and adv[3, 0] > 0 > adv[2, 0], adv\n",
    '("x-request-id", "run7-step42")':
        "assert dict(call.trailing_metadata())['x-request-id'] == 'run7-step42'\n"
        "assert list(response.advantages.shape) == [2, 2]\n",
}


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int          # the opening fence's line number in README.md (1-based)
    code: str
    skip: str | None   # the reason of a readme-test: skip marker just before the fence

    @property
    def id(self) -> str:
        return f"{self.lang}-L{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order. Raises ``ValueError`` for an unclosed fence or a skip marker
    that is not on the line just before a fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        marker = SKIP.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(f"README.md:{i + 1}: a readme-test: skip marker must be the line just before a fence")
        if not opened:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: the ``` fence opened here is never closed")
        before = SKIP.match(lines[i - 1]) if i else None
        blocks.append(Block(opened.group(1), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                            before.group(1) if before else None))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())
TO_RUN = [b for b in BLOCKS if b.lang in RUN]


def test_block_inventory():
    langs = {b.lang for b in BLOCKS}
    assert langs <= set(RUN + NOT_RUN), f"README blocks tagged {sorted(langs - set(RUN + NOT_RUN))}: " \
        f"tag them python or js (run here) or one of {NOT_RUN} (not run), or teach this test the tag"
    ran = {lang: sum(1 for b in TO_RUN if b.lang == lang and b.skip is None) for lang in RUN}
    skipped = [(b.id, b.skip) for b in TO_RUN if b.skip is not None]
    assert ran == EXPECTED_RUN, f"README blocks run: {ran}, expected {EXPECTED_RUN} (update the counts with the README)"
    assert len(skipped) == EXPECTED_SKIPPED, f"README blocks skipped: {skipped}"
    for block_id, reason in skipped:  # each skip says why and which test covers what the block shows
        assert reason.startswith("needs ") and "tests/test_" in reason, (block_id, reason)
    assert not [b.id for b in BLOCKS if b.skip is not None and b.lang not in RUN], "skip markers on blocks never run"


def test_every_check_matches_one_block():
    for marker in CHECKS:
        hits = [b.id for b in TO_RUN if b.skip is None and marker in b.code]
        assert len(hits) == 1, f"CHECKS key {marker!r} is in README blocks {hits}: exactly one expected"


@pytest.mark.parametrize("block", [b for b in TO_RUN if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block, target, tmp_path):
    compile(block.code, f"README.md:{block.line}", "exec")  # skipped blocks must still be valid Python
    if block.skip is not None:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    code = block.code.replace(README_ADDRESS, target)
    code += "".join(check for marker, check in CHECKS.items() if marker in block.code)
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ADVANTAGE_SERVICE_TARGET": target, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, f"README.md:{block.line} exited {proc.returncode}:\n{code}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("block", [b for b in TO_RUN if b.lang == "js"], ids=lambda b: b.id)
def test_js_block_runs(block, target, request):
    if block.skip is not None:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    if NODE is None:
        pytest.skip("node is not installed")
    request.getfixturevalue("node_modules")
    code = block.code.replace(README_ADDRESS, target)
    env = {k: v for k, v in os.environ.items() if k != "TOKEN"}  # the block sends $TOKEN when it is set
    proc = subprocess.run([NODE, "-"], input=code, cwd=EXAMPLE, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"README.md:{block.line} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "step-42" in proc.stdout and "shape: [ 4, 3 ]" in proc.stdout, proc.stdout


def test_the_extraction_sees_skips_and_unclosed_fences():
    text = "x\n<!-- readme-test: skip (needs y; tests/test_z.py) -->\n```python\nimport a\n```\n\n```js\nf()\n```\n"
    assert readme_blocks(text) == [Block("python", 3, "import a\n", "needs y; tests/test_z.py"),
                                   Block("js", 7, "f()\n", None)]
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks("```python\nimport a\n")
    with pytest.raises(ValueError, match="just before a fence"):
        readme_blocks("<!-- readme-test: skip (needs y) -->\n\n```python\nimport a\n```\n")
