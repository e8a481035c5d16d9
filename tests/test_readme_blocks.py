"""Every ```python and ```js code block of README.md and of docs/*.md runs as written against a live server
(issue #21 item 7; issue #29 moved most of the README's reference, and its blocks, to docs/).

Extraction: a block opens with a fence at the start of a line, three backticks and a language tag, and ends at
the next bare fence. ``python`` and ``js`` blocks are run; ``bash`` (commands that install packages, start servers,
build images or talk to Kubernetes), ``go`` and ``cpp`` (tests/test_examples_go_cpp.py builds and runs those: they
are the files under examples/) and untagged blocks (the layout listing) are not, and any other tag fails
:func:`test_block_inventory`, so a block tagged ``py`` or ``javascript`` cannot slip through unrun. A python/js
block that cannot run here is marked on the line just before its fence with
``<!-- readme-test: skip (why; which test covers it) -->``: it is reported as a skipped test with that reason, its
python still has to compile, and the blocks are counted per page (run and skipped: :data:`EXPECTED`), so deleting
a block, adding one, moving one to another page, adding a page or breaking the extraction fails
:func:`test_block_inventory`.

Two bash blocks are checked without running them. ``docs/ray.md``'s ``advantage-ray`` block: it starts its own
cluster on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, ``ray start --head --block`` in the background)
before ``advantage-ray up`` and ends by killing that head alone, and each ``advantage-ray`` line's flags are
accepted by ``advantage-ray``'s and ``advantage-server``'s parsers. It is not run here because Ray's start costs
10-60 s of a 2-core CI run;
tests/test_ray.py runs ``up``/``status``/``down`` (the command line too) on a real local cluster. It was run as
written by hand on 2026-12-06 (node ``127.0.0.1``, no socket of Ray's or the replica's off loopback) and on 2026-12-03: ``ray start --head``, two CPU replicas ``ALIVE`` and
``SERVING``, ``down`` stopped both, 37 s in all. ``docs/docker.md``'s TLS ``docker run``: its flags are those of
the Dockerfile's ``CMD`` for that image (``--metrics-host 0.0.0.0`` included: flags after the image name replace
the whole ``CMD``) plus TLS and token flags, all accepted by ``advantage-server``'s parser.

Running: each block in a fresh interpreter (``sys.executable``, cwd a temporary directory), so a block that lacks
an import or uses a name it never defines fails. The pages' server address ``localhost:50051`` (the quick
start's ``advantage-server --port 50051``) is rewritten to the session server's ephemeral address in the test's
copy only, and ``$ADVANTAGE_SERVICE_TARGET`` is set to it for the verl drop-in block, whose one-argument
``get_adv_estimator_fn`` reads it (verl and nemo_rl are not installed: the drop-ins must not need them). A few
lines of assertions (:data:`CHECKS`, keyed by a line of the block) are appended to some blocks to check what they
compute. The JavaScript block runs under ``node`` (CommonJS, from stdin with cwd ``examples/node``: what a script
saved beside ``advantage.js`` sees, as docs/other-languages.md says), skipped only where node is missing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from test_deploy_node import EXAMPLE, NODE, node_modules  # noqa: F401 - the fixture: npm ci where it is missing

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_ADDRESS = "localhost:50051"

RUN = ("python", "js")
NOT_RUN = ("bash", "go", "cpp", "")
#: Per page (path from the repository root): how many python and js blocks run, and how many are skipped.
#: Change these with the pages; every page of docs/ must be listed, with {} when it has no such block.
EXPECTED = {
    "README.md": {"python": 1},
    "docs/demos.md": {},
    "docs/development.md": {},
    "docs/docker.md": {},
    "docs/errors.md": {},
    "docs/estimators.md": {},
    "docs/frameworks.md": {"python": 3, "skipped": 2},
    "docs/kubernetes.md": {"skipped": 1},
    "docs/observability.md": {"python": 1},
    "docs/other-languages.md": {"js": 1},
    "docs/python-client.md": {"python": 3},
    "docs/ray.md": {"skipped": 1},
    "docs/references.md": {"python": 1},
    "docs/server-flags.md": {},
    "docs/tls.md": {"skipped": 1},
    "docs/transports.md": {},
}


def pages() -> list[pathlib.Path]:
    """README.md and every markdown page of docs/ (not deeper: docs/ holds pages and their pictures only)."""
    return [README, *sorted(DOCS.glob("*.md"))]


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
    line: int          # the opening fence's line number in its page (1-based)
    code: str
    skip: str | None   # the reason of a readme-test: skip marker just before the fence
    page: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.page}:{self.lang}-L{self.line}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` (the page ``page``), in order. Raises ``ValueError`` for an unclosed fence or
    a skip marker that is not on the line just before a fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        marker = SKIP.match(lines[i])
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            raise ValueError(f"{page}:{i + 1}: a readme-test: skip marker must be the line just before a fence")
        if not opened:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the ``` fence opened here is never closed")
        before = SKIP.match(lines[i - 1]) if i else None
        blocks.append(Block(opened.group(1), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                            before.group(1) if before else None, page))
        i = end + 1
    return blocks


BLOCKS = [b for p in pages() for b in readme_blocks(p.read_text(), str(p.relative_to(ROOT)))]
TO_RUN = [b for b in BLOCKS if b.lang in RUN]


def test_block_inventory():
    langs = {b.lang for b in BLOCKS}
    assert langs <= set(RUN + NOT_RUN), f"blocks tagged {sorted(langs - set(RUN + NOT_RUN))}: " \
        f"tag them python or js (run here) or one of {NOT_RUN} (not run), or teach this test the tag"
    listed = sorted(str(p.relative_to(ROOT)) for p in pages())
    assert listed == sorted(EXPECTED), f"pages {listed}, EXPECTED lists {sorted(EXPECTED)}: update EXPECTED"
    got = {}
    for page in EXPECTED:
        counts = {lang: sum(1 for b in TO_RUN if b.page == page and b.lang == lang and b.skip is None) for lang in RUN}
        counts["skipped"] = sum(1 for b in TO_RUN if b.page == page and b.skip is not None)
        got[page] = {k: v for k, v in counts.items() if v}
    assert got == EXPECTED, f"blocks per page: {got}, expected {EXPECTED} (update EXPECTED with the pages)"
    skipped = [(b.id, b.skip) for b in TO_RUN if b.skip is not None]
    for block_id, reason in skipped:  # each skip says why and which test covers what the block shows
        assert reason.startswith("needs ") and "tests/test_" in reason, (block_id, reason)
    assert not [b.id for b in BLOCKS if b.skip is not None and b.lang not in RUN], "skip markers on blocks never run"


def test_every_check_matches_one_block():
    for marker in CHECKS:
        hits = [b.id for b in TO_RUN if b.skip is None and marker in b.code]
        assert len(hits) == 1, f"CHECKS key {marker!r} is in blocks {hits}: exactly one expected"


@pytest.mark.parametrize("block", [b for b in TO_RUN if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block, target, tmp_path):
    compile(block.code, f"{block.page}:{block.line}", "exec")  # skipped blocks must still be valid Python
    if block.skip is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.skip}")
    code = block.code.replace(README_ADDRESS, target)
    code += "".join(check for marker, check in CHECKS.items() if marker in block.code)
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ADVANTAGE_SERVICE_TARGET": target, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, \
        f"{block.page}:{block.line} exited {proc.returncode}:\n{code}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("block", [b for b in TO_RUN if b.lang == "js"], ids=lambda b: b.id)
def test_js_block_runs(block, target, request):
    if block.skip is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.skip}")
    if NODE is None:
        pytest.skip("node is not installed")
    request.getfixturevalue("node_modules")
    code = block.code.replace(README_ADDRESS, target)
    env = {k: v for k, v in os.environ.items() if k != "TOKEN"}  # the block sends $TOKEN when it is set
    proc = subprocess.run([NODE, "-"], input=code, cwd=EXAMPLE, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{block.page}:{block.line} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "step-42" in proc.stdout and "shape: [ 4, 3 ]" in proc.stdout, proc.stdout


def test_the_extraction_sees_skips_and_unclosed_fences():
    text = "x\n<!-- readme-test: skip (needs y; tests/test_z.py) -->\n```python\nimport a\n```\n\n```js\nf()\n```\n"
    assert readme_blocks(text) == [Block("python", 3, "import a\n", "needs y; tests/test_z.py"),
                                   Block("js", 7, "f()\n", None)]
    assert readme_blocks(text, "docs/x.md")[1] == Block("js", 7, "f()\n", None, "docs/x.md")
    with pytest.raises(ValueError, match="^docs/x.md:1: .*never closed"):
        readme_blocks("```python\nimport a\n", "docs/x.md")
    with pytest.raises(ValueError, match="just before a fence"):
        readme_blocks("<!-- readme-test: skip (needs y) -->\n\n```python\nimport a\n```\n")


# ------------------------------------------------------------------------------------------ bash blocks, not run
def command_lines(code: str) -> list[list[str]]:
    """A bash block's commands, continuation lines joined, each split as the shell would (comments dropped)."""
    return [shlex.split(line, comments=True) for line in code.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def bash_block(page: str, holding: str) -> list[list[str]]:
    hits = [b for b in BLOCKS if b.page == page and b.lang == "bash" and holding in b.code]
    assert len(hits) == 1, f"{page}: {len(hits)} bash blocks hold {holding!r}, one expected"
    return command_lines(hits[0].code)


def test_ray_block_starts_its_cluster_and_its_flags_parse():
    """docs/ray.md's advantage-ray block runs as written on one machine: ``ray start --head`` before ``up``,
    ``ray stop`` last, CPU replicas (no GPU asked for), and flags both parsers accept (see the module docstring
    for why it is not run here)."""
    from advantage_server.ray_deploy import build_parser, server_args

    commands = bash_block("docs/ray.md", "ray start --head")
    names = [" ".join(c[:2]) for c in commands]
    assert names == ["pip install", "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0", "ray start", "until ray",
                     "advantage-ray up", "advantage-ray status", "advantage-ray down", "kill $RAY_HEAD"], names
    # a one-machine cluster on loopback (issue #37 item 1), in the foreground so that `kill` stops this head only
    start = commands[2]
    assert start[:4] == ["ray", "start", "--head", "--block"] and "--node-ip-address=127.0.0.1" in start, start
    assert start[-2:] == ["&", "RAY_HEAD=$!"], start
    assert "--address=127.0.0.1:6379" in commands[3] and "--port=6379" in start, (start, commands[3])
    assert "ray stop" not in " ".join(" ".join(c) for c in commands)
    for command in commands[4:7]:
        args, rest = build_parser().parse_known_args(command[1:])
        if args.command == "up":
            parsed = server_args(rest)
            assert args.num_gpus == 0 and parsed.device == "cpu", command  # runs where there is no GPU
            assert parsed.host == "127.0.0.1", command  # the replicas on loopback too
        else:
            assert not rest, command
        assert args.namespace == "advantage", command
    # the GPU variant below it parses too
    for command in bash_block("docs/ray.md", "--num-gpus 1"):
        args, rest = build_parser().parse_known_args(command[1:])
        assert args.command == "up" and args.num_gpus == 1 and server_args(rest).auth_token_file, command


def dockerfile_cmd(target: str) -> list[str]:
    """The exec-form ``CMD`` of the Dockerfile's stage ``target``."""
    text = (ROOT / "Dockerfile").read_text()
    stage = re.search(rf"^FROM \S+ AS {target}\s*$(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    assert stage, f"Dockerfile: no stage {target}"
    cmd = re.findall(r"^CMD (\[.*\])\s*$", stage.group(1), re.M)
    assert len(cmd) == 1, f"Dockerfile stage {target}: {len(cmd)} exec-form CMD lines"
    return json.loads(cmd[0])


def test_docker_tls_example_keeps_the_image_flags():
    """docs/docker.md's TLS ``docker run``: flags after the image name replace the whole ``CMD``, so the example
    repeats every flag of the image's ``CMD`` with its value (``--metrics-host 0.0.0.0`` was missing, leaving the
    metrics unreachable from outside), adds the TLS and token flags, and says how uid 10001 reads the key."""
    from advantage_server.cli import build_parser

    runs = [c for c in bash_block("docs/docker.md", "--tls-key") if c[:2] == ["docker", "run"]]
    assert len(runs) == 1, runs
    run = runs[0]
    image = next(a for a in run if a.startswith("advantage-service:"))
    flags = run[run.index(image) + 1:]
    cmd = dockerfile_cmd(image.split(":")[1])
    pairs = dict(zip(cmd[::2], cmd[1::2]))
    given = dict(zip(flags[::2], flags[1::2]))
    assert {k: given.get(k) for k in pairs} == pairs, f"the example drops or changes CMD flags: {pairs} vs {given}"
    parsed = build_parser().parse_args(flags)
    assert parsed.tls_cert and parsed.tls_key and parsed.auth_token_file and parsed.metrics_host == "0.0.0.0"
    assert f"{pairs['--metrics-port']}:{pairs['--metrics-port']}" in run, "the metrics port is not published"
    text = (DOCS / "docker.md").read_text()
    assert "10001" in text and "--group-add" in text and "Permission denied" in text
