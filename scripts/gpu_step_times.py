#!/usr/bin/env python3
"""Times Llama 3.1 forward steps on a CUDA GPU with PyTorch's own kernels, to
calibrate the derived GPU profiles in profiles/ (pdserve has no GPU engine: these
are the steps a GPU server would run, not pdserve's).

A step is what the profile's cost model prices: every layer's four projections
(QKV, output, gate+up, down), its RMS norms and SiLU, and its attention over the
K/V cache, then the LM head for the rows sampled. Each step is captured once as a
CUDA graph (as GPU servers run decode) and replayed; the time is the mean of the
timed replays by CUDA events.

Two shortcuts, named so nobody mistakes them for a server:
- one layer's weights and one layer's K/V cache serve every layer: a layer's
  weights (436 MB for 8B, 856 MB for 70B FP8) are many times the 60 MB L2, so each
  layer still streams them from HBM;
- RoPE is left out (elementwise, well under 1 % of a step).

Writes JSON: the device, the copy bandwidth and matrix-product ceilings, and the
timed points in the profile's format (`type`, `size`, `context`, `seconds`).

    python3 scripts/gpu_step_times.py --out gpu-steps.json
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

MODELS = {
    "llama3.1-8b": dict(layers=32, d=4096, heads=32, kv_heads=8, head=128, ffn=14336, vocab=128256, fp8=False),
    "llama3.1-70b-fp8": dict(layers=80, d=8192, heads=64, kv_heads=8, head=128, ffn=28672, vocab=128256, fp8=True),
}
# (kind, size, context): prefill chunks of `size` tokens after `context` cached
# ones; decode steps of `size` sequences each `context` positions long.
POINTS = {
    "llama3.1-8b": [("prefill", n, 0) for n in (128, 512, 2048, 8192)]
    + [("prefill", 2048, c) for c in (2048, 8192)]
    + [("decode", b, c) for b in (1, 8, 32, 128) for c in (512, 2048, 8192)],
    "llama3.1-70b-fp8": [("prefill", n, 0) for n in (512, 2048, 8192)]
    + [("prefill", 8192, c) for c in (8192, 24576)]
    + [("decode", b, c) for b in (1, 4, 16, 32) for c in (2048, 8192, 32768)],
}
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def events_time(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def ceilings():
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    copy_s = events_time(lambda: y.copy_(x), 10)
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm_s = events_time(lambda: a @ b, 10)
    out = {"copy_bytes_per_s": 2 * (2 << 30) / copy_s, "bf16_flops": 2 * 8192**3 / mm_s}
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device=DEV)
        mm8_s = events_time(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16), 10)
        out["fp8_flops"] = 2 * 8192**3 / mm8_s
    except Exception as e:  # an older torch: the 70B points fail the same way
        out["fp8_error"] = repr(e)
    return out


class Layer:
    """One decoder layer's weights (shared by every layer of the stack)."""

    def __init__(self, m):
        d, h, kv, hd, f = m["d"], m["heads"], m["kv_heads"], m["head"], m["ffn"]
        self.m = m
        shapes = {"qkv": ((h + 2 * kv) * hd, d), "o": (d, h * hd), "gate_up": (2 * f, d), "down": (d, f)}
        self.w = {}
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
            # _scaled_mm wants its second operand column-major: keep W^T's view of W.
            self.w[name] = w.to(torch.float8_e4m3fn).t() if m["fp8"] else w.t()
            del w
        self.one = torch.tensor(1.0, device=DEV)
        self.norm = torch.ones(d, device=DEV, dtype=BF16)

    def linear(self, x, name):
        w = self.w[name]
        if not self.m["fp8"]:
            return x @ w
        return torch._scaled_mm(x.to(torch.float8_e4m3fn), w, self.one, self.one, out_dtype=BF16)


def rms(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w


def chunk_mask(n, ctx):
    """A chunk of n tokens after ctx cached ones sees, in row i, ctx + i + 1
    positions (causal, aligned bottom-right); None where plain causal does. The
    bias object lets the fused kernels run it; a dense mask would not."""
    if ctx == 0:
        return None
    try:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, ctx + n)
    except ImportError:
        rows = torch.arange(n, device=DEV)[:, None] + ctx
        return torch.arange(ctx + n, device=DEV)[None, :] <= rows


def attention_decode(q, k, v, how):
    """q [B,kv,group,hd] over K/V [B,kv,ctx,hd]. PyTorch's fused kernel splits
    work by (sequence, head) only, which leaves most of the GPU idle for a small
    batch at a long context; two batched products (split over the context by
    cuBLAS) are what a split-KV decode kernel achieves there."""
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def attention_prefill(q, k, v, mask):
    """q [1,H,n,hd] over K/V [1,H,ctx+n,hd]."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def step_fn(layer, m, kind, size, ctx, how):
    d, h, kv, hd = m["d"], m["heads"], m["kv_heads"], m["head"]
    group = h // kv
    tokens = size
    pad = (tokens + 15) // 16 * 16 if m["fp8"] else tokens
    x = torch.randn(pad, d, device=DEV, dtype=BF16)
    if kind == "prefill":
        # Query heads sharing a K/V head are expanded: prefill is compute-bound.
        k_cache = torch.randn(1, h, ctx + size, hd, device=DEV, dtype=BF16)
        v_cache = torch.randn_like(k_cache)
    else:
        # GQA decode without expanding: each K/V head's `group` query heads form a
        # query block of `group` rows over that head's cache.
        k_cache = torch.randn(size, kv, ctx, hd, device=DEV, dtype=BF16)
        v_cache = torch.randn_like(k_cache)
    mask = chunk_mask(size, ctx) if kind == "prefill" else None
    lm_head = torch.randn(d, m["vocab"], device=DEV, dtype=BF16) * 0.02
    sampled = 1 if kind == "prefill" else size

    def run():
        y = x
        for _ in range(m["layers"]):
            qkv = layer.linear(rms(y, layer.norm), "qkv")[:tokens]
            q = qkv[:, : h * hd]
            if kind == "prefill":
                q = q.reshape(1, size, h, hd).transpose(1, 2).contiguous()
                a = attention_prefill(q, k_cache, v_cache, mask)
                a = a.transpose(1, 2).reshape(size, h * hd)
            else:
                q = q.reshape(size, kv, group, hd)
                a = attention_decode(q, k_cache, v_cache, how).reshape(size, h * hd)
            if pad > tokens:
                a = F.pad(a, (0, 0, 0, pad - tokens))
            y = y + layer.linear(a, "o")
            gu = layer.linear(rms(y, layer.norm), "gate_up")
            g, u = gu.chunk(2, dim=-1)
            y = y + layer.linear(F.silu(g) * u, "down")
        return rms(y[tokens - sampled : tokens], layer.norm) @ lm_head

    return run


def time_step(layer, m, kind, size, ctx, how=None):
    run = step_fn(layer, m, kind, size, ctx, how)
    run()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    reps = 3 if kind == "prefill" and size >= 2048 else 10
    seconds = events_time(g.replay, reps)
    del g
    torch.cuda.empty_cache()
    return seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    result = {
        "device": p.name,
        "multiprocessors": p.multi_processor_count,
        "memory_bytes": p.total_memory,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "ceilings": ceilings(),
        "models": {},
    }
    print(json.dumps(result["ceilings"]), flush=True)
    save = lambda: open(a.out, "w").write(json.dumps(result, indent=1))
    save()
    for name in a.models.split(","):
        m = MODELS[name]
        layer = Layer(m)
        pts = result["models"].setdefault(name, {"config": m, "points": []})["points"]
        for kind, size, ctx in POINTS[name]:
            t0 = time.time()
            try:
                # The faster decode attention stands for the server's kernel.
                ways = ("sdpa", "bmm") if kind == "decode" else (None,)
                each = {str(w): time_step(layer, m, kind, size, ctx, w) for w in ways}
                s = min(each.values())
                pts.append({"type": kind, "size": size, "context": ctx, "seconds": s, "attention": each})
                print(f"{name} {kind} size={size} ctx={ctx}: {s * 1e3:.3f} ms {each} ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:
                pts.append({"type": kind, "size": size, "context": ctx, "error": repr(e)[:300]})
                print(f"{name} {kind} size={size} ctx={ctx}: FAILED {e!r}"[:400], flush=True)
                torch.cuda.empty_cache()
            save()
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
