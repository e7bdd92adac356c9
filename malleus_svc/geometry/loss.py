"""How the last stage's loss is cut: the head and the cross-entropy run over chunks of the micro-
batch's tokens, so that the fp32 logits of one chunk exist at a time, in the forward and again in
the backward (which recomputes them). Backward keeps the logits' gradient of the whole micro-batch
in the compute dtype, so that the head's two weight and input gradients are one large GEMM each
(compute-bound) rather than one per chunk, each rewriting a [vocab, hidden] fp32 accumulator."""
from __future__ import annotations

LOSS_CHUNK_LOGITS = 2**25    # logits in one chunk: 32M (128 MiB in fp32)


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of `vocab`."""
    return max(1, LOSS_CHUNK_LOGITS // vocab)


def loss_backward_bytes(vocab: int, tokens: int, act_bytes: int) -> int:
    """The most bytes the loss holds, in its backward: the logits' gradient of all `tokens` in the
    compute dtype (`act_bytes`), and one chunk's logits and their gradient in the compute dtype and
    its logits, log-softmax and their gradient in fp32."""
    return tokens * vocab * act_bytes + min(tokens, loss_chunk_tokens(vocab)) * vocab * (2 * act_bytes + 12)
