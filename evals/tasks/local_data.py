"""Offline datasets for the local lm-eval task YAMLs in this folder.

Each YAML names ``custom_dataset: !function local_data.<reader>`` and the data file(s) it needs in
``dataset_kwargs``; lm-eval calls the reader with the TaskManager metadata (``data_dir``, set at run time by
``evals.harness.task_manager``) merged with those kwargs. Readers return the split the upstream task scores
(ARC/LAMBADA/WikiText: test; PIQA/HellaSwag/WinoGrande: validation) with the upstream field names, so the
YAMLs keep upstream's doc_to_text/doc_to_target/doc_to_choice/metrics verbatim where the layout allows.
"""
from __future__ import annotations

import bz2
from pathlib import Path

import datasets
# WikiText scoring is upstream's, re-exported so the YAML's !function resolves inside this folder.
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401

from runtime.data import data_file, read_jsonl


def _path(relative: str, data_dir: str | None) -> Path:
    return data_file(relative, data_dir)  # UserError naming the file and the dir when missing


def _lines(relative: str, data_dir: str | None) -> list[str]:
    return _path(relative, data_dir).read_text().splitlines()


def jsonl(split: str, file: str, data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """A JSONL file already in the upstream record layout (ARC, LAMBADA)."""
    return datasets.DatasetDict({split: datasets.Dataset.from_list(read_jsonl(_path(file, data_dir)))})


def piqa(split: str, file: str, labels: str, data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """PIQA questions + the separate label list (0 selects sol1), as upstream's goal/sol1/sol2/label."""
    rows = read_jsonl(_path(file, data_dir))
    gold = _lines(labels, data_dir)
    if len(gold) != len(rows):
        raise ValueError(f"{labels} has {len(gold)} labels for {len(rows)} PIQA rows")
    docs = [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(g)} for r, g in zip(rows, gold)]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs)})


def hellaswag(split: str, file: str, data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """llama.cpp's 6-line HellaSwag text -> upstream's processed query/choices/label.

    Upstream builds ``activity_label + ": " + ctx_a + " " + ctx_b.capitalize()``; the text file only keeps
    ``ctx = ctx_a + " " + ctx_b``, so the fragment after the last ". " is taken as ctx_b and capitalized when it
    starts lower-case (the usual ActivityNet case). Items whose split point differs are the one deviation.
    """
    from lm_eval.tasks.hellaswag.utils import preprocess

    with bz2.open(_path(file, data_dir), "rt") as f:
        lines = f.read().splitlines()
    docs = []
    for i in range(0, len(lines) - 5, 6):
        head, sep, tail = lines[i].rpartition(". ")
        query = head + sep + tail.capitalize() if sep and tail[:1].islower() else lines[i]
        docs.append({"query": preprocess(query), "choices": [preprocess(e) for e in lines[i + 2 : i + 6]],
                     "label": int(lines[i + 1])})
    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs)})


def winogrande(split: str, file: str, data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """MosaicML layout (context_options, continuation, gold) -> the choices/target upstream builds from
    ``sentence``/``option1``/``option2``/``answer``: contexts ``sentence[:blank] + option``, target the rest."""
    docs = [{"options": r["context_options"], "continuation": r["continuation"].strip(), "label": int(r["gold"])}
            for r in read_jsonl(_path(file, data_dir))]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs)})


def winogrande_text(doc: dict) -> int:
    return doc["label"]  # upstream: the gold option index (multiple-input task)


def winogrande_target(doc: dict) -> str:
    return doc["continuation"]


def winogrande_choices(doc: dict) -> list[str]:
    return list(doc["options"])


def wikitext(split: str, file: str, data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """wiki.test.raw split into articles exactly as EleutherAI/wikitext_document_level does (one ``page`` each)."""
    pages, current = [], []
    for line in _path(file, data_dir).read_text(encoding="utf-8").split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            if "\n".join(current).strip():
                pages.append("\n".join(current))
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return datasets.DatasetDict({split: datasets.Dataset.from_list([{"page": p} for p in pages])})

