"""One prompt answered by the native runtime, with what its speed line names (``quantspec generate``)."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.generate import Decoder, GenerationResult, encode_prompt
from runtime.hardware import hardware_line
from runtime.loading import DEFAULT_DTYPE, LoadedModel, load_model
from runtime.sampling import SamplingConfig
from runtime.threads import ThreadChoice, apply_threads


@dataclass
class Answer:
    result: GenerationResult
    lm: LoadedModel
    attention: str
    step: str  # "eager step", "compiled (MODE) step" or "eager (fallback: why) step" (``Decoder.step_label``)
    threads: ThreadChoice

    def speed_line(self) -> str:
        """The result's speed, the precision, attention, device, decode step, threads, kernels and ISA."""
        return (f"{self.result.summary()} | native {self.lm.precision} on {self.lm.device}, {self.attention} "
                f"attention, {self.step}, {self.threads.line()}, {hardware_line(self.lm.model)}")


def answer(prompt: str, model: str = "default", dtype: str = DEFAULT_DTYPE, max_new_tokens: int = 128,
           sampling: SamplingConfig = SamplingConfig(), threads: int | None = None, chat: bool | None = None,
           attention: str = "sdpa", compile_mode: str | None = None, device: str = "cpu") -> Answer:
    """``prompt`` answered by ``model`` (chat template applied for instruct models unless ``chat=False``), at most
    ``max_new_tokens`` tokens, stopping at the end of turn; ``compile_mode`` decodes through a compiled step."""
    lm = load_model(model, dtype, threads, attention, device)
    choice = apply_threads(lm.model, threads)
    ids = encode_prompt(lm.tokenizer, prompt, chat=chat)
    decoder = Decoder(lm, max_len=len(ids) + max_new_tokens + 1, compile_mode=compile_mode)
    result = decoder.generate(ids, max_new_tokens, sampling)
    step = f"{decoder.step_label} step"
    return Answer(result, lm, attention, step, choice)
