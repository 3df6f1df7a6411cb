"""DeepSpeed-Chat's three-step RLHF pipeline as a Hydra-configured experiment framework."""

import os

# Before any rlhf module loads torch (and oneDNN with it). oneDNN's bf16 matmuls on CPU keep a
# primitive and an ideep computation per matmul shape, up to 1024 of each. Unpadded batches bring
# new shapes at every step, so on the dschat bench (bf16, 2 ranks) SFT's peak memory grew over
# the run to 2.1 GB, against 0.74 GB for the padded baseline. With 16 of each it peaked at
# 0.72 GB (64: 0.81 GB) at the same speed: a step rarely meets an earlier step's shapes anyway.
# A user's value wins.
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
for _cache in ONEDNN_CACHES:
    os.environ.setdefault(_cache, "16")
