"""Text for PPO's PTX loss: language modelling on unsupervised text mixed into the actor's
update (DeepSpeed-Chat's unsup_coef), so RLHF does not erode what pretraining taught."""

from __future__ import annotations

import torch

from rlhf.algos.logits import causal_lm_nll_sum
from rlhf.config import Config
from rlhf.data.collate import right_pad
from rlhf.data.ptx_text import ptx_texts
from rlhf.runtime.dist import rank, world_size
from rlhf.runtime.engine import model_device


class PTXBatches:
    """Unsupervised language modelling text for the PTX loss (a file, or a task's corpus: the
    toy task's statements on the embedded default), cycled in per_device_training_batch_size
    chunks: the n-th batch of rank r starts at row (n x ranks + r) x size, so the ranks read
    disjoint rows, and ``batches`` (the same on every rank) is all a resume needs."""

    def __init__(self, cfg: Config, tokenizer, eot: int):
        texts = ptx_texts(cfg)
        ids = tokenizer(texts, truncation=True, max_length=cfg.data.max_seq_len - 1)["input_ids"]
        self.rows = [[*row, eot] for row in ids]
        self.size = cfg.ppo.update.per_device_batch_size
        self.pad_id = tokenizer.pad_token_id
        self.batches = 0  # batches each rank has read

    def next_rows(self) -> list[list[int]]:
        """This rank's next batch of token id rows."""
        start = (self.batches * world_size() + rank()) * self.size
        self.batches += 1
        return [self.rows[(start + i) % len(self.rows)] for i in range(self.size)]

    def loss(self, actor) -> torch.Tensor:
        input_ids, attention_mask = right_pad(self.next_rows(), self.pad_id)
        device = model_device(actor)
        logits = actor(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            use_cache=False,
        ).logits
        labels = torch.where(attention_mask.bool(), input_ids, -100).to(device)
        return causal_lm_nll_sum(logits, labels) / max(int((labels[:, 1:] != -100).sum()), 1)

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = int(state["batches"])
