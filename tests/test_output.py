"""Quiet by default, visible progress: -q drops notes and bars, -v lets the libraries talk, and API calls that
take minutes report progress through a callback or INFO logs."""
import json
import logging

from runtime.progress import log_ticks
from tests.test_cli_errors import assert_one_line_error, run_main


def _accept(tiny_llama_dir, tmp_path, *global_flags):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abcabc abc"}))
    return run_main(*global_flags, "accept", str(tiny_llama_dir), "--spec", "ngram:min=1,max=2", "--k", "1",
                    "--dataset-name", str(prompts), "-n", "1", "--output-len", "4", "--dtype", "fp32",
                    "--threads", "1", "-o", str(tmp_path / "a.json"))


def test_quiet_keeps_results_and_drops_notes(tiny_llama_dir, tmp_path):
    loud, quiet = _accept(tiny_llama_dir, tmp_path), _accept(tiny_llama_dir, tmp_path, "-q")
    assert loud.returncode == quiet.returncode == 0, loud.stderr + quiet.stderr
    assert "recommended K" in quiet.stdout and "recommended K" in loud.stdout  # the results stay
    assert "run record:" in loud.stdout and "run record:" not in quiet.stdout  # the note goes
    assert (tmp_path / "a.json").exists()


def test_quiet_and_verbose_exclude_each_other():
    assert_one_line_error(run_main("-q", "-v", "model", "info"), "pass -q or -v, not both")


def test_log_ticks_reports_progress(caplog):
    tick = log_ticks(logging.getLogger("quantspec.test"), every_s=0.0)
    with caplog.at_level(logging.INFO, logger="quantspec.test"):
        for _ in range(3):
            tick("plain")
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["plain: 1 done", "plain: 2 done", "plain: 3 done"]
    quiet = log_ticks(logging.getLogger("quantspec.test"), every_s=3600)  # negative control: throttled
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="quantspec.test"):
        quiet("plain")
    assert caplog.records == []
