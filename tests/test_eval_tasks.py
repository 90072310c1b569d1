"""Local lm-eval task YAMLs read the data dir and build upstream-equivalent docs with the right golds."""
import pytest

from evals.harness import task_manager
from runtime.errors import UserError

LOCAL = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande", "lambada_openai", "wikitext")
SIZES = {"arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
         "lambada_openai": 5153, "wikitext": 62}


@pytest.fixture(scope="module")
def tasks(data_dir):
    from lm_eval.tasks import get_task_dict

    return get_task_dict(list(LOCAL), task_manager(LOCAL, data_dir))


def _first(task):
    return next(iter(task.eval_docs))


def test_sizes_match_upstream_splits(tasks):
    assert {name: len(t.eval_docs) for name, t in tasks.items()} == SIZES


def test_known_items(tasks):
    arc = tasks["arc_easy"]
    doc = _first(arc)
    assert arc.doc_to_text(doc) == ("Question: Which statement best explains why photosynthesis is the foundation "
                                    "of most food webs?\nAnswer:")
    assert arc.doc_to_choice(doc)[arc.doc_to_target(doc)] == "Sunlight is the source of energy for nearly all ecosystems."
    piqa = tasks["piqa"]
    assert piqa.doc_to_target(_first(piqa)) == 0 and piqa.doc_to_target(piqa.eval_docs[1]) == 1
    hs = tasks["hellaswag"]
    doc = _first(hs)
    assert hs.doc_to_text(doc) == "Roof shingle removal: A man is sitting on a roof. He"  # upstream capitalizes ctx_b
    assert hs.doc_to_target(doc) == 3 and hs.doc_to_choice(doc)[3] == "starts pulling up roofing on a roof."
    wg = tasks["winogrande"]
    doc = _first(wg)
    assert wg.doc_to_text(doc) == 1 and wg.doc_to_target(doc) == "always got the easier cases."
    assert wg.doc_to_choice(doc)[1] == "Sarah was a much better surgeon than Maria so Maria"
    lam = tasks["lambada_openai"]
    assert lam.doc_to_target(_first(lam)) == " signs"
    assert tasks["wikitext"].doc_to_target(_first(tasks["wikitext"])).startswith(" = Robert Boulter =")


def test_gold_labels_match_the_label_files(tasks):
    from runtime.data import data_file

    labels = data_file("winogrande/dev-labels.lst").read_text().split()
    wg = tasks["winogrande"]
    assert [wg.doc_to_text(d) + 1 for d in wg.eval_docs] == [int(x) for x in labels]
    arc = tasks["arc_challenge"]  # includes 1-4 numeric labels and 3/5-choice items
    assert all(0 <= arc.doc_to_target(d) < len(arc.doc_to_choice(d)) for d in arc.eval_docs)


def test_missing_data_file_names_file_and_dir(tmp_path):
    from lm_eval.tasks import get_task_dict

    with pytest.raises(UserError, match=r"piqa/valid.jsonl.*" + str(tmp_path)):
        get_task_dict(["piqa"], task_manager(("piqa",), tmp_path))
