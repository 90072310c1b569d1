"""Re-quantize a GGUF file's quantized tensors to another GGML type with the gguf package (metadata copied,
``general.file_type`` updated): e.g. the default model's Q4_1 body as Q8_0 for llama.cpp's 8-bit row."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as Q

# gguf's LlamaFileType for a file whose matrices are all of one type
FILE_TYPES = {Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
              Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}


def requantize_gguf(src: Path, dst: Path, qtype: Q = Q.Q8_0, types: tuple[Q, ...] = (Q.Q4_1,)) -> Path:
    """Write ``dst``: ``src`` with every tensor of a type in ``types`` dequantized and quantized to ``qtype``;
    other tensors and all metadata copied. Written to a temporary name, then renamed (atomic)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    part = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(part, arch=arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = int(FILE_TYPES[qtype]) if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub_type)
    out = []
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind in types:
            data, kind = gguf.quants.quantize(gguf.quants.dequantize(t.data, kind), qtype), qtype
        out.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in out:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(part, dst)
    return dst
