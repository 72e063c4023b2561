#!/usr/bin/env python3
"""llama.cpp's perplexity on a text, chunked as `pdserve perplexity` and llama.cpp's
`llama-perplexity` chunk it (BOS at the head of every chunk where the model adds one,
the second half of each chunk scored), through the peer's libllama
(scripts/build-peer.sh oracle): f16 KV cache with flash attention off, or with
CACHE_TYPE (f16, q8_0 or q4_0) that type for K and V and flash attention on (llama.cpp
needs it for a quantized V cache; `llama-perplexity -fa on -ctk T -ctv T`).

Usage: peer_perplexity.py PEER_DIR MODEL.gguf TEXT CTX CHUNKS [CACHE_TYPE]
"""
import ctypes
import importlib.util
import math
import os
import pathlib
import sys


def neg_log_likelihood(row, target):
    """-log softmax(row)[target], in float64 (with numpy where it is installed: the
    pure-Python sum over a 50k vocabulary takes minutes per thousand tokens)."""
    try:
        import numpy as np
    except ImportError:
        top = max(row)
        return math.log(sum(math.exp(x - top) for x in row)) + top - row[target]
    x = np.ctypeslib.as_array(row).astype(np.float64)
    top = x.max()
    return float(np.log(np.exp(x - top).sum()) + top - x[target])


def main():
    if len(sys.argv) not in (6, 7):
        sys.exit(__doc__)
    cache = sys.argv[6] if len(sys.argv) == 7 else None
    peer, model_path, text_path = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    n_ctx, chunks = int(sys.argv[4]), int(sys.argv[5])
    here = pathlib.Path(__file__).parent
    spec = importlib.util.spec_from_file_location("peer_logits", here / "peer_logits.py")
    pl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pl)
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(peer / "build" / "bin"))
    ll = pl.bindings(peer)
    quiet = ll.llama_log_callback(lambda level, text, data: None)
    ll.llama_log_set(quiet, ctypes.c_void_p())
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(model_path.encode(), mp)
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    text = pathlib.Path(text_path).read_bytes()
    buf = (ll.llama_token * (len(text) + 1))()
    add_bos = ll.llama_vocab_get_add_bos(vocab)
    n = ll.llama_tokenize(vocab, text, len(text), buf, len(text) + 1, add_bos, False)
    tokens = list(buf[:n])
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if cache is not None:
        ggml = {"f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0, "q4_0": ll.GGML_TYPE_Q4_0}[cache]
        cp.type_k = cp.type_v = ggml
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    nll = []
    for c in range(min(chunks, n // n_ctx)):
        ctx = ll.llama_init_from_model(model, cp)
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        if add_bos:
            chunk[0] = ll.llama_vocab_bos(vocab)
        batch = ll.llama_batch_init(n_ctx, 0, 1)
        for i, t in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = n_ctx
        if ll.llama_decode(ctx, batch) != 0:
            sys.exit("peer_perplexity: llama_decode failed")
        for j in range(n_ctx // 2, n_ctx - 1):
            ptr = ll.llama_get_logits_ith(ctx, j)
            row = (ctypes.c_float * n_vocab).from_address(ctypes.addressof(ptr.contents))
            nll.append(neg_log_likelihood(row, chunk[j + 1]))
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    mean = sum(nll) / len(nll)
    var = max(sum(x * x for x in nll) / len(nll) - mean * mean, 0.0)
    ppl = math.exp(mean)
    kv = f", {cache} KV cache" if cache else ""
    print(f"llama.cpp: {len(nll)} tokens scored{kv}: PPL = {ppl:.4f} +/- {ppl * math.sqrt(var / (len(nll) - 1)):.4f}")


if __name__ == "__main__":
    main()
