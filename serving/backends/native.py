"""The native backend: quant/ + specdec/ in this process, batch 1.

Requests are served one after another (no batched decode). Under concurrency C or an open-loop rate the other
requests wait in a FIFO queue, and that wait is part of their TTFT and end-to-end latency (``queue_s``
reports it separately), so throughput at C > 1 is the batch-1 throughput and latency grows honestly.
"""
from __future__ import annotations

import collections
import resource
import time

import torch

from dataclasses import replace

from serving.backends.base import Backend, ServingConfig, register_backend
from serving.requests import Progress, Request, RequestResult, SpecCounters, check_fits, now
from evals.build import build_native
from evals.config import Config
from runtime.compiled import gemm_backends, longest_per_span, resolve_compile, step_attention
from runtime.errors import UserError
from runtime.hardware import kernels_used
from runtime.threads import apply_threads
from runtime.generate import Decoder
from runtime.sampling import SamplingConfig
from specdec.proposers.base import build_proposer
from specdec.speculative import SpeculativeDecoder

WARM_TOKENS = 8  # a span's build run (``prepare``): enough for a few speculation rounds


@register_backend("native")
class NativeBackend(Backend):
    batching = "batch-1: requests served one after another in arrival order; waiting time counts in TTFT/E2E"
    cache_warmth = "KV cache reset per request (no prefix reuse); weights resident in RAM"
    interleavable = True  # in-process models: reference and candidate alternate request by request
    reusable = True  # ``serve_also``: the points of one transformation share a build and its compiled steps

    def __init__(self, config: ServingConfig, engine: "NativeBackend | None" = None):
        """``engine``: a backend of the same build (``serve_also`` checked it) whose model, thread choice and plain
        decoder (its caches and compiled steps) this one runs on."""
        super().__init__(config)
        reason = self.check(config)
        if reason:
            raise UserError(reason)
        point = config.config
        if engine is None:
            # eager attention: batch-invariant rows, so bf16 speculation is token-exact (``check_bf16_exact``)
            built = build_native(replace(point, attention=point.attention or "eager"), config.threads)
            self.lm, self.quant_report, self.scheme_info = built.lm, built.report, built.scheme_info
            self.threads = apply_threads(self.lm.model, config.threads)
            self.compile = resolve_compile(config.compile, str(self.lm.device))
            plain = Decoder(self.lm, config.max_model_len, built.cache_factory, compile_mode=self.compile.mode)
        else:
            self.lm, self.quant_report, self.scheme_info = engine.lm, engine.quant_report, engine.scheme_info
            self.threads, self.compile, plain = engine.threads, engine.compile, engine._target
        self.sampling = SamplingConfig(temperature=config.temperature, seed=0)
        self.decoder, self.plain = self._decoder(plain, shared=engine is not None)
        self._built_before = self._target.compile_s  # steps another point of this build compiled: not this one's
        self.counters = SpecCounters() if point.speculative else None

    @classmethod
    def check(cls, config: "Config | ServingConfig") -> str | None:
        point = config.config if isinstance(config, ServingConfig) else config
        if point.speculative and point.kv_spec is not None:
            return (f"native speculative decoding keeps a bf16 KV cache: drop --kv {point.kv} or --spec "
                    "(or use --backend vllm, which speculates over an fp8 KV cache)")
        return None

    @classmethod
    def exactness(cls, config: Config) -> dict:
        if config.dtype != "bf16":
            return {"by_construction": False, "why": f"{config.dtype} GEMMs are not batch-invariant here"}
        return {"by_construction": True, "why": "native bf16: SpeculativeDecoder runs only with eager attention and "
                "every linear kernel and the attention probed row-invariant (specdec.speculative.check_bf16_exact)"}

    def _decoder(self, plain: Decoder, shared: bool) -> tuple[Decoder | SpeculativeDecoder, Decoder | None]:
        """(what serves requests, the plain decoder other points may share: None once a proposer changed it)."""
        point = self.config.config
        if not point.speculative:
            return plain, plain
        proposer = build_proposer(point.proposer_spec, self.lm)
        if proposer.changes_target and shared:  # a decoder of its own: the shared one stays as other points run it
            plain = Decoder(self.lm, self.config.max_model_len, compile_mode=self.compile.mode)
        spec = SpeculativeDecoder(self.lm, proposer, point.k, self.sampling, decoder=plain)
        return spec, None if proposer.changes_target else plain

    def serve_also(self, config: ServingConfig) -> "NativeBackend | None":
        """A backend for ``config`` on this one's build and plain decoder when ``config`` differs from this one's
        only in speculation (proposer, K); None where it needs another build, or where a point's speculation sent
        the decoder back to the eager step (``SpeculativeDecoder.prepare``: that was that point's verdict)."""
        if self.plain is None or self.plain.fallback or config.without_spec() != self.config.without_spec():
            return None
        return NativeBackend(config, engine=self)

    def plain_twin(self) -> "NativeBackend | None":
        """Where this point's speculation sent its target decoder back to the eager step (``SpeculativeDecoder.
        prepare``), plain decoding on that decoder; the plain point's own engine decodes compiled."""
        if not self.config.config.speculative or not self._target.fallback:
            return None
        return NativeBackend(self.config.without_spec(), engine=self)

    @property
    def _target(self) -> Decoder:
        """The decoder of the target's plain and verification forwards."""
        return self.decoder.decoder if self.config.config.speculative else self.decoder

    @property
    def step_label(self) -> str:
        """What plain and verification forwards run on (``Decoder.step_label``; eager with the reason when
        ``--compile`` resolved to it)."""
        return self._target.step_label if self.compile.mode else self.compile.label

    @property
    def compile_s(self) -> float:
        """Seconds this backend spent building compiled steps (those a shared decoder had before are not its)."""
        return self._target.compile_s - self._built_before

    def warm_up(self, requests: list[Request], load_kind: str) -> str:
        """Compiled: every step the warm-up requests run is built (and, speculating, probed) first."""
        if self.config.config.speculative:
            first = requests[0]
            self.decoder.prepare(first.prompt_ids, self.config.config.k, len(first.prompt_ids) + first.max_tokens)
        what = super().warm_up(requests, load_kind)
        built = f" built in {self.compile_s:.1f} s (one-time)" if self.compile_s else ""
        return f"{self.step_label} step{built}; {what}"

    def prepare(self, requests: list[Request]) -> str:
        """Compiled: the steps of every cache span ``requests`` reach (``Decoder.reserve``), built (and, speculating,
        probed) by a short run of the longest request of each span."""
        plain = self._target
        if not plain.compile_mode or plain.step.fallback:
            return ""
        longest = longest_per_span(requests, lambda r: len(r.prompt_ids) + r.max_tokens, plain.max_len)
        spans = [span for span in longest if span not in plain.step.spans]
        before = self.compile_s
        for span in spans:
            r = longest[span]
            positions = len(r.prompt_ids) + r.max_tokens
            if self.config.config.speculative:
                self.decoder.prepare(r.prompt_ids, self.config.config.k, positions)
                self.decoder.generate(r.prompt_ids, WARM_TOKENS, True, positions)
            else:
                self.decoder.generate(r.prompt_ids, WARM_TOKENS, self.sampling, True, positions)
        return (f"steps over {', '.join(map(str, spans))} cache positions built in {self.compile_s - before:.1f} s "
                "(one-time)") if spans else ""

    def _generate(self, request: Request):
        if self.config.config.speculative:
            return self.decoder.generate(request.prompt_ids, request.max_tokens, request.ignore_eos)
        return self.decoder.generate(request.prompt_ids, request.max_tokens, self.sampling, request.ignore_eos)

    def tokenizer(self):
        return self.lm.tokenizer

    def engine_config(self) -> dict:
        point = self.config.config
        return {"runtime": "native PyTorch (quant/ + specdec/)", "dtype": "bf16",
                "attention": self.lm.model.attn_implementation, "scheme": self.scheme_info,
                "method": point.method if self.quant_report else None, "rotate": point.rotate,
                "kernels": self.quant_report.kernels if self.quant_report else None,
                "kernels_run": kernels_used(self.lm.model), "kv": point.kv,
                "compile": self.config.compile, "step": self.step_label, "compile_s": self.compile_s,
                "gemm_backends": gemm_backends(self.compile.mode, torch.device(self.lm.device).type),
                "step_attention": step_attention(self.lm.model) if self.compile.mode else None,
                "spec": point.spec_label, "max_len": self.config.max_model_len,
                "threads": torch.get_num_threads(), "thread_choice": self.threads.to_dict(),
                "batching": self.batching}

    def retune(self) -> dict | None:
        if self.config.threads:  # the user fixed it
            return None
        before = self.threads.threads
        self.threads = apply_threads(self.lm.model, None)
        return {"threads_before": before, "threads_after": self.threads.threads, "probe_ms": self.threads.probe_ms}

    def _serve(self, request: Request, sent: float, scheduled: float | None) -> RequestResult:
        started = now()
        result = RequestResult(request.index, len(request.prompt_ids), sent, scheduled, started)
        gen = self._generate(request)
        result.end = now()
        result.first_token = started + gen.prefill_s
        result.chunk_times = [started + t for t in gen.chunk_s]  # in-process: a token is "streamed" when ready
        result.token_ids = list(gen.tokens)
        result.finish_reason = gen.finish_reason
        if self.counters is not None:
            self.counters = self.counters + counters_from_stats(gen.stats)
        return result

    def closed_loop(self, requests: list[Request], concurrency: int, progress: Progress | None = None
                    ) -> list[RequestResult]:
        """C clients against a batch-1 server: the first C requests are sent at once, each completion sends
        that client's next request; the server takes them in send order."""
        check_fits(requests, self.config.max_model_len)
        todo = collections.deque(requests)
        t0 = now()
        queue = collections.deque((todo.popleft(), t0) for _ in range(min(concurrency, len(todo))))
        results = []
        while queue:
            request, sent = queue.popleft()
            results.append(self._serve(request, sent, None))
            if progress:
                progress(results[-1])
            if todo:
                queue.append((todo.popleft(), results[-1].end))
        return sorted(results, key=lambda r: r.index)

    def open_loop(self, requests: list[Request], offsets: list[float], progress: Progress | None = None
                  ) -> list[RequestResult]:
        """Requests arrive at their planned times; one that arrives while another is served waits its turn."""
        check_fits(requests, self.config.max_model_len)
        t0 = now()
        results = []
        for request, offset in zip(requests, offsets):
            arrival = t0 + offset
            if arrival > now():
                time.sleep(arrival - now())
            results.append(self._serve(request, arrival, arrival))
            if progress:
                progress(results[-1])
        return results

    def spec_counters(self, load_kind: str = "closed") -> SpecCounters | None:
        return self.counters

    def peak_rss_bytes(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def counters_from_stats(stats: dict) -> SpecCounters:
    """Map specdec's per-generation acceptance statistics onto the shared counter fields."""
    if not stats:
        raise UserError("the speculative decoder returned no acceptance statistics")
    return SpecCounters(int(stats["drafts"]), int(stats["draft_tokens"]), int(stats["accepted"]),
                        [int(x) for x in stats.get("accepted_per_pos", [])])
