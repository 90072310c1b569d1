"""bench/results/*.md are rendered from the JSON beside them and cannot drift; README.md stays short."""
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _renderer(name: str = "render_results"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _copy(tmp_path):
    dst = tmp_path / "results"
    dst.mkdir()
    for f in RESULTS.glob("*.json"):
        shutil.copy(f, dst / f.name)
    return dst


def _pages(results: Path = RESULTS) -> dict[str, str]:
    return _renderer().render_pages(results)


def test_committed_pages_equal_a_fresh_render():
    pages = _pages()
    assert set(pages) == {"README.md", *(p.file for p in _renderer().PAGES)}
    assert sorted(f.name for f in RESULTS.glob("*.md")) == sorted(pages), "a page no renderer writes is left over"
    for name, text in pages.items():
        assert (RESULTS / name).read_text() == text, f"bench/results/{name} is stale: run `make results`"


def test_pages_stay_small_and_each_section_sits_on_its_own_page():
    """The split keeps every page readable on GitHub; each record's section is on the page its bench names."""
    mod, pages = _renderer(), _pages()
    assert all(len(text) < 200_000 for text in pages.values()), {k: len(v) for k, v in pages.items()}
    for f in RESULTS.glob("*.json"):
        page = mod.RENDERERS[mod.claim(f.name)].page.file
        assert [n for n, text in pages.items() if f'<a id="{mod.anchor(f.name)}">' in text] == [page], f.name


def test_every_result_json_is_claimed_by_a_renderer():
    mod = _renderer()
    assert [f.name for f in RESULTS.glob("*.json") if mod.claim(f.name) is None] == []


def test_changed_number_changes_the_page_at_that_number(tmp_path):
    """Negative control: one edited JSON field must show up on the rendered page (through the CLI options)."""
    mod = _renderer()
    src = _copy(tmp_path)
    name = "quant_decode.amd-epyc-avx512.json"
    d = json.loads((src / name).read_text())
    before_bw = d["results"]["bandwidth_gb_s"]
    before_row = d["results"]["rows"][3]["decode_tok_s"]
    d["results"]["bandwidth_gb_s"] = 12.3456
    d["results"]["rows"][3]["decode_tok_s"] = 98.765
    (src / name).write_text(json.dumps(d))
    out = tmp_path / "pages"
    assert mod.main(["--results", str(src), "--out-dir", str(out)]) == 0
    new, old = (out / "speed.md").read_text(), (RESULTS / "speed.md").read_text()
    assert new != old
    assert "Read bandwidth 12.35 GB/s" in new and f"Read bandwidth {before_bw:.2f} GB/s" in old
    assert "| 98.8 |" in new and f"| {before_row:.1f} |" in old
    # only the edited section changed
    diff = [(a, b) for a, b in zip(old.splitlines(), new.splitlines()) if a != b]
    assert len(diff) == 2, diff
    assert [p.name for p in out.glob("*.md") if p.read_text() != (RESULTS / p.name).read_text()] == ["speed.md"]
    assert mod.main(["--results", str(src), "--out-dir", str(out), "--check"]) == 0
    assert mod.main(["--results", str(RESULTS), "--out-dir", str(out), "--check"]) == 1


def test_unknown_json_is_listed_as_not_rendered(tmp_path):
    mod = _renderer()
    src = _copy(tmp_path)
    (src / "mystery_bench.json").write_text(json.dumps({"name": "mystery", "results": {"x": 1}}))
    page = mod.render_pages(src)["README.md"]
    tail = page.split("## Not rendered", 1)[1]
    assert "`mystery_bench.json`" in tail
    assert "`mystery_bench.json`" not in page.split("## Not rendered", 1)[0]
    assert "- none" not in tail


def test_four_bit_sections_carry_the_q4_1_caveat():
    page = "\n".join(_pages().values())
    for name in ("quant_quality.json", "eval_schemes.json", "demo-pareto.json", "specdec.json"):
        section = page.split(f"### [`{name}`]", 1)[1].split("\n### ", 1)[0]
        assert "4-bit caveat" in section and "not** near-lossless" in section, name


def test_readme_is_at_most_10_kib():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 10240, f"README.md is {size} bytes; move detail to docs/ or bench/results/README.md"


def test_every_number_on_the_pages_traces_to_a_json_record(capsys):
    assert _renderer("trace_numbers").main(["--quiet"]) == 0, capsys.readouterr().out


def test_negative_control_a_typed_number_is_reported_missing(tmp_path, capsys):
    """A figure typed into a section that names its record, but held by no field of it, is caught."""
    page = tmp_path / "page.md"
    page.write_text((RESULTS / "quality.md").read_text().replace("| fp32 (dense cache) | ", "| fp32 (dense cache) | 46.5 ", 1))
    assert _renderer("trace_numbers").main([str(page), "--quiet"]) == 1
    assert "46.5\t<- MISSING" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ summary

SUMMARY_MAX_LINES = 25
LINK = re.compile(r"\]\(([\w-]+\.md)#([^)]+)\)")  # (page, anchor)


def _write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def _summary(page: str) -> str:
    return "## Summary" + page.split("## Summary", 1)[1].split("\n## ", 1)[0].rstrip()


def _summary_rows(page: str) -> dict[str, list[str]]:
    """CPU kind -> the summary table's cells (one per ``SUMMARY`` column)."""
    lines = [ln for ln in _summary(page).splitlines() if ln.startswith("| ")][1:]  # skip the header row
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines]
    return {r[0]: r[1:] for r in rows}


def _github_ids(page: str) -> set[str]:
    """Explicit ``<a id>`` anchors plus the ids GitHub gives headings (lower case, punctuation but - and _ dropped,
    spaces to -, repeats numbered)."""
    ids = set(re.findall(r'<a id="([^"]+)"', page))
    seen: dict[str, int] = {}
    for line in page.splitlines():
        if line.startswith("#"):
            text = re.sub(r"<[^>]+>", "", line.lstrip("#")).replace("`", "")
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def _dead_links(pages: dict[str, str]) -> list[str]:
    """Summary links whose page is missing or holds no such anchor."""
    return [f"{f}#{a}" for f, a in LINK.findall(_summary(pages["README.md"]))
            if f not in pages or a not in _github_ids(pages[f])]


def _untraced(page: str, results: Path) -> list[str]:
    """Strict trace of the summary: every number of a figure (the part of a cell between ` · `) must print a leaf
    of the one record that figure links to (trace_numbers itself accepts any record the section heading names)."""
    tn, mod = _renderer("trace_numbers"), _renderer()
    idx = tn.index(results)
    by_anchor = {mod.anchor(n): n for n in idx}
    bad = []
    for kind, cells in _summary_rows(page).items():
        for fig in (f for c in cells for f in c.split(" · ")):
            targets = {by_anchor.get(a) for _, a in LINK.findall(fig)}
            numbers = [m.group(0) for m in tn.NUMBER.finditer(tn.CODE.sub(" ", fig))]
            if numbers and (len(targets) != 1 or None in targets):
                bad.append(f"{kind}: {fig!r} links to {targets}")
                continue
            bad += [f"{kind}: {n} in {fig!r} not in {next(iter(targets))}" for n in numbers
                    if n not in idx[next(iter(targets))]]
    return bad


def test_summary_opens_the_page_and_fits_one_screen():
    mod, page = _renderer(), (RESULTS / "README.md").read_text()
    lines = page.splitlines()
    assert lines[0] == "# Measured results"
    first_section = next(i for i, ln in enumerate(lines) if ln.startswith("## "))
    assert lines[first_section] == "## Summary" and first_section <= 3
    summary = _summary(page)
    assert len(summary.splitlines()) <= SUMMARY_MAX_LINES, summary
    assert page.index("## Summary") < page.index("## About these pages") < page.index("## Contents")
    header = next(ln for ln in summary.splitlines() if ln.startswith("| CPU kind"))
    assert [c.strip() for c in header.split("|")[1:-1]] == ["CPU kind", *(c[0] for c in mod.SUMMARY)]
    rows = _summary_rows(page)
    assert {"AMD EPYC (AVX2)", "AMD EPYC (AVX512)", "Intel Xeon (AVX512, AMX)", "Intel Xeon (AVX2 forced)"} <= set(rows)
    assert all(len(cells) == len(mod.SUMMARY) and all(cells) for cells in rows.values())
    # every column holds a figure for some CPU kind, and the quantized ratio names its baseline
    assert all(any(re.search(r"×\]\([\w-]+\.md#", cells[i]) for cells in rows.values()) for i in range(len(mod.SUMMARY)))
    assert "vs fp32" in header and "**fp32**" in summary


def test_summary_links_resolve_to_the_sections_of_their_records():
    pages = {p.name: p.read_text() for p in RESULTS.glob("*.md")}
    targets = LINK.findall(_summary(pages["README.md"]))
    assert len(targets) >= 10 and _dead_links(pages) == []
    ids = re.findall(r'<a id="([^"]+)"', "\n".join(pages.values()))
    assert len(ids) == len(set(ids))
    mod = _renderer()
    for name in (f.name for f in RESULTS.glob("*.json")):  # the anchor sits in the heading of its record's section
        assert f'### [`{name}`]({name}) <a id="{mod.anchor(name)}"></a>' in pages[mod.link(name).split("#")[0]], name
    # negative control: drop one cited record's anchor and its link is reported dead
    page, gone = targets[0]
    broken = {**pages, page: pages[page].replace(f'<a id="{gone}"></a>', "")}
    assert _dead_links(broken) == [f"{f}#{a}" for f, a in targets if a == gone]


def test_summary_figures_trace_to_the_record_they_link(tmp_path):
    page = (RESULTS / "README.md").read_text()
    assert _untraced(page, RESULTS) == []
    # negative control: a figure no longer printed by its own record (but by another one cited) is caught
    rows = _summary_rows(page)
    fig = rows["AMD EPYC (AVX512)"][1].split(" · ")[1]  # the int4 ratio of quant_decode.amd-epyc-avx512.json
    idx = _renderer("trace_numbers").index(RESULTS)
    # a ratio another cited record prints (so trace_numbers, which accepts any record the heading names, passes it)
    # that this record prints nowhere
    other = next(v for v in idx["quant_decode.intel-xeon-avx512-amx.json"]
                 if re.fullmatch(r"\d\.\d\d", v) and v not in idx["quant_decode.amd-epyc-avx512.json"])
    wrong = re.sub(r"\[\d+\.\d+×\]", f"[{other}×]", fig)
    assert wrong != fig
    assert _renderer("trace_numbers").main([str(_write(tmp_path, page.replace(fig, wrong))), "--quiet"]) == 0
    assert any(f" {other} in " in b for b in _untraced(page.replace(fig, wrong), RESULTS))


def test_summary_says_not_measured_where_a_record_is_missing(tmp_path):
    """Negative control: with one CPU kind's quantized-decode record gone, that cell says so, the rest stay."""
    mod = _renderer()
    before = _summary_rows(mod.render_pages(RESULTS)["README.md"])
    src = _copy(tmp_path)
    (src / "quant_decode.amd-epyc-avx512.json").unlink()
    after = _summary_rows(mod.render_pages(src)["README.md"])
    assert "quant_decode-amd-epyc-avx512-json" in before["AMD EPYC (AVX512)"][1]
    assert after["AMD EPYC (AVX512)"][1] == mod.NOT_MEASURED
    assert [c for i, c in enumerate(after["AMD EPYC (AVX512)"]) if i != 1] == \
        [c for i, c in enumerate(before["AMD EPYC (AVX512)"]) if i != 1]
    assert {k: v for k, v in after.items() if k != "AMD EPYC (AVX512)"} == \
        {k: v for k, v in before.items() if k != "AMD EPYC (AVX512)"}


@pytest.mark.parametrize("column", range(5))
def test_summary_column_says_not_measured_without_its_records(tmp_path, column):
    """Negative control per category: remove every record a column reads and the column says "not measured"."""
    mod = _renderer()
    src = _copy(tmp_path)
    patterns = mod.SUMMARY[column][1]
    gone = [f for f in src.glob("*.json") if mod.claim(f.name) in patterns]
    assert gone
    before = _summary_rows(mod.render_pages(src)["README.md"])
    assert any(cells[column] != mod.NOT_MEASURED for cells in before.values())
    for f in gone:
        f.unlink()
    pages = mod.render_pages(src)
    after = _summary_rows(pages["README.md"])
    assert after and all(cells[column] == mod.NOT_MEASURED for cells in after.values()), after
    assert _dead_links(pages) == [] and _untraced(pages["README.md"], src) == []


def test_search_table_takes_the_cpu_of_the_study_that_wrote_it(tmp_path):
    """study_cost*-pareto.json have no hardware of their own; each study_cost*.json's engine config names its
    table. Negative control: without those records the tables' CPU is unknown."""
    import re

    mod = _renderer()
    col = [c[0] for c in mod.SUMMARY].index("best feasible search point")
    table = re.compile(r"#study_cost[\w-]*-pareto-json")
    rows = _summary_rows(mod.render_pages(RESULTS)["README.md"])
    assert table.search(rows["AMD EPYC (AVX512)"][col])
    assert "#demo-pareto-json" in rows[mod.NO_CPU][col]  # no record names the demo table: its CPU is unknown
    src = _copy(tmp_path)
    for record in src.glob("study_cost*.json"):
        if not record.name.endswith("-pareto.json"):
            record.unlink()
    rows = _summary_rows(mod.render_pages(src)["README.md"])
    assert rows["AMD EPYC (AVX512)"][col] == mod.NOT_MEASURED and table.search(rows[mod.NO_CPU][col])


@pytest.mark.parametrize("name, hardware, kind", [
    ("x.json", {"cpu": "AMD EPYC", "isa": "AVX512", "probe": {"bf16_matmul": "native (AVX512-BF16)"}}, "AMD EPYC (AVX512)"),
    ("x.json", {"cpu": "Intel(R) Xeon(R) Processor", "isa": "AVX512", "probe": {"bf16_matmul": "native (AMX)"}},
     "Intel Xeon (AVX512, AMX)"),
    ("x.json", {"cpu": "Intel(R) Xeon(R) Processor", "isa": "AVX2", "probe": {"forced": "avx2"}}, "Intel Xeon (AVX2 forced)"),
    ("decode-bf16.amd-epyc-avx512.json", {"cpu": "AMD EPYC"}, "AMD EPYC (AVX512)"),  # ISA from the machine tag
    ("q.intel-xeon-avx512-amx.json", {"cpu": "Intel(R) Xeon(R) Processor"}, "Intel Xeon (AVX512, AMX)"),
    ("q.intel-xeon-avx2-forced.json", {"cpu": "Intel(R) Xeon(R) Processor"}, "Intel Xeon (AVX2 forced)"),
    ("q.amd-epyc-avx512.json", {"cpu": "Intel(R) Xeon(R) Processor"}, "Intel Xeon (ISA not recorded)"),  # tag of another CPU
    ("specdec.json", {"cpu": "AMD EPYC"}, "AMD EPYC (ISA not recorded)"),
    ("demo-pareto.json", None, "CPU not recorded"),
])
def test_cpu_kind(name, hardware, kind):
    assert _renderer().cpu_kind(name, {} if hardware is None else {"hardware": hardware}) == kind
