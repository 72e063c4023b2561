#!/usr/bin/env python3
"""llama.cpp's logits for a token sequence: the oracle the architecture tests compare
pdserve with.

Loads the peer's libllama (scripts/build-peer.sh) through llama-cpp-python's own ctypes
bindings, taken from the sdist that script unpacked, so nothing is compiled twice.
Decodes the tokens one batch at a time with every position's logits requested, on the
CPU, flash attention off, the context as long as the model's own, and writes them as little-endian f32, `len(tokens) × vocab`.

Usage: peer_logits.py PEER_DIR MODEL.gguf OUT.f32 TOKEN [TOKEN ...]
  PEER_DIR is the directory build-peer.sh works in (it holds src/ and build/bin/).
"""
import ctypes
import pathlib
import sys
import types


def bindings(peer):
    """Imports `llama_cpp.llama_cpp` without the package's `__init__`, which would pull
    in the high-level API and its extra dependencies."""
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(peer / "src" / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as ll  # noqa: E402

    return ll


def load(peer, model_path, who):
    """The bindings and the model at `model_path`, on the CPU, llama.cpp's log quiet
    unless PEER_VERBOSE is set; `who` names the caller in errors."""
    import os

    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(peer / "build" / "bin"))
    ll = bindings(peer)
    # Kept on the module: llama.cpp calls it for as long as the process lives.
    load.quiet = ll.llama_log_callback(lambda level, text, data: None)
    if not os.environ.get("PEER_VERBOSE"):
        ll.llama_log_set(load.quiet, ctypes.c_void_p())
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        sys.exit(f"{who}: llama.cpp could not load {model_path}")
    return ll, model


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    peer, model_path, out = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokens = [int(t) for t in sys.argv[4:]]
    ll, model = load(peer, model_path, "peer_logits")
    cp = ll.llama_context_default_params()
    # The model's own context length, which decides Phi-3's long or short RoPE factors.
    cp.n_ctx = 0
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("peer_logits: llama.cpp could not make a context")
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    n = len(tokens)
    batch = ll.llama_batch_init(n, 0, 1)
    for i, t in enumerate(tokens):
        batch.token[i] = t
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1
    batch.n_tokens = n
    if ll.llama_decode(ctx, batch) != 0:
        sys.exit("peer_logits: llama_decode failed")
    with open(out, "wb") as f:
        for i in range(n):
            row = ll.llama_get_logits_ith(ctx, i)
            f.write(bytes((ctypes.c_float * vocab).from_address(ctypes.addressof(row.contents))))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


if __name__ == "__main__":
    main()
