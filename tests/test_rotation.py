"""Hadamard rotations (``--rotate hadamard``, quant/rotation.py) and int4 activations (a4tok-dyn, a4g<N>-dyn): the
rotated full-precision model computes the same logits, the matrices are compressed-tensors' own, the online R4
survives export and reload, W4A4 gains from rotation on a model with an outlier channel, and bad combinations are
refused in one line. Each correctness check is run once on a broken version too (negative control)."""
import json

import pytest
import torch
from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix, random_hadamard_matrix

import quant.quantize
import quant.rotation
from conftest import make_tiny_llama
from evals.config import Config
from quant.actquant import fake_quantize_activation
from quant.checkpoint import save_compressed
from quant.quantize import quantize_model
from quant.rotation import CONFIG_KEY, hadamard_matrices, rotate_hadamard
from quant.scheme import parse_scheme
from runtime.errors import UserError
from runtime.generate import Decoder
from runtime.loading import load_model
from runtime.transformer import ModelArgs, OnlineRotation
from serving.backends import BACKENDS
from studies.space import SearchSpace
from test_cli_errors import assert_one_line_error, run_main

IDS = [5, 17, 33, 9, 60, 2, 44, 71, 12, 99, 100, 3, 4, 50, 51, 52]
W4A4 = "w4g32-sym_a4tok-dyn"


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True)


def _load(path, norms_seed: int | None = 1):
    """The tiny model in fp32 with random RMSNorm weights (HF initialises them to 1, which would hide a missing
    norm fold) and a random v_proj bias (R2 rotates it)."""
    lm = load_model(str(path), "fp32")
    if norms_seed is not None:
        gen = torch.Generator().manual_seed(norms_seed)
        with torch.no_grad():
            for name, p in lm.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return lm


def _logits(lm):
    return Decoder(lm, 32).forward(IDS)


def _gap(a, b) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


# ---- full-precision equivalence ----

@pytest.mark.parametrize("tied", [False, True])
def test_rotated_model_computes_the_same_logits(tiny_llama_dir, tied_llama_dir, tied):
    """R1 + R2 + R4 leave the fp32 logits equal within fp32 rounding (tied embeddings: untied, both rotated), and
    the weights did change: norms are 1, the embedding is rotated, every down_proj has its online R4."""
    path = tied_llama_dir if tied else tiny_llama_dir
    lm = _load(path)
    before, embed = _logits(lm), lm.model.embed_tokens.weight.detach().clone()
    info = rotate_hadamard(lm)
    assert info == lm.model.rotation and (info["r1"], info["r2"], info["r4"]) == (64, 16, 128)
    torch.testing.assert_close(_logits(lm), before, rtol=0, atol=2e-5 * before.abs().max().item())
    assert not lm.model.args.tie_word_embeddings and lm.model.lm_head.weight is not lm.model.embed_tokens.weight
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in lm.model.named_parameters() if n.endswith("norm.weight"))
    assert (lm.model.embed_tokens.weight - embed).abs().max() > 0.01
    assert all(b.mlp.down_input is not None for b in lm.model.layers)


@pytest.mark.parametrize("broken", ["no norm fold", "R4 transposed online", "no online R4", "R1 transposed on o_proj"])
def test_a_broken_rotation_changes_the_logits(tiny_llama_dir, monkeypatch, broken):
    """Negative controls: each missing or transposed piece breaks the equality the test above checks."""
    lm = _load(tiny_llama_dir)
    before = _logits(lm)
    if broken == "no norm fold":
        monkeypatch.setattr(quant.rotation, "_fold_norms", lambda model: None)
    if broken == "R1 transposed on o_proj":
        real, o_proj = quant.rotation._transform, lm.model.layers[0].self_attn.o_proj
        monkeypatch.setattr(quant.rotation, "_transform", lambda linear, left=None, right=None: real(
            linear, left.T if linear is o_proj else left, right))
    rotate_hadamard(lm)
    mlp = lm.model.layers[0].mlp
    if broken == "R4 transposed online":
        mlp.down_input = OnlineRotation(mlp.down_input.matrix.T)
    if broken == "no online R4":
        mlp.down_input = None
    assert _gap(before, _logits(lm)) > 1e-3


def test_matrices_are_compressed_tensors_orthonormal_hadamards():
    """R1 and R4 are compressed-tensors' random Hadamards (seeded) over sqrt(n), R2 its Sylvester one: orthonormal,
    every entry +-1/sqrt(n). Negative control: another seed gives other signs."""
    args = ModelArgs(vocab_size=8, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, intermediate_size=1536)
    m = hadamard_matrices(args, seed=0)
    expected_r1 = random_hadamard_matrix(576, torch.float64, gen=torch.Generator().manual_seed(0)) / 24
    assert torch.equal(m.r1, expected_r1)
    assert torch.equal(m.r2, deterministic_hadamard_matrix(64, torch.float64) / 8)
    for q in (m.r1, m.r2, m.r4):
        n = q.shape[0]
        torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(q.abs(), torch.full_like(q, n ** -0.5), rtol=1e-12, atol=0)
    assert not torch.equal(hadamard_matrices(args, seed=1).r1, m.r1)


# ---- quantized: quality, methods, export ----

def _outlier_model(path):
    """The tiny model with one residual channel 40x larger (what per-token int4 activations suffer from)."""
    lm = _load(path, norms_seed=None)
    with torch.no_grad():
        lm.model.embed_tokens.weight[:, 7] *= 40
    return lm


def test_rotation_lowers_w4a4_error_on_an_outlier_channel(tiny_llama_dir):
    """W4A4 (per-token int4 activations) loses much less with the rotation, on a model whose residual stream has
    an outlier channel; the unrotated W4A4 is the control the factor is measured against."""
    ref = _logits(_outlier_model(tiny_llama_dir))
    errors = {}
    for rotate in (None, "hadamard"):
        lm = _outlier_model(tiny_llama_dir)
        report = quantize_model(lm, W4A4, progress=False, rotate=rotate)
        assert report.rotate == rotate and ("rotation" in report.transform) == (rotate is not None)
        errors[rotate] = ((_logits(lm) - ref).norm() / ref.norm()).item()
    assert errors[None] > 1.5 * errors["hadamard"], errors  # 1.9x here


def test_gptq_runs_on_the_rotated_weights(tiny_llama_dir, calib, monkeypatch):
    """GPTQ calibrates on the rotated model: down_proj's Hessian is the unrotated one turned by R4
    (``Q4ᵀ H Q4``: its inputs pass the online R4). Negative control: it is not the unrotated Hessian itself."""
    seen = []
    collect = quant.quantize.collect_layer_stats
    monkeypatch.setattr(quant.quantize, "collect_layer_stats",
                        lambda *a, **kw: seen.append(collect(*a, **kw)) or seen[-1])
    name = "layers.0.mlp.down_proj"
    for rotate in (None, "hadamard"):
        lm = load_model(str(tiny_llama_dir), "fp32")
        report = quantize_model(lm, "w4g32-sym", "gptq", calib, progress=False, rotate=rotate)
        assert report.rotate == rotate and report.method == "gptq"
    plain, rotated = seen[0][name].hessian, seen[1][name].hessian
    r4 = lm.model.layers[0].mlp.down_input.matrix.double()
    torch.testing.assert_close(rotated, r4.T @ plain @ r4, rtol=1e-4, atol=1e-4 * plain.abs().max().item())
    assert (rotated - plain).abs().max() > 0.1 * plain.abs().max()


def test_rotated_export_reloads_with_its_online_r4(tied_llama_dir, tmp_path):
    """The checkpoint records the rotation and is saved untied; reloaded, the online R4 is back and the logits are
    bitwise the in-memory model's. Negative control: the reload without its R4 answers otherwise."""
    lm = load_model(str(tied_llama_dir), "fp32")
    report = quantize_model(lm, "w4g32-sym_a8tok-dyn", progress=False, rotate="hadamard")
    out = save_compressed(lm, report, tmp_path / "ck")
    config = json.loads((out / "config.json").read_text())
    assert config[CONFIG_KEY]["rotate"] == "hadamard" and config["tie_word_embeddings"] is False
    loaded = load_model(str(out), "fp32")
    assert loaded.model.rotation == lm.model.rotation
    assert torch.equal(_logits(loaded), _logits(lm))
    for block in loaded.model.layers:
        block.mlp.down_input = None
    assert _gap(_logits(lm), _logits(loaded)) > 1e-3


# ---- int4 activations ----

@pytest.mark.parametrize("label,group", [("a4tok-dyn", 64), ("a4g16-dyn", 16)])
def test_int4_activations_quantize_per_token_or_group(label, group):
    """Each token (or group of columns) on a symmetric int4 grid of at most 15 levels, its max at +-7 steps; a group
    scale follows its group only. Negative control: per-token and per-group codes differ on a skewed row."""
    act = parse_scheme(f"w4g32-sym_{label}").activations
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 4, 64)
    y = fake_quantize_activation(x, act).reshape(-1, 64 // group, group)
    step = y.abs().amax(-1, keepdim=True) / 7
    assert torch.allclose(y / step, (y / step).round(), atol=1e-4) and (y / step).abs().max() <= 7 + 1e-4
    torch.testing.assert_close(step, x.reshape(-1, 64 // group, group).abs().amax(-1, keepdim=True) / 7)
    other = "a4g16-dyn" if label == "a4tok-dyn" else "a4tok-dyn"
    assert not torch.equal(fake_quantize_activation(x, parse_scheme(f"w4g32-sym_{other}").activations),
                           fake_quantize_activation(x, act))


@pytest.mark.parametrize("scheme", ["w4g32-sym_a4tok-dyn", "w4g32-sym_a4g32-dyn", "w8ch-sym_a4tok-dyn"])
def test_int4_activation_schemes_run_simulated(tiny_llama_dir, scheme):
    """Every layer on the simulated kernel (the int8 x int8 kernel does not take 4-bit inputs), computing the
    fake-quantized input times the dequantized weight. Negative control: the weight-only twin differs."""
    lm = load_model(str(tiny_llama_dir), "fp32")
    assert quantize_model(lm, scheme, progress=False).kernels == {"simulated": 14}
    layer = lm.model.get_submodule("layers.0.mlp.down_proj")
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x), fake_quantize_activation(x, layer.act) @ layer.dequantized_weight().T)
    assert (layer(x) - x @ layer.dequantized_weight().T).abs().max() > 1e-3


# ---- refusals ----

@pytest.mark.parametrize("overrides,needle", [
    ({"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}, "power-of-two head dim"),
    ({"intermediate_size": 66}, "no Hadamard matrix of size 66 (intermediate size, R4)"),
])
def test_shapes_without_a_hadamard_are_refused_before_any_change(tmp_path, overrides, needle):
    path = make_tiny_llama(tmp_path / "m", **overrides)
    lm = load_model(str(path), "fp32")
    state = {k: v.clone() for k, v in lm.model.state_dict().items()}
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        rotate_hadamard(lm)
    assert "\n" not in str(err.value)
    assert all(torch.equal(state[k], v) for k, v in lm.model.state_dict().items())
    assert_one_line_error(run_main("quantize", str(path), "--scheme", "w8ch-sym", "--rotate", "hadamard"), needle)
    proc = run_main("quantize", str(path), "--scheme", "w8ch-sym", "--dtype", "fp32")  # control: unrotated runs
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kw,needle", [
    ({"scheme": "w4g32-sym", "method": "awq"}, "method 'awq' cannot quantize a rotated model"),
    ({"scheme": "none"}, "give a weight scheme"),
    ({"scheme": "W8A8", "smoothquant": 0.5}, "SmoothQuant or static activation scales is not built"),
    ({"scheme": "w8ch-sym_a8t-static"}, "SmoothQuant or static activation scales is not built"),
    ({"scheme": "w4g32-sym_a4tok-static"}, "static activation scales are 8-bit only; use a4tok-dyn"),
    ({"scheme": "w4g32-sym_a4t-dyn"}, "activation granularity 'tensor': use token or group"),
])
def test_bad_combinations_are_one_line_errors(kw, needle):
    with pytest.raises(UserError, match=needle) as err:
        Config.parse(rotate="hadamard", **kw)
    assert "\n" not in str(err.value)
    Config.parse(scheme="w4g32-sym", method="gptq", rotate="hadamard")  # control


def test_rotating_twice_or_a_quantized_model_is_refused(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), "fp32")
    rotate_hadamard(lm)
    with pytest.raises(UserError, match="rotated already"):
        rotate_hadamard(lm)
    quantized = load_model(str(tiny_llama_dir), "fp32")
    quantize_model(quantized, "w8ch-sym", progress=False)
    with pytest.raises(UserError, match="is quantized: rotate the full-precision model"):
        rotate_hadamard(quantized)


def test_vllm_refuses_rotated_points_and_checkpoints(tiny_llama_dir, tmp_path):
    """A rotated point, or a checkpoint that records a rotation, is refused for vLLM with the reason. Negative
    control: the same scheme unrotated passes the rotation rule (W4A16 is a vLLM CPU scheme)."""
    vllm = BACKENDS.get("vllm")
    reason = vllm.check(Config.parse(scheme="w4g32-sym", rotate="hadamard", backend="vllm"))
    assert "online R4 Hadamard" in reason and "--backend native" in reason
    lm = load_model(str(tiny_llama_dir), "fp32")
    out = save_compressed(lm, quantize_model(lm, "w4g32-sym", progress=False, rotate="hadamard"), tmp_path / "ck")
    assert "online R4 Hadamard" in vllm.check(Config(model=str(out), backend="vllm"))
    assert "online R4" not in (vllm.check(Config.parse(scheme="w4g32-sym", backend="vllm")) or "")


# ---- one name across Config, the search space and the CLI ----

def test_rotation_is_part_of_the_point():
    """A rotated point never shares a cache key, label or export with its unrotated twin; it round-trips."""
    plain, rotated = Config.parse(scheme=W4A4), Config.parse(scheme=W4A4, rotate="hadamard")
    assert rotated.rotate == "hadamard" and plain.rotate is None and Config.parse(scheme=W4A4, rotate="none") == plain
    assert rotated.quality_key != plain.quality_key and "rot-hadamard" in rotated.label
    assert Config.from_dict(rotated.to_dict()) == rotated and "rotate" not in plain.to_dict()
    space = SearchSpace(weights=["w4g32-sym"], activations=["a4tok-dyn"], rotate=["none", "hadamard"])
    assert space.size == 2 and space.to_dict()["rotate"] == ["none", "hadamard"]
    assert SearchSpace.params_of(rotated)["rotate"] == "hadamard" and "rotate" not in SearchSpace.params_of(plain)
    assert "rotate" not in SearchSpace().to_dict()
    with pytest.raises(UserError, match="unknown rotation 'quarot': pick one of hadamard"):
        SearchSpace(weights=["w4g32-sym"], rotate=["quarot"])


@pytest.mark.parametrize("command", ["quantize", "eval", "bench"])
def test_cli_help_lists_rotate(command):
    proc = run_main(command, "--help")
    assert proc.returncode == 0 and "--rotate" in proc.stdout and "hadamard" in proc.stdout
