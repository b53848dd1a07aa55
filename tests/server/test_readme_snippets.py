"""The README's client snippets (curl, openai, anthropic), run as a user would paste them, against
`ds4 serve` (the random demo pair's artifact here, on a free port instead of 8000): each exits 0
and answers in the shape its API has."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serving import ServerProcess

pytestmark = pytest.mark.compile
README = Path(__file__).resolve().parents[2] / "README.md"


def snippets() -> dict[str, str]:
    """name -> code of each fenced block marked `<!-- snippet: name -->` in the README."""
    found = re.findall(r"<!-- snippet: (\w+) -->\n```\w*\n(.*?)```", README.read_text(), re.S)
    return dict(found)


@pytest.fixture(scope="module")
def server(demo_pair):
    s = ServerProcess("-m", demo_pair[2])
    yield s
    s.stop()


def _run(kind: str, code: str, server) -> str:
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    cmd = ["bash", "-c", code] if kind == "curl" else [sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (kind, r.stderr[-2000:])
    return r.stdout


def test_the_readme_has_the_three_snippets():
    assert set(snippets()) == {"curl", "openai", "anthropic"}


def test_curl_snippet(server):
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    out = json.loads(_run("curl", snippets()["curl"], server))
    assert out["object"] == "chat.completion" and isinstance(out["choices"][0]["message"]["content"], str)
    assert out["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_client_snippets(server, kind):
    out = _run(kind, snippets()[kind], server)
    assert out.endswith("\n")   # printed the answer's text (the random model's, possibly empty)
