"""quantspec: quantize LLM checkpoints, run speculative decoders, score speed per effective token against quality."""
