"""One vocabulary: the neighbours' spellings parse, docs/cli.md is the app's, and a sweep of bad inputs over every
command gets one `error:` line, exit 2, nothing written."""
import pytest

from serving.serving_metrics import SLO
from quantspec.cli import reference
from runtime.errors import UserError
from specdec.sweep import parse_ks
from tests.test_cli_errors import assert_one_line_error, run_main


def test_docs_cli_md_is_generated_from_the_app():
    assert reference.main(["--check"]) == 0, "run: python -m quantspec.cli.reference"


def test_anchor_table_says_which_spellings_parse():
    found = reference.commands()
    assert reference.accepts(found["eval"], "--num_fewshot") and reference.accepts(found["eval"], "-L")
    assert reference.accepts(found["bench"], "--request-rate") and reference.accepts(found["bench"], "--goodput")
    # negative controls: a spelling no command has, and one that parses as another option, do not "work"
    assert not reference.accepts(found["eval"], "--batch_size")
    assert reference.accepts(found["eval"], "--model") and not reference.accepts(found["eval"], "--model", "--backend")
    table = reference.render().split("## The neighbours' spellings")[1]
    assert "| lm-eval | `--batch_size` | eval | - | no |" in table
    assert "| lm-eval | `--num_fewshot` | eval | --num-fewshot | yes |" in table
    assert "| lm-eval | `--model` | eval | --backend | no |" in table


@pytest.mark.parametrize("text, ks", [("1,2,4,8", [1, 2, 4, 8]), ("1-4", [1, 2, 3, 4]), ("1-3,8", [1, 2, 3, 8]),
                                      ("4,2,2", [2, 4]), (" 3 ", [3])])
def test_one_k_grammar(text, ks):
    assert parse_ks(text) == ks


@pytest.mark.parametrize("text", ["", "2,,4", "a", "4-2", "0", "1-33", "1-", "-3"])
def test_k_grammar_refuses(text):
    with pytest.raises(UserError):
        parse_ks(text)


def test_goodput_takes_vllm_bench_spelling_in_ms():
    assert SLO.parse("ttft:2000,tpot:200") == SLO(2.0, 0.2)
    assert SLO.parse("ttft:500 tpot:50") == SLO(0.5, 0.05)
    only_ttft = SLO.parse("ttft:100")
    assert only_ttft.ttft_s == 0.1 and only_ttft.tpot_s == float("inf")  # a bound left out does not count
    for bad in ("", "ttft", "ttft:x", "e2el:100", "ttft:0", "ttft:1,ttft:2"):
        with pytest.raises(UserError):
            SLO.parse(bad)


def test_model_as_option_or_positional(tiny_llama_dir, tmp_path):
    assert_one_line_error(run_main("generate", "-m", str(tmp_path / "nope"), "-p", "hi"), "not found")
    assert_one_line_error(run_main("eval", "default", "--model", str(tiny_llama_dir)), "two models given")
    proc = run_main("generate", "--model", str(tiny_llama_dir), "-p", "hi", "--max-new-tokens", "2", "--no-chat",
                    "--dtype", "fp32", "--threads", "1")
    assert proc.returncode == 0, proc.stderr


BAD_INPUTS = [  # (argv after the command's MODEL, needle of the one error line)
    (["accept", "--spec", "ngram", "--k", "1-4,x"], "--k takes integers"),
    (["accept", "--spec", "ngram", "--k", "4-1"], "runs backwards"),
    (["accept", "--spec", "ngram", "-n", "0"], "--num-prompts must be >= 1"),
    (["accept", "--spec", "ngram", "--output-len", "1"], "--output-len must be >= 2"),
    (["accept", "--spec", "ngram", "--dataset-name", "nope"], "nope"),
    (["check-lossless", "--spec", "ngram", "--k", "0"], "1..32"),
    (["bench", "--goodput", "ttft:abc"], "--goodput takes"),
    (["bench", "--goodput", "e2el:100"], "--goodput takes"),
    (["bench", "--k", "2,,3", "--spec", "ngram"], "--k takes integers"),
    (["bench", "--request-rate", "1", "--max-concurrency", "2"], "either --max-concurrency"),
    (["bench", "--request-rate", "x"], "comma-separated list"),
    (["bench", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["bench", "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "--dataset-name", "nope"], "unknown workload"),
    (["bench", "--max-model-len", "4"], "max_model_len must be >= 16"),
    (["bench", "--temperature", "-1"], "temperature must be >= 0"),
    (["eval", "-L", "0"], "--limit must be >= 1"),
    (["eval", "-f", "-1"], "--num-fewshot must be >= 0"),
    (["eval", "--tasks", ","], "no tasks given"),
    (["eval", "--confidence", "1.5"], "--confidence"),
    (["eval", "--floor", "2"], "--floor"),
    (["eval", "--backend", "tensorrt"], "tensorrt"),
    (["quantize", "--scheme", "w3g7"], "w3g7"),
    (["generate", "-p", "hi", "--top-p", "0"], "top-p"),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_sweep(tiny_llama_dir, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    command, *rest = argv
    extra = [] if command == "generate" else ["-o", str(out)]
    assert_one_line_error(run_main(command, str(tiny_llama_dir), *rest, *extra), needle)
    assert list(tmp_path.iterdir()) == [], "a refused command wrote something"


def test_search_k_takes_the_same_grammar_but_a_range(tmp_path):
    proc = run_main("search", "--evaluator", "toy", "--k", "1,2,4", "--study-dir", str(tmp_path / "s"))
    assert_one_line_error(proc, "search samples K from a range")
    assert not (tmp_path / "s").exists()
