"""The plan's geometry, each rule defined once and free of torch: how a tensor-parallel group
splits a part's tensors and a micro-batch's tokens (`shards`), which tensors a part holds with their full shapes and split
dims (`tensors`), the 1F1B order of a pipeline stage (`pipeline`), and the token chunks the last
stage's loss is computed over (`loss`).

The plan, the migration planner, the gradient groups, the checkpoint layout, the torch model and
the simulator all ask these modules; none of them restates a split, a shape or an order.
"""
from .loss import loss_backward_bytes, loss_chunk_tokens
from .pipeline import one_f_one_b
from .shards import (WHOLE, Cuts, Span, finest_partition, holder_at, most_rows, rows_of, sequence_rows, shard_map,
                     shard_of, shard_rows)
from .tensors import (EMBEDDING, HEAD, TIED, Part, TensorSpec, decayed, hf_name, model_parts, part_of, part_tensors,
                      split_dim, tensor_spec, tp_divisibility_error)

__all__ = ["loss_backward_bytes", "loss_chunk_tokens", "one_f_one_b", "WHOLE", "Cuts", "Span", "finest_partition",
           "holder_at", "most_rows", "rows_of", "sequence_rows", "shard_map", "shard_of", "shard_rows", "EMBEDDING", "HEAD", "TIED", "Part", "TensorSpec", "decayed", "hf_name", "model_parts",
           "part_of", "part_tensors", "split_dim", "tensor_spec", "tp_divisibility_error"]
