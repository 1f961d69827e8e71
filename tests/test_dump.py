"""Graph dumps: layout, normalised graphs, and the self-contained partition page (escaping included)."""
import json
import re

import pytest
import torch

import sacpass
from sacpass.dump import read_index, read_view, render_dump
from sacpass.errors import DumpError
from sacpass.testing import golden_text
from tests.support.toy import compile_toy
from tests.support.xss_layer import PAYLOAD


def _page_data(html: str) -> dict:
    m = re.search(r'<script id="sacpass-data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_dump_layout(kept_dump):
    d, be = kept_dump
    assert read_index(d) == ["g0"]
    names = {p.name for p in (d / "g0").iterdir()}
    assert names == {"joint.txt", "forward.txt", "backward.txt", "forward.normalized.txt",
                     "backward.normalized.txt", "report.json", "graph.json"}
    # the normalised forward is exactly the golden text's forward section
    golden = golden_text(be)
    forward = golden.split("# forward\n", 1)[1].split("# backward\n", 1)[0]
    assert (d / "g0" / "forward.normalized.txt").read_text() == forward
    assert "/work/" not in (d / "g0" / "backward.normalized.txt").read_text()


def test_page_is_self_contained(kept_dump):
    d, _ = kept_dump
    html = (d / "index.html").read_text()
    assert not re.search(r"(src|href)\s*=", html, re.I)  # no external scripts, styles, images or links
    assert "http://" not in html and "https://" not in html and "<link" not in html
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert "innerHTML" not in html and "outerHTML" not in html and "insertAdjacentHTML" not in html
    data = _page_data(html)
    (g,) = data["graphs"]
    must = [n for n in g["forward"] if n["must_save"]]
    assert [(n["name"], n["op"], n["module"], n["saved_bytes"]) for n in must] == [
        ("topk_ids", "sacpass_toy::topk_ids.default", "indexer", 384)]
    assert any(n["recomputed"] for n in g["backward"])
    assert g["total_bytes"] == sum(s["bytes"] for s in g["saved"])


def test_injected_source_line_is_escaped(xss_dump):
    d, _ = xss_dump
    html = (d / "index.html").read_text()
    assert PAYLOAD not in html and "<script>alert" not in html
    assert html.count("<script") == 2  # the data block and the page's own script
    assert "\\u003c/script\\u003e\\u003cscript\\u003ealert(1)" in html
    codes = [n["code"] for n in _page_data(html)["graphs"][0]["forward"] if n["must_save"]]
    assert codes and PAYLOAD in codes[0]  # the text itself survives, as data


def test_show_rebuilds_the_page_from_json(kept_dump, tmp_path):
    d, _ = kept_dump
    before = (d / "index.html").read_text()
    assert render_dump(d) == str(d / "index.html")
    assert (d / "index.html").read_text() == before


def test_corrupted_graph_json_is_a_dump_error(kept_dump, tmp_path):
    import shutil
    d, _ = kept_dump
    copy = tmp_path / "dump"
    shutil.copytree(d, copy)
    view = json.loads((copy / "g0" / "graph.json").read_text())
    view["forward"][0]["name"] = ["not", "a", "string"]
    (copy / "g0" / "graph.json").write_text(json.dumps(view))
    with pytest.raises(DumpError, match="node field 'name'"):
        read_view(copy, "g0")
    (copy / "index.json").write_text(json.dumps({"kind": "sacpass.dump", "version": 1, "graphs": ["../../etc"]}))
    with pytest.raises(DumpError, match="graph ids"):
        read_index(copy)


def test_trace_report_emits_a_structured_artifact(kept_dump):
    import logging

    from torch._logging._internal import trace_log

    from sacpass.dump import trace_report

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, level = Keep(), trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        trace_report(kept_dump[1].reports[0])
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)
    ours = [r for r in records if getattr(r, "metadata", {}).get("artifact", {}).get("name") == "sacpass_report_g0"]
    assert len(ours) == 1 and '"kind": "sacpass.report"' in ours[0].payload, [r.metadata for r in records]


def test_dump_written(tmp_path):
    be, model = compile_toy(save=["sacpass_toy::topk_ids"], dump_dir=tmp_path / "dump")
    model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    folder = tmp_path / "dump" / "g0"
    assert {p.name for p in folder.iterdir()} >= {"joint.txt", "forward.txt", "backward.txt", "report.json"}
    assert "MUST_SAVE" in (folder / "joint.txt").read_text()
    back = sacpass.Report.from_json((folder / "report.json").read_text())
    assert back.to_json() == be.reports[0].to_json()
