"""The partition page in headless Chromium: the must-save node is drawn as saved, a screenshot renders, and a
source line carrying ``</script><script>...`` shows as text without running.

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped without /usr/bin/chromium.
"""
import os
import re
import signal
import subprocess
from html.parser import HTMLParser

import pytest

from tests.support.xss_layer import PAYLOAD

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is missing; install it with `apt-get install -y chromium`")


def chromium(page, tmp_path, *extra):
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,1000", *extra, page.resolve().as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # chromium's own helper processes too
        proc.communicate()
        pytest.fail(f"chromium did not finish loading {page.name} in 60 s: an alert() from injected script "
                    f"blocks a headless page")
    assert proc.returncode == 0, err[-2000:]
    return out


class Nodes(HTMLParser):
    """Collects the attributes of every drawn node (elements with data-side) and the <html>/<body> tags."""

    def __init__(self):
        super().__init__()
        self.nodes, self.root = [], {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("html", "body"):
            self.root[tag] = attrs
        if "data-side" in attrs:
            self.nodes.append(attrs)


def parse(dom):
    p = Nodes()
    p.feed(dom)
    return p


@pytest.fixture
def pages(kept_dump, xss_dump):
    return kept_dump[0] / "index.html", xss_dump[0] / "index.html"


def test_must_save_node_drawn_as_saved(pages, tmp_path):
    dom = parse(chromium(pages[0], tmp_path, "--dump-dom"))
    assert dom.root["body"].get("data-rendered") == "1"  # the page's script ran
    (topk,) = [n for n in dom.nodes if n["data-name"] == "topk_ids" and n["data-side"] == "forward"]
    assert topk["data-must-save"] == "1" and topk["data-saved"] == "384"
    assert "saved" in topk["class"].split() and "must-save" in topk["class"].split()
    assert any(n["data-recomputed"] == "1" for n in dom.nodes if n["data-side"] == "backward")


def test_screenshot(pages, tmp_path):
    shot = tmp_path / "partition.png"
    chromium(pages[0], tmp_path, f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def _assert_inert(dom_text):
    dom = parse(dom_text)
    assert "data-pwned" not in dom.root["html"], "injected script ran"
    assert dom.root["body"].get("data-rendered") == "1"
    escaped = PAYLOAD.replace("<", "&lt;").replace(">", "&gt;")
    assert escaped in dom_text  # shown, as text
    (evil,) = [n for n in dom.nodes if n["data-name"] == "topk_ids" and n["data-side"] == "forward"]
    assert evil["data-must-save"] == "1"


def test_injected_source_line_renders_as_text(pages, tmp_path):
    _assert_inert(chromium(pages[1], tmp_path, "--dump-dom"))


def test_escaping_alone_stops_the_injection(pages, tmp_path):
    """Without the Content-Security-Policy the page's escaping must still keep the payload inert; a page that
    pastes the payload raw does run it (so this test can see an injection)."""
    html = pages[1].read_text()
    no_csp = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    assert no_csp != html
    page = tmp_path / "no_csp.html"
    page.write_text(no_csp)
    _assert_inert(chromium(page, tmp_path, "--dump-dom"))

    unsafe = tmp_path / "unsafe.html"
    marker_only = PAYLOAD.replace("alert(1);", "")  # an alert would block the headless page
    unsafe.write_text(no_csp.replace("</main>", f"</main><script>{marker_only}", 1))
    dom = parse(chromium(unsafe, tmp_path, "--dump-dom"))
    assert dom.root["html"].get("data-pwned") == "1"
