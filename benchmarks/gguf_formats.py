"""Rewrite a GGUF file in another llama.cpp tensor format (Q8_0, F16, F32) from the same weights.

Every tensor is dequantized and re-encoded in GGUF's own layout, so the Q/K rows keep llama.cpp's
interleaved-RoPE permutation as they are (no round trip through the Hugging Face layout, which
``kvrelay.weights.gguf`` un-permutes on reading). 1-D tensors (the norms) stay F32, as llama.cpp's
converter writes them. Metadata, tokenizer included, is copied as it is; only ``general.file_type``
changes.

Usage: python benchmarks/gguf_formats.py SRC.gguf OUT_DIR [--formats Q8_0,F16,F32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

FORMATS = ("Q8_0", "F16", "F32")
# general.file_type of a file whose 2-D tensors are all in that format (llama.cpp's LlamaFileType)
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0"}


def write_gguf_as(src: Path, dst: Path, fmt: str) -> Path:
    """Write ``src``'s weights to ``dst`` with every 2-D tensor in ``fmt``; returns ``dst``."""
    import gguf
    from gguf.quants import dequantize, quantize

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    qtype = gguf.GGMLQuantizationType[fmt]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[fmt]]))
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        target = qtype if arr.ndim >= 2 else gguf.GGMLQuantizationType.F32
        data = quantize(arr, target)
        writer.add_tensor(t.name, data, raw_dtype=target)  # quantized bytes: the writer derives the shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats.split(","):
        dst = write_gguf_as(args.src, args.out_dir / f"{args.src.stem.split('.')[0]}.{fmt}.gguf", fmt)
        print(f"wrote {dst} ({dst.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
