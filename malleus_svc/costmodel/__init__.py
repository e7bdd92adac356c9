"""Cost model: time and memory of blocks by TP degree, micro-batch and sequence length."""
