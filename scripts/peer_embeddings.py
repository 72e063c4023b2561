#!/usr/bin/env python3
"""llama.cpp's pooled embeddings of a token sequence: the oracle pdserve's embeddings
are compared with (crates/engine/tests/embeddings.rs).

Loads the peer's libllama as scripts/peer_logits.py does, decodes the tokens in one
batch with embeddings on, once with mean pooling and once with last-token pooling,
and writes both vectors (`n_embd` little-endian f32 each, mean first), as llama.cpp
returns them: the final norm's output pooled, not normalised.

Usage: peer_embeddings.py PEER_DIR MODEL.gguf OUT.f32 TOKEN [TOKEN ...]
"""
import ctypes
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from peer_logits import load  # noqa: E402


def pooled(ll, model, tokens, pooling):
    cp = ll.llama_context_default_params()
    cp.n_ctx = 0
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.embeddings = True
    cp.pooling_type = pooling
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("peer_embeddings: llama.cpp could not make a context")
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
        sys.exit("peer_embeddings: llama_decode failed")
    width = ll.llama_model_n_embd(model)
    row = ll.llama_get_embeddings_seq(ctx, 0)
    if not row:
        sys.exit("peer_embeddings: no pooled embedding")
    out = bytes((ctypes.c_float * width).from_address(ctypes.addressof(row.contents)))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    return out


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    peer, model_path, out = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokens = [int(t) for t in sys.argv[4:]]
    ll, model = load(peer, model_path, "peer_embeddings")
    with open(out, "wb") as f:
        for pooling in (ll.LLAMA_POOLING_TYPE_MEAN, ll.LLAMA_POOLING_TYPE_LAST):
            f.write(pooled(ll, model, tokens, pooling))
    ll.llama_model_free(model)


if __name__ == "__main__":
    main()
