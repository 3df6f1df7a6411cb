"""rlhf's speed and memory benchmarks: developer tools, outside the wheel (pyproject.toml packages
``rlhf*`` only), run from the repository root as ``python -m benchmarks ...`` (see
docs/performance.md). They import rlhf's modules; nothing in rlhf imports them.

- ``python -m benchmarks``: how fast each step runs, rlhf against a padded baseline and TRL
  (steps.py, on workload.py, runs.py, trl_runs.py, flops.py, report.py)
- ``python -m benchmarks rollout``: rollouts on vLLM against the transformers path (rollout.py)
- ``python -m benchmarks reference``: the peak memory of a LoRA policy's reference as a copy and
  as the adapters off (reference.py)
"""
