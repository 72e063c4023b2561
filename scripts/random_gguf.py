#!/usr/bin/env python3
"""Writes a GGUF model with random weights in the tensor layout llama.cpp expects, for
an architecture and a shape: the oracle files of the architecture tests (small shapes,
F16, quantized afterwards by llama.cpp's own llama-quantize) and the real-size
benchmark files (Llama-3.2-1B and Llama-3.1-8B shapes).

A dense model's speed does not depend on its weights' values, and two engines reading
the same file must agree on its logits whatever the values are, so random weights
serve both purposes.

The tokenizer is copied from a donor GGUF (any real model file); when the shape's
vocabulary is larger than the donor's, the extra ids are unused tokens named
`<|pad_N|>`, so the embedding and output matrices still have the real shape.

Usage:
  random_gguf.py ARCH SHAPE OUT.gguf --donor DONOR.gguf [--seed N] [--vocab N]
    ARCH  llama | qwen2 | qwen3 | qwen3moe | phi3
    SHAPE tiny | 1b | 8b | 30b-a3b

Needs numpy and gguf-py (llama.cpp's, which scripts/make_oracle.sh puts on PYTHONPATH).
"""
import argparse
import math
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

# hidden, layers, heads, kv heads, head dim, ffn, vocab (None: the donor's), tied head,
# and for MoE: experts, experts used, expert ffn.
SHAPES = {
    # Small enough for a test, every row a whole number of 256-value K blocks.
    "tiny": dict(hidden=256, layers=3, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=None, tied=False,
                 experts=8, used=2, expert_ffn=256),
    # Llama 3.2 1B.
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True),
    # Llama 3.1 8B.
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, tied=False),
    # Qwen3 30B-A3B.
    "30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936, tied=False,
                    experts=128, used=8, expert_ffn=768),
}


def llama3_rope_freqs(head_dim, theta, factor=32.0, low=1.0, high=4.0, orig_ctx=8192):
    """The frequency factors Llama 3.1/3.2 files carry as `rope_freqs.weight`, as
    llama.cpp's converter computes them from the `llama3` rope scaling."""
    out = []
    low_wavelen, high_wavelen = orig_ctx / low, orig_ctx / high
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def copy_tokenizer(writer, donor, vocab):
    """Copies every `tokenizer.*` field of the donor, padding the token lists to `vocab`."""
    r = GGUFReader(donor)
    n = len(r.get_field("tokenizer.ggml.tokens").contents())
    if vocab is not None and vocab < n:
        sys.exit(f"random_gguf: the donor has {n} tokens, more than the shape's {vocab}")
    pad = 0 if vocab is None else vocab - n
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if key == "tokenizer.ggml.tokens":
                value = value + [f"<|pad_{i}|>" for i in range(pad)]
            elif key == "tokenizer.ggml.scores":
                value = value + [0.0] * pad
            elif key == "tokenizer.ggml.token_type":
                value = value + [5] * pad  # unused
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
    return n + pad


def tensors(arch, s, vocab):
    """(name, numpy shape, kind) of every tensor, kind one of matrix, norm, bias, freqs."""
    h, hd, f = s["hidden"], s["head_dim"], s["ffn"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    out = [("token_embd.weight", (vocab, h), "embed"), ("output_norm.weight", (h,), "norm")]
    if not s["tied"]:
        out.append(("output.weight", (vocab, h), "matrix"))
    if arch == "llama":
        out.append(("rope_freqs.weight", (hd // 2,), "freqs"))
    for l in range(s["layers"]):
        b = f"blk.{l}."
        out.append((b + "attn_norm.weight", (h,), "norm"))
        if arch == "phi3":
            out.append((b + "attn_qkv.weight", (q + 2 * kv, h), "matrix"))
        else:
            out += [(b + "attn_q.weight", (q, h), "matrix"), (b + "attn_k.weight", (kv, h), "matrix"),
                    (b + "attn_v.weight", (kv, h), "matrix")]
        if arch == "qwen2":
            out += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                    (b + "attn_v.bias", (kv,), "bias")]
        if arch in ("qwen3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
        out.append((b + "attn_output.weight", (h, q), "matrix"))
        out.append((b + "ffn_norm.weight", (h,), "norm"))
        if arch == "qwen3moe":
            e, ef = s["experts"], s["expert_ffn"]
            out += [(b + "ffn_gate_inp.weight", (e, h), "router"),
                    (b + "ffn_gate_exps.weight", (e, ef, h), "matrix"),
                    (b + "ffn_up_exps.weight", (e, ef, h), "matrix"),
                    (b + "ffn_down_exps.weight", (e, h, ef), "matrix")]
        elif arch == "phi3":
            out += [(b + "ffn_up.weight", (2 * f, h), "matrix"), (b + "ffn_down.weight", (h, f), "matrix")]
        else:
            out += [(b + "ffn_gate.weight", (f, h), "matrix"), (b + "ffn_up.weight", (f, h), "matrix"),
                    (b + "ffn_down.weight", (h, f), "matrix")]
    if arch == "phi3":
        out += [("rope_factors_short.weight", (hd // 2,), "freqs"), ("rope_factors_long.weight", (hd // 2,), "freqs")]
    return out


def values(rng, name, shape, kind, s):
    if kind == "freqs":
        if name.startswith("rope_freqs"):
            return llama3_rope_freqs(s["head_dim"], 500000.0)
        # Phi-3.5's short and long factors are smooth ramps above 1.
        top = 1.5 if "short" in name else 40.0
        return np.geomspace(1.0, top, shape[0]).astype(np.float32)
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "bias":
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "embed":
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    # Unit-variance outputs for unit-variance inputs; the router a little sharper, so
    # that each token's top experts are clear.
    gain = 3.0 if kind == "router" else 1.0
    w = rng.standard_normal(shape, dtype=np.float32) * (gain / math.sqrt(shape[-1]))
    return w.astype(np.float32 if kind == "router" else np.float16)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arch", choices=["llama", "qwen2", "qwen3", "qwen3moe", "phi3"])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--donor", required=True, help="a real GGUF whose tokenizer is copied")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vocab", type=int, help="pad the donor's vocabulary to this size")
    a = p.parse_args()
    s = dict(SHAPES[a.shape])
    if a.vocab:
        s["vocab"] = a.vocab
    if a.arch == "qwen3moe" and "experts" not in s:
        sys.exit(f"random_gguf: shape {a.shape} has no experts")
    w = GGUFWriter(a.out, a.arch)
    vocab = copy_tokenizer(w, a.donor, s["vocab"])
    w.add_name(f"random {a.arch} {a.shape}")
    w.add_context_length(131072 if a.arch == "phi3" else 4096)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-5 if a.arch in ("llama", "phi3") else 1e-6)
    w.add_rope_freq_base({"llama": 500000.0, "phi3": 10000.0}.get(a.arch, 1000000.0))
    if a.arch == "qwen3moe":
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["used"])
        w.add_expert_feed_forward_length(s["expert_ffn"])
    if a.arch == "phi3":
        # As Phi-3.5-mini: long-context factors beyond 4,096 positions, and the
        # attention factor that goes with them.
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_attn_factors(1.190238)
    w.add_file_type(1)  # mostly F16
    specs = tensors(a.arch, s, vocab)
    rng = np.random.default_rng(a.seed)
    for name, shape, kind in specs:
        dtype = np.float16 if kind in ("matrix", "embed") else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = GGMLQuantizationType.F16 if dtype == np.float16 else GGMLQuantizationType.F32
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in specs:
        if kind == "matrix" and len(shape) == 3:
            # One expert at a time keeps the memory of a 30B shape bounded.
            t = np.concatenate([values(rng, name, (1,) + shape[1:], kind, s) for _ in range(shape[0])])
        else:
            t = values(rng, name, shape, kind, s)
        w.write_tensor_data(t)
    w.close()


if __name__ == "__main__":
    main()
