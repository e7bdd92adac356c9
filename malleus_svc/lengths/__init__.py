"""Sequence-length-aware planning (after the Hydraulis paper): balance time, not tokens.

* `cost`: `LengthCost`, per-layer micro-batch time a·Σl² + b·Σl + d·n + c per TP degree, stage
  and 1F1B pipeline times, least-squares `fit`; `max_tokens_per_stage`, the memory limit per stage.
* `dispatch`: stage 1, sequences of a global batch to pipelines (greedy + exact MILP on HiGHS).
* `packing`: stage 2, one pipeline's sequences into micro-batches (LPT + per-V MILP).
* `stats`: `LengthHistogram` (streaming, log buckets, mergeable) and `DriftDetector`.
* `expected`: `expected_micro_batch`, the planner's per-micro-batch time, communication and
  memory under an observed length distribution (`LengthProfile.apply`, `planner.build.build_problem(lengths=)`).

The sweep that fits `LengthCost` on real blocks is the runtime's (`runtime.length_sweep`).

The MILPs import Pyomo lazily: the rest is numpy only.
"""
from .cost import (Coeffs, LengthCost, LengthError, PipelineSpec, StageSpec, analytic_bytes_per_token_per_layer,
                   max_tokens_per_stage)
from .dispatch import Dispatch, dispatch, greedy_dispatch, predicted_time
from .expected import LengthProfile, expected_micro_batch
from .packing import Packing, first_fit_decreasing, pack, v_bounds
from .stats import DriftDetector, DriftReport, LengthHistogram


__all__ = ["Coeffs", "Dispatch", "DriftDetector", "DriftReport", "LengthCost", "LengthError", "LengthHistogram",
           "LengthProfile", "Packing", "PipelineSpec", "StageSpec", "analytic_bytes_per_token_per_layer", "dispatch",
           "expected_micro_batch", "first_fit_decreasing", "greedy_dispatch", "max_tokens_per_stage", "pack",
           "predicted_time", "v_bounds"]
