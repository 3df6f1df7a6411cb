"""The multirun tools beside the pipeline, never imported by it: the sweep summary and the
launchers' mechanics (local and SLURM). The user's other commands are rlhf/cli/chat.py and
rlhf/cli/compare.py; the benchmarks live outside the package (benchmarks/, ``python -m benchmarks``)."""
