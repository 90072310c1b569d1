"""A compiled one-token decode step, in the manner of gpt-fast.

The step takes one token and its position as a tensor and attends over the whole preallocated KV cache, with a
mask hiding positions not yet written, so its shapes never change and one ``torch.compile`` graph serves every
step (inductor's C++ backend on CPU, weights frozen into the graph and prepacked by inductor). Prefill and
multi-token calls stay eager, and the eager path stays the reference (``Decoder(compile_mode=None)``).
"""
from __future__ import annotations

import types

import torch
from torch._dynamo.exc import TorchDynamoException

from runtime.transformer import Transformer

MODES = ("default", "max-autotune-no-cudagraphs")
# the faster on the default model (bench/results/decode_compiled.*.json), at about 2.5x default's compile time
DEFAULT_MODE = "max-autotune-no-cudagraphs"


def static_step(model: Transformer, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """Logits [1, 1, vocab] for ``token`` [1, 1] at ``input_pos`` [1], reading every cache position (masked)."""
    mask = torch.arange(model.max_len, device=token.device)[None, :] <= input_pos[:, None]
    return model.run(token, input_pos, mask, model.max_len)[0]


class CompiledStep:
    """``step(token, input_pos)``: the model's one-token forward, compiled on the first call with the weights
    frozen into the graph (build a new step after editing them). A model whose step does not compile to one
    graph (e.g. a quantized KV cache, which slices at the position's value) runs its eager forward instead, and
    ``fallback`` says why (printed once)."""

    def __init__(self, model: Transformer, mode: str = DEFAULT_MODE):
        if mode not in MODES:
            raise ValueError(f"unknown compile mode {mode!r}: use one of {', '.join(MODES)}")
        self.model, self.mode = model, mode
        self.fallback: str | None = None
        # a config patch around each call: torch.compile(options=...) does not reach freezing (seen in the output code)
        self._config = {**torch._inductor.list_mode_options(mode), "freezing": True}
        # a copy of static_step's code object per step: dynamo caches graphs per code object, so the steps of other
        # decoders (each guarded on its own cache tensors) would pile up there and, past dynamo's recompile limit,
        # fall back to eager; this cache (and its frozen weights) goes when the step does
        own = types.FunctionType(static_step.__code__.replace(), static_step.__globals__, "static_step")
        self._compiled = torch.compile(own, fullgraph=True, dynamic=False)

    def __call__(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        if self.fallback is None:
            try:
                with torch._inductor.config.patch(self._config):
                    return self._compiled(self.model, token, input_pos)
            except TorchDynamoException as err:  # a graph break or a failed compile: raised before anything ran
                self.fallback = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"[:200]
                print(f"compiled decode step: does not compile to one graph, running eager ({self.fallback})")
        return self.model(token, input_pos)
