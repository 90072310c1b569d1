"""Compiled decode steps, in the manner of gpt-fast.

A step takes n tokens and their positions as a tensor and attends over the first ``span`` positions of the
preallocated KV cache, with a mask hiding positions not yet written, so its shapes depend on n and the span only and
one ``torch.compile`` graph serves every position of a span: a ``Decoder`` sizes the span to each request
(``cache_span``: its positions rounded up to ``SPAN_BLOCK``, as llama.cpp pads its KV view), where reading the whole
cache made steps 1.44-1.69x slower (bench/results/cache_span.*.json); one graph per span (inductor's C++ backend on
CPU; each transformer block a nested compile region, built once and called for every layer, where it builds; bf16
linears call quantspec's ``bf16gemv`` op where it runs here, q/k/v and gate/up as one call each, int4/int8 ones
``int4gemv`` / ``int8gemv``; where another linear runs, the weights are frozen into the graph (prepacked by inductor
where it runs the product); on CPU the attention is ``step_attention``'s, where SDPA's kernel made reading the cache
slow; bf16 intermediates are rounded as eager rounds them, so a K+1-token step's rows are the one-token step's
wherever its kernels are row-invariant). A ``Decoder`` compiles its one-token forwards and, when asked, the K+1-token
verification forwards of speculative decoding (one step per n); prefill stays eager, and the eager path stays the reference (``Decoder(compile_mode=None)``).

Where speed is measured the setting is ``--compile``: ``auto`` (compile in ``DEFAULT_MODE`` where inductor can
build here), ``eager``, or a mode name (``resolve_compile``). Inductor's kernels are cached under
``$QUANTSPEC_HOME/inductor`` (``runtime.hardware.use_inductor_cache``), its FX graphs too where they hold no
mkldnn-packed weights (torch 2.13: "mkldnn tensors unpickleable"): a step whose every linear calls ``bf16gemv``
leaves its weights as graph inputs, so one cached graph serves every model of its shapes (seconds to build after the
first); the build is ``compile_s``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import types
from dataclasses import dataclass

import torch

from runtime.errors import UserError
from runtime.hardware import probe
from runtime.packed_linear import gemv_only, prepare
from runtime.transformer import ATTENTION, CacheState, Transformer

# quantspec's modes beyond inductor's own: (inductor's mode, config on top). The C++ wrapper calls a step's kernels
# from C++, not Python: on the default model bf16 2.06x its eager step vs 1.90x, int8 2.58x vs 2.22x; but it builds
# no per-block regions, so its steps build unrolled: 80-100 s more for a cold step, 8-15 s more for each further
# model (bench/results/compile_options-product-cpp-wrapper*.json)
WRAPPED_MODES = {"max-autotune-cpp-wrapper": ("max-autotune-no-cudagraphs", {"cpp_wrapper": True})}
MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", *WRAPPED_MODES)  # reduce-overhead: CUDA graphs
# the faster on the default model (bench/results/decode_compiled.*.json), at about 2.5x default's compile time
DEFAULT_MODE = "max-autotune-no-cudagraphs"
CUDA_DEFAULT_MODE = "reduce-overhead"  # gpt-fast's: a batch-1 step is a few hundred kernel launches, one graph here
SETTINGS = ("auto", "eager", *MODES)
COMPILE_ENV = "QUANTSPEC_COMPILE"  # what ``auto`` means on this machine, e.g. eager for a quick test run
# max-autotune on CPU chooses among inductor's C++ GEMM templates only: faster than with ATen / oneDNN candidates
# beside them, and its multi-token steps' rows bitwise the one-token step's, where those candidates made verification
# rows differ (bench/results/compile_options.*.json); inductor's linear lowerings add ATen's kernel where no template
# fits, and a build that fails anyway runs the eager step, labelled
CPU_GEMM_BACKENDS = "CPP"
SPAN_BLOCK = 256  # a request's cache span is its positions rounded up to this: few graphs, little attention wasted


def cache_span(positions: int, max_len: int) -> int:
    """Keys the compiled steps of a request of ``positions`` positions read: ``positions`` rounded up to
    ``SPAN_BLOCK``, at most the cache's ``max_len``."""
    return min(-(-positions // SPAN_BLOCK) * SPAN_BLOCK, max_len)


def longest_per_span(items: list, positions, max_len: int) -> dict:
    """{span: the item of most ``positions(item)`` among those whose requests read that span}, spans ascending:
    one warm-up run of each builds the steps of every span ``items`` reach."""
    longest = {}
    for item in sorted(items, key=positions):
        longest[cache_span(positions(item), max_len)] = item
    return longest


@dataclass(frozen=True)
class CompileChoice:
    """What a ``--compile`` setting resolved to: an inductor ``mode`` (None: the eager step) and why."""

    setting: str
    mode: str | None
    why: str = ""

    @property
    def label(self) -> str:
        """As tables and records say it: ``compiled (MODE)``, ``eager`` or ``eager (fallback: reason)``."""
        if self.mode:
            return f"compiled ({self.mode})"
        return f"eager ({self.why})" if self.why else "eager"


def compiler_missing(device: str = "cpu") -> str | None:
    """Why inductor cannot build kernels for ``device`` here, or None."""
    if str(device).startswith("cuda"):
        from torch.utils._triton import has_triton
        return None if has_triton() else "no triton for inductor's GPU kernels"
    cxx = os.environ.get("CXX") or "g++"
    return None if shutil.which(cxx) or shutil.which("clang++") else f"no C++ compiler ({cxx}) for inductor"


def resolve_compile(setting: str = "auto", device: str = "cpu") -> CompileChoice:
    """``--compile`` as run here: ``auto`` is ``$QUANTSPEC_COMPILE`` when set, else ``DEFAULT_MODE`` (on a GPU
    ``CUDA_DEFAULT_MODE``); a mode that cannot build here runs eager, labelled with the reason."""
    if setting not in SETTINGS:
        raise UserError(f"--compile {setting!r} is not a setting: use one of {', '.join(SETTINGS)}")
    asked = setting
    if setting == "auto":
        on_gpu = str(device).startswith("cuda")
        setting = os.environ.get(COMPILE_ENV, "").strip() or (CUDA_DEFAULT_MODE if on_gpu else DEFAULT_MODE)
        if setting not in SETTINGS or setting == "auto":
            raise UserError(f"{COMPILE_ENV}={setting!r} is not a setting: use one of {', '.join(SETTINGS[1:])} "
                            "(or unset it)")
    if setting == "eager":
        return CompileChoice(asked, None, f"{COMPILE_ENV}=eager" if asked == "auto" else "")
    missing = compiler_missing(device)
    return CompileChoice(asked, None, f"fallback: {missing}") if missing else CompileChoice(asked, setting)


def mode_options(mode: str) -> dict:
    """Inductor's config for a mode in ``MODES``."""
    base, extra = WRAPPED_MODES.get(mode, (mode, {}))
    return {**torch._inductor.list_mode_options(base), **extra}


def gemm_backends(mode: str | None, device: str = "cpu") -> str | None:
    """The GEMM candidates a step compiled in ``mode`` chooses among on ``device`` (None: inductor's default, or no
    choice made: no max-autotune, or eager)."""
    if mode and mode_options(mode).get("max_autotune") and device == "cpu":
        return CPU_GEMM_BACKENDS
    return None


@contextlib.contextmanager
def quiet_autotune():
    """Without inductor's "AUTOTUNE ..." lines (a module flag of torch._inductor.select_algorithm, no config)."""
    from torch._inductor import select_algorithm

    before, select_algorithm.PRINT_AUTOTUNE = select_algorithm.PRINT_AUTOTUNE, False
    try:
        yield
    finally:
        select_algorithm.PRINT_AUTOTUNE = before


def reduce_attention(q, k, v, mask):
    """Attention of a few queries over a step's span as fp32 multiply-reduce over head dim and keys, which
    inductor fuses into a loop nest per head group: on CPU several times faster than SDPA's flash kernel over a
    preallocated cache (bench/results/quant_decode_compiled.*.json), since a compiled step reads its whole span.
    Only for compiled steps: eager, it would materialise a [queries, keys, head_dim] product."""
    bsz, n_heads, seqlen, head_dim = q.shape
    n_kv, group = k.shape[1], n_heads // k.shape[1]
    q = q.reshape(bsz, n_kv, group * seqlen, 1, head_dim).float()
    scores = (q * k[:, :, None].float()).sum(-1) * head_dim ** -0.5  # [batch, kv heads, group * len, keys]
    if mask is not None:  # [len, keys] or [batch, 1, len, keys]: insert the group axis
        scores = scores.view(bsz, n_kv, group, seqlen, -1).masked_fill(~mask[..., None, :, :], float("-inf"))
    probs = torch.softmax(scores.view(bsz, n_kv, group * seqlen, -1), -1)
    out = (probs[..., None] * v[:, :, None].float()).sum(-2)
    return out.to(v.dtype).view(bsz, n_heads, seqlen, head_dim)


def step_attention(model: Transformer) -> str:
    """The name of the attention a compiled step of ``model`` runs. SDPA on CPU: the batch-invariant ``eager``
    attention in bf16 where the CPU multiplies bf16 natively (its step ran 1.14x reduce's over 256 positions and 1.24x
    over 1024, bench/results/step_attention.*.json), else ``reduce`` (``reduce_attention``: fp32, or bf16 emulated,
    where that was not measured); ``reduce`` also for ``eager`` in bf16 where bf16 matmul is emulated (its rows
    may depend on the batch there: ``transformer.emulated_bf16_attention``). Otherwise the model's own ("eager" keeps its construction; on
    a GPU SDPA's kernels are the fast ones)."""
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu":
        return model.attn_implementation
    bf16 = weight.dtype == torch.bfloat16
    native_bf16 = bf16 and probe().bf16_native
    if model.attn_implementation == "sdpa" or (bf16 and not native_bf16):
        return "eager" if native_bf16 else "reduce"  # eager's bf16 matmuls where emulated: rows batch-variant
    return model.attn_implementation


def attention_fn(name: str):
    """A step's attention function by name: ``reduce_attention``, or one in ``runtime.transformer.ATTENTION``."""
    return reduce_attention if name == "reduce" else ATTENTION.get(name)


@torch.compiler.nested_compile_region
def per_block(layer, x, cos, sin, input_pos, mask, length, attention):
    """One transformer block as a nested compile region: inductor builds it once and calls it for every layer
    (hierarchical compilation), so a step builds in a third to a fifth of its unrolled graph's time, at the same
    speed (bench/results/compile_options*.json). ``attention`` by name lets dynamo trace the block once and stamp
    it out for the other layers (torch's subgraph reuse, which needs every input a tensor, a constant or a
    module); by function, dynamo traces every layer. Eager, a plain call."""
    return layer(x, cos, sin, input_pos, mask, length, attention_fn(attention) if isinstance(attention, str)
                 else attention)


def static_step(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, span: int, name: str,
                block=per_block, traced_once: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [1, n, vocab], final-norm hidden states [1, n, dim]) for ``tokens`` [1, n] at ``input_pos`` [n],
    reading the first ``span`` cache positions (masked, causal within the n tokens) with the attention ``name``
    (``step_attention``'s, chosen before tracing: it asks the hardware probe); each layer through ``block`` (None:
    one unrolled graph). ``traced_once``: the block gets its attention by name, so dynamo traces one block for all
    (False: by function, every block traced: what frozen weights need, which are graph attributes that torch 2.13's
    subgraph reuse cannot map back, "Freevar has no source")."""
    mask = torch.arange(span, device=tokens.device)[None, :] <= input_pos[:, None]
    attention = name if block and traced_once else attention_fn(name)
    return model.run(tokens, input_pos, mask, span, attend=attention, block=block)


def step_guards(entries, state: CacheState) -> list[bool]:
    """Which of dynamo's guards a compiled step checks on every call: those on its tensors that are not parameters
    (tokens, positions, KV caches: dtype, shape, strides), as ``torch.compiler.keep_tensor_guards_unsafe``, and the
    identity guards a frozen step puts on the cache ``state`` it was traced on in place of those (without them a
    frozen step ran its stale graph on caches set up anew). A step is built for one model as it is
    (``CompiledStep``), so the guards on its modules, parameters and constants only cost time: checking them took
    8-15% of a profiled step before this filter (docs/methodology.md)."""
    ids = {id(t) for t in state.tensors()}
    return [(entry.guard_type == "TENSOR_MATCH" and not isinstance(entry.value, torch.nn.Parameter))
            or (entry.guard_type == "ID_MATCH" and id(entry.value) in ids) for entry in entries]


class CompiledStep:
    """``step(tokens, input_pos, span)``: the model's forward of a fixed number of tokens (one step per token count:
    ``dynamic=False``, so another count would be another graph) over the first ``span`` cache positions (one graph
    per span, built on its first call), returning (logits, hidden) like ``model(..., return_hidden=True)``, compiled
    on the first call from the weights as they are then (frozen into the graph, or the packs ``prepare`` made: build
    a new step after editing them). A model whose step does not compile to one graph (e.g. a quantized KV cache,
    which slices at the position's value) runs its eager forward instead, and ``fallback`` says why (printed
    once)."""

    def __init__(self, model: Transformer, mode: str = DEFAULT_MODE):
        if mode not in MODES:
            raise ValueError(f"unknown compile mode {mode!r}: use one of {', '.join(MODES)}")
        self.model, self.mode = model, mode
        self.attention = step_attention(model)
        self.fallback: str | None = None
        self.compile_s: float | None = None  # each span's first call: tracing, lowering and building (one-time)
        # a config patch around each call: torch.compile(options=...) does not reach freezing (seen in the output code)
        # max-autotune's per-GEMM timing tables go to stderr: the step's label and compile_s are what is reported
        # emulate_precision_casts: a fused bf16 intermediate is rounded where eager rounds it, so whether inductor
        # fuses it (which differs between a one-token and a K+1-token graph) does not change a row's result
        self._config = {**mode_options(mode), "max_autotune_report_choices_stats": False,
                        "emulate_precision_casts": True}
        # weights frozen into the graph where inductor runs a linear itself (it prepacks them) and around quantized
        # ops (int4gemv / int8gemv steps ran 1.09-1.18x faster frozen, bench/results/compile_options-*-w*.json); left
        # as graph inputs where every linear calls bf16gemv: then one cached graph serves every model of the same
        # shapes (bench/results/compile_options.*.json). None: decided on the first call (``gemv_only``)
        self.freezing: bool | None = None
        self.regions: bool | None = None  # built as per-block regions (True) or one unrolled graph (False)
        backends = gemm_backends(mode, model.embed_tokens.weight.device.type)
        if backends:
            self._config["max_autotune_gemm_backends"] = backends
        self._compiled: dict = {}  # span -> ``_compile()``'s function
        # CUDA graphs replay into the same output buffers: a caller holding one step's logits past the next step's
        # (the verification probe does) needs its own copy
        self._copy_out = bool(self._config.get("triton.cudagraphs"))

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor, span: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``span``: the cache positions read (None: the whole cache); every token's position must be below it."""
        if self.fallback is None:
            span = span or self.model.max_len
            start, new = time.perf_counter(), span not in self._compiled
            if not self._compiled:
                prepare(self.model)  # the weights' packs, which the graph reads (bf16gemv's layout)
                self.freezing = not gemv_only(self.model) if self.freezing is None else self.freezing
                self._config["freezing"] = self.freezing
            if new:
                self._compiled[span] = self._compile()
            try:
                with torch._inductor.config.patch(self._config), quiet_autotune():
                    out = self._build(tokens, input_pos, span)
                return tuple(t.clone() for t in out) if self._copy_out else out
            # a graph break or a failed compile: raised before anything ran (torch._dynamo loads on first use)
            except torch._dynamo.exc.TorchDynamoException as err:
                self.fallback = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"[:200]
                print(f"compiled decode step: does not compile to one graph, running eager ({self.fallback})")
            finally:
                if new:
                    self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - start
        return self.model(tokens, input_pos, return_hidden=True)

    @property
    def spans(self) -> list[int]:
        """The spans built so far."""
        return sorted(self._compiled)

    def _compile(self):
        """``static_step`` to compile on its first call. A copy of its code object per step: dynamo caches graphs per
        code object, so the steps of other decoders (each guarded on its own cache tensors) would pile up there and,
        past dynamo's recompile limit, fall back to eager; this cache (and its frozen weights) goes when the step
        does. Its guards are ``step_guards``' on the caches installed when a graph is traced."""
        own = types.FunctionType(static_step.__code__.replace(), static_step.__globals__, "static_step",
                                 static_step.__defaults__)
        model = self.model  # not self: the step would hold itself through its graphs' options
        return torch.compile(own, fullgraph=True, dynamic=False, options={
            "guard_filter_fn": lambda entries: step_guards(entries, model.cache_state())})

    def _build(self, tokens: torch.Tensor, input_pos: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled step's outputs, per-block regions tried first. Some kernels do not build or run inside a
        region, where the weights are the region's inputs, not frozen constants (in max-autotune, fp32's and
        int8pack's linears have no GEMM template left to choose): such a step
        builds as one unrolled graph (``regions`` says which ran; the retry rewrites the same cache positions)."""
        if self.regions is not False:
            try:
                out = self._compiled[span](self.model, tokens, input_pos, span, self.attention, per_block,
                                           not self.freezing)
                self.regions = True
                return out
            except (torch._dynamo.exc.TorchDynamoException, RuntimeError):
                if self.regions:  # built and ran before: not the region's build
                    raise
                self.regions = False
                self._compiled[span] = self._compile()  # a graph built before its first run failed: no guard tells
                # them apart
        return self._compiled[span](self.model, tokens, input_pos, span, self.attention, None)
