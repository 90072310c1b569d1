"""bench/results/README.md is rendered from the JSON beside it and cannot drift; README.md stays short."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

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


def test_committed_page_equals_a_fresh_render():
    page = (RESULTS / "README.md").read_text()
    assert page == _renderer().render_page(RESULTS), "bench/results/README.md is stale: run `make results`"


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
    out = tmp_path / "page.md"
    assert mod.main(["--results", str(src), "--out", str(out)]) == 0
    new, old = out.read_text(), (RESULTS / "README.md").read_text()
    assert new != old
    assert "Read bandwidth 12.35 GB/s" in new and f"Read bandwidth {before_bw:.2f} GB/s" in old
    assert "| 98.8 |" in new and f"| {before_row:.1f} |" in old
    # only the edited section changed
    diff = [(a, b) for a, b in zip(old.splitlines(), new.splitlines()) if a != b]
    assert len(diff) == 2, diff
    assert mod.main(["--results", str(src), "--out", str(out), "--check"]) == 0
    assert mod.main(["--results", str(RESULTS), "--out", str(out), "--check"]) == 1


def test_unknown_json_is_listed_as_not_rendered(tmp_path):
    mod = _renderer()
    src = _copy(tmp_path)
    (src / "mystery_bench.json").write_text(json.dumps({"name": "mystery", "results": {"x": 1}}))
    page = mod.render_page(src)
    tail = page.split("## Not rendered", 1)[1]
    assert "`mystery_bench.json`" in tail
    assert "`mystery_bench.json`" not in page.split("## Not rendered", 1)[0]
    assert "- none" not in tail


def test_four_bit_sections_carry_the_q4_1_caveat():
    page = (RESULTS / "README.md").read_text()
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
    page.write_text((RESULTS / "README.md").read_text().replace("| fp32 (dense cache) | ", "| fp32 (dense cache) | 46.5 ", 1))
    assert _renderer("trace_numbers").main([str(page), "--quiet"]) == 1
    assert "46.5\t<- MISSING" in capsys.readouterr().out
