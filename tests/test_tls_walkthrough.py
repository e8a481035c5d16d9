"""docs/tls.md runs as written (issue #37 item 5): its first bash block (openssl makes a self-signed certificate for
``localhost``, python3 a token) in a fresh directory, its ``advantage-server`` line as the server (``--port 50051``
moved to a free port, the installed entry point run as ``python -m advantage_server.cli``), and its python block in
a fresh interpreter in that directory (``localhost:50051`` moved likewise), whose printed advantages must be the
ones the page shows. Then the page's failure list, each as a user would meet it: no ``tls_ca`` (the handshake
fails: UNAVAILABLE), no token (UNAUTHENTICATED naming ``token_file=``), the token's file given as ``token=``, a key
given as ``tls_ca``. Skipped where ``openssl`` is missing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from test_readme_blocks import BLOCKS, README_ADDRESS, bash_block
from test_server_cli import free_port

PAGE = "docs/tls.md"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl (Debian: openssl)")


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """The page's bash blocks run in a fresh directory: (directory, address of the TLS server they started)."""
    from advantage_client import AdvantageClient

    work = tmp_path_factory.mktemp("tls")
    setup = [b for b in BLOCKS if b.page == PAGE and b.lang == "bash" and "openssl" in b.code]
    assert len(setup) == 1
    subprocess.run(["bash", "-euo", "pipefail", "-c", setup[0].code], cwd=work, check=True, capture_output=True,
                   timeout=120)
    assert oct((work / "server.key").stat().st_mode & 0o777) == "0o600" and (work / "token").read_text().strip()
    [server] = bash_block(PAGE, "advantage-server")
    assert server[0] == "advantage-server" and server[1:3] == ["--port", "50051"], server
    port = free_port()
    argv = [sys.executable, "-m", "advantage_server.cli", "--port", str(port), *server[3:], "--device", "cpu"]
    proc = subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ADVANTAGE_WARMUP": "0"})
    address = f"localhost:{port}"
    try:
        deadline = time.monotonic() + 120
        with AdvantageClient(address, tls_ca=str(work / "server.crt"), token_file=str(work / "token"),
                             timeout=5.0) as client:
            while True:
                try:
                    client.list_estimators()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"the page's server did not serve: {proc.stdout.read()}")
                    time.sleep(0.2)
        yield work, address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_pages_python_block_runs_as_written(walkthrough):
    work, address = walkthrough
    [block] = [b for b in BLOCKS if b.page == PAGE and b.lang == "python"]
    code = block.code.replace(README_ADDRESS, address)
    out = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shown = re.search(r"# (tensor\(.*\))", block.code).group(1)  # the output the page shows
    assert out.stdout.strip() == shown, (out.stdout, shown)


def test_the_pages_failures_are_what_it_says(walkthrough):
    from advantage_client import AdvantageClient, AdvantageServiceError

    work, address = walkthrough
    kw = dict(prompt_ids=[0, 0], rewards=[1.0, 0.0], mask=[[1.0], [1.0]])
    with AdvantageClient(address, token_file=str(work / "token"), timeout=5.0, retry=False) as client:
        with pytest.raises(AdvantageServiceError) as err:  # plaintext to a TLS server: the handshake fails
            client.compute("grpo", None, **kw)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
    with AdvantageClient(address, tls_ca=str(work / "server.crt"), timeout=10.0) as client:
        with pytest.raises(AdvantageServiceError) as err:
            client.compute("grpo", None, **kw)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "token_file=" in str(err.value), err.value
    with pytest.raises(ValueError, match="token_file="):
        AdvantageClient(address, tls_ca=str(work / "server.crt"), token=str(work / "token"))
    here = os.getcwd()
    os.chdir(work)
    try:  # the page's own setup: the file is "token" in the current directory
        with pytest.raises(ValueError, match="token_file='token'"):
            AdvantageClient(address, tls_ca="server.crt", token="token")
    finally:
        os.chdir(here)
    with pytest.raises(ValueError, match="tls_ca"):
        AdvantageClient(address, tls_ca=str(work / "server.key"), token_file=str(work / "token"))
