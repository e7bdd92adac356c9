"""How the last stage's loss is cut: the head and the cross-entropy run over chunks of the micro-
batch's tokens, so that the logits of one chunk exist at a time, in the forward and again in the
backward (which recomputes them), never [tokens, vocab] for the whole micro-batch."""
from __future__ import annotations

LOSS_CHUNK_LOGITS = 2**25    # logits in one chunk: 32M (128 MiB in fp32)


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of `vocab`."""
    return max(1, LOSS_CHUNK_LOGITS // vocab)


def loss_chunk_bytes(vocab: int, tokens: int, act_bytes: int) -> int:
    """The most bytes one chunk holds, in its backward: its logits and their gradient in the compute
    dtype (`act_bytes` each), and in fp32 the logits, their log-softmax and its gradient."""
    return min(tokens, loss_chunk_tokens(vocab)) * vocab * (2 * act_bytes + 12)
