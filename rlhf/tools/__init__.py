"""Tools beside the pipeline, never imported by it: the benchmark (``python -m rlhf.bench``),
run comparison and plots (``python -m rlhf.compare``), a chat with an export
(``python -m rlhf.chat``), the sweep summary and the multirun launcher's mechanics."""
