#!/usr/bin/env python3
"""Writes crates/engine/tests/data/quant_golden.json: GGUF quantized blocks and the
f32 values the `gguf` Python package (llama.cpp's gguf-py) dequantizes them to.

An independent reference for pdserve's own dequantizers (crates/engine/src/kernels/blocks.rs,
checked by its `matches_gguf_py_golden_values` test). Blocks are seeded random bytes with
their f16 scale fields (d, dmin, m) replaced by finite values in ±0.05, plus one block
per type whose other bytes are all 0xFF (every high bit and the largest codes).

Usage: target/test-venv/bin/python scripts/quant_golden.py   (needs `pip install gguf numpy`)
"""
import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/engine/tests/data/quant_golden.json"

# type: (bytes per block, byte offsets of its f16 scale fields)
LAYOUTS = {
    T.Q4_0: (18, [0]),
    T.Q4_1: (20, [0, 2]),
    T.Q5_0: (22, [0]),
    T.Q5_1: (24, [0, 2]),
    T.Q8_0: (34, [0]),
    T.Q2_K: (84, [80, 82]),
    T.Q3_K: (110, [108]),
    T.Q4_K: (144, [0, 2]),
    T.Q5_K: (176, [0, 2]),
    T.Q6_K: (210, [208]),
    T.IQ4_NL: (18, [0]),
    T.IQ4_XS: (136, [0]),
}
RANDOM_BLOCKS = 3


def blocks_for(qtype, rng):
    size, fields = LAYOUTS[qtype]
    raw = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(RANDOM_BLOCKS)]
    raw.append(np.full(size, 0xFF, dtype=np.uint8))
    for block in raw:
        for at in fields:
            scale = np.float16(rng.uniform(-0.05, 0.05))
            block[at:at + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return raw


def main():
    rng = np.random.default_rng(20240611)
    types = []
    for qtype, (size, _) in LAYOUTS.items():
        blocks = []
        for block in blocks_for(qtype, rng):
            values = dequantize(block, qtype).astype("<f4").reshape(-1)
            assert np.all(np.isfinite(values)), qtype.name
            blocks.append({"raw": block.tobytes().hex(), "values_f32le": values.tobytes().hex()})
        types.append({"type": qtype.name, "ggml_id": int(qtype), "block_bytes": size, "blocks": blocks})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    header = ("gguf-py dequantization of seeded random blocks; values_f32le are little-endian f32. "
              "Regenerate with scripts/quant_golden.py.")
    OUT.write_text(json.dumps({"about": header, "types": types}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
