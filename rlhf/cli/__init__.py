"""The command-line front: what ``python -m rlhf`` does before Hydra (compose, ranks) and once
it has composed the config (run), how it refuses (refuse), --help, and the user's other commands
(chat, compare, evaluate)."""
