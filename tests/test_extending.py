"""Extensions from outside the package (docs/extending.md): a module that registers a weight method, a proposer
and a serving backend, used through the public API and through the CLI (QUANTSPEC_PLUGINS and --plugin); without
the plugin the CLI refuses each name on one line, exit 2."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import quantspec

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "qs_toy_plugin"
PLUGIN_SOURCE = '''
import quantspec
from serving.backends.native import NativeBackend
from quant.methods import QuantResult
from quant.qmath import compute_qparams, quantize


@quantspec.register_method
class ToyRTN(quantspec.WeightMethod):
    """Round-to-nearest, tagged so the report shows this method ran."""
    name = "toy_rtn"

    def quantize_weight(self, weight, spec, stats=None):
        scale, zero = compute_qparams(weight, spec)
        return QuantResult(quantize(weight, scale, zero, spec), scale, zero, {"toy": True})


@quantspec.register_proposer("toyrepeat")
class RepeatLast(quantspec.Proposer):
    """Drafts the last context token K times."""

    @classmethod
    def from_spec(cls, arg, target):
        return cls()

    def propose(self, context, k, sampling, generator):
        return quantspec.Proposal([context[-1]] * k)


@quantspec.register_backend("toy")
class ToyBackend(NativeBackend):
    """The native engine under another name."""
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    return folder


@pytest.fixture(scope="module")
def plugin(plugin_dir):
    sys.path.insert(0, str(plugin_dir))
    try:
        yield importlib.import_module(PLUGIN)
    finally:
        sys.path.remove(str(plugin_dir))


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "abcabcabc abc"}) + "\n")
    return path


def test_api_runs_the_toy_method_proposer_and_backend(plugin, tiny_llama_dir):
    q = quantspec.quantize(str(tiny_llama_dir), "W8A16", method="toy_rtn", dtype="fp32")
    assert q.report.method == "toy_rtn" and q.fidelity.n_tokens > 0

    lm = quantspec.load(str(tiny_llama_dir), "fp32", 1, "eager")
    record = quantspec.measure_acceptance(lm, "tiny", "toyrepeat", [2], ["abcabcabc abc"], "inline", 8)
    assert record.results["proposer"] == "toyrepeat" and record.results["rows"][0]["greedy_equal"] == 1

    config = quantspec.ServingConfig(quantspec.Config.parse(model=str(tiny_llama_dir), backend="toy"), max_model_len=200)
    runs = quantspec.benchmark([config], [quantspec.LoadSpec.closed(1)], num_prompts=2, output_len=3)
    assert len(runs) == 1 and not runs[0].failed and runs[0].record.engine.backend == "toy"


def run_cli(*args, plugin_dir=None, env_plugins=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir or ""), str(ROOT)]))}
    env.pop("QUANTSPEC_PLUGINS", None)
    if env_plugins:
        env["QUANTSPEC_PLUGINS"] = env_plugins
    return subprocess.run([sys.executable, "-m", "quantspec.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def commands(tiny: Path, prompts: Path) -> dict[str, list[str]]:
    return {
        "toy_rtn": ["quantize", str(tiny), "--scheme", "W8A16", "--method", "toy_rtn", "--dtype", "fp32"],
        "toyrepeat": ["accept", str(tiny), "--spec", "toyrepeat", "--k", "2", "--dataset-name", str(prompts), "-n",
                      "1", "--output-len", "6", "--dtype", "fp32", "--threads", "1"],
        "toy": ["bench", str(tiny), "--backend", "toy", "-n", "2", "--output-len", "3", "--max-model-len", "200"],
    }


def test_cli_loads_plugins_from_env_and_option(plugin_dir, tiny_llama_dir, prompts):
    for i, (name, args) in enumerate(commands(tiny_llama_dir, prompts).items()):
        if i == 0:
            proc = run_cli("--plugin", PLUGIN, *args, plugin_dir=plugin_dir)
        else:
            proc = run_cli(*args, plugin_dir=plugin_dir, env_plugins=PLUGIN)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert name in proc.stdout, (name, proc.stdout[-2000:])


def test_negative_control_cli_without_plugin_refuses_each_name(tiny_llama_dir, prompts):
    for name, args in commands(tiny_llama_dir, prompts).items():
        proc = run_cli(*args)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: unknown") and repr(name) in lines[0], proc.stderr


def test_missing_plugin_is_one_line_exit_2():
    proc = run_cli("--plugin", "qs_no_such_plugin", "model", "--help")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: plugin 'qs_no_such_plugin' not found: put its folder on PYTHONPATH")
