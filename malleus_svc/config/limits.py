"""Upper limits on input files and the numbers in them.

Each is far above any real cluster, model or file, and far below what would exhaust the machine
reading it (a plan over 10**18 devices builds sets of that size). Error messages name the limit.
"""
from __future__ import annotations

MAX_FILE_BYTES = 16 * 1024 * 1024   # a JSON file: plan, checkpoint manifest (one entry a layer), scenario
MAX_YAML_BYTES = 1024 * 1024        # a YAML file (hand-written; parsing costs ~20x JSON's per byte)
MAX_DEPTH = 64                      # nesting of lists/mappings in a file (real files: < 10)
MAX_VALUES = 500_000                # values in a JSON file (a plan over 65,536 devices: ~330,000)
MAX_YAML_VALUES = 100_000           # values in a YAML file (hand-written; ~0.5 s to read this many)
MAX_INT_DIGITS = 400                # an integer literal's digits (a float holds < 10**309)

MAX_NAME = 64                       # scenario/job name: [A-Za-z0-9._-], 1..64 characters
MAX_DEVICES = 65_536                # nodes x gpus_per_node
MAX_LAYERS = 10_000                 # transformer blocks
MAX_MODEL_DIM = 10_000_000          # hidden, heads, ffn, vocab, seq_len
MAX_GLOBAL_BATCH = 10_000_000       # samples per iteration (and micro-batch size, counts)
MAX_SAMPLES = 100_000_000          # samples in a dataset (the synthetic one keeps a length per sample)
MAX_RATE = 1e6                      # a straggling rate, emulated slow-down or tp_alpha
MAX_SECONDS = 1e9                   # any time in seconds
MAX_MEMORY_MB = 1e9                 # any memory in MB
MAX_NUMBER = float(2 ** 53)         # any other number (the largest integer a float holds exactly)
MAX_TOKEN_FILES = 10_000            # files blended in one `tokens` corpus
MAX_WEIGHT = 1_000.0                # a file's repeats per epoch in a blend
MAX_PORT = 65_535                   # a TCP port (0: any free one)
