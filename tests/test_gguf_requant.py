"""runtime/gguf_requant.py: the Q8_0 copy of a Q4_1 GGUF keeps its metadata and plain tensors and holds the
Q4_1-dequantized matrices to within Q8_0's rounding (bench/llamacpp.py's 8-bit llama.cpp row)."""
import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from runtime.gguf_requant import requantize_gguf


def tiny_q4_1_gguf(path):
    """One Q4_1 matrix and one F32 norm, with the metadata keys the copy must carry; returns the matrix as
    llama.cpp reads it (dequantized) and the norm."""
    rng = np.random.default_rng(0)
    q4 = gguf.quants.quantize(rng.normal(size=(8, 128)).astype(np.float32), Q.Q4_1)
    norm = rng.normal(size=128).astype(np.float32)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(1)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    w.add_token_list(["<a>", "<b>"])
    w.add_tensor("blk.0.ffn_up.weight", q4, raw_dtype=Q.Q4_1)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.quants.dequantize(q4, Q.Q4_1), norm


def tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def max_error_over_block_step(path, name, want):
    """Worst |copy - want| per 32-wide block, over that block's Q8_0 step (amax/127)."""
    t = tensors(path)[name]
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
    blocks = want.reshape(-1, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    return float((np.abs(got.reshape(-1, 32) - blocks) / step).max())


def test_q8_0_copy_keeps_metadata_and_plain_tensors_and_rounds_to_half_a_step(tmp_path):
    want, norm = tiny_q4_1_gguf(tmp_path / "m.Q4_1.gguf")
    out = requantize_gguf(tmp_path / "m.Q4_1.gguf", tmp_path / "m.Q8_0.gguf")
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<a>", "<b>"]
    assert reader.fields["llama.block_count"].contents() == 1
    got = tensors(out)
    assert got["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0 and got["blk.0.attn_norm.weight"].tensor_type == Q.F32
    assert np.array_equal(got["blk.0.attn_norm.weight"].data, norm)
    # half a step, plus the fp16 rounding of the stored scale times up to 127 steps (2**-11 * 127 ~ 0.06)
    assert max_error_over_block_step(out, "blk.0.ffn_up.weight", want) <= 0.57
    assert not list(tmp_path.glob("*.part"))


def test_the_rounding_check_catches_a_4_bit_copy(tmp_path):
    """Negative control: the same check on a Q4_0 copy (what a converter that kept 4 bits would write) fails."""
    want, _ = tiny_q4_1_gguf(tmp_path / "m.Q4_1.gguf")
    out = requantize_gguf(tmp_path / "m.Q4_1.gguf", tmp_path / "m.Q4_0.gguf", Q.Q4_0)
    assert tensors(out)["blk.0.ffn_up.weight"].tensor_type == Q.Q4_0
    assert max_error_over_block_step(out, "blk.0.ffn_up.weight", want) > 2
