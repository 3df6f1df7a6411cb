"""The KL to the reference under a truncating sampler (top_k / top_p): the actor's log-probs
are the truncated distribution it sampled from, the reference's its whole (tempered)
distribution, as verl, OpenRLHF and TRL score it. Hand-computed on fixed logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.rl.experience import answer_kl, reference_args


class FixedLogits(torch.nn.Module):
    """A "model" whose logits are the same at every position."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.row = torch.tensor(logits)
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a dtype for callers that ask

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.row.expand(*input_ids.shape, -1).clone())


ACTOR = FixedLogits([2.0, 1.0, 0.0, -1.0])  # p(0) = 0.64: top_p 0.5 keeps token 0 alone
REFERENCE = FixedLogits([1.0, 1.0, 0.0, 0.0])
SEQUENCE = torch.tensor([[3, 0, 0]])  # one prompt token, then token 0 twice


def test_the_reference_is_scored_under_its_whole_distribution():
    kl = answer_kl(
        ACTOR, REFERENCE, SEQUENCE, torch.ones_like(SEQUENCE), 0, "k1", truncation=(0, 0.5)
    )
    # the actor's truncated distribution gives token 0 probability 1 (log-prob 0); the
    # reference's whole one gives it e / (2e + 2)
    reference_logprob = 1.0 - math.log(2 * math.e + 2)
    assert kl[0].tolist() == pytest.approx([-reference_logprob] * 2, abs=1e-6)
    # truncated at top_p 0.5 itself ({0, 1} kept), the reference would say 1/2: a KL of log 2
    assert kl.min() > math.log(2) + 0.3


def test_without_truncation_both_are_whole_and_tempered():
    temperature = 2.0
    kl = answer_kl(
        ACTOR, REFERENCE, SEQUENCE, torch.ones_like(SEQUENCE), 0, "k1", temperature=temperature
    )
    actor = torch.log_softmax(ACTOR.row / temperature, -1)[0]
    reference = torch.log_softmax(REFERENCE.row / temperature, -1)[0]
    assert kl[0].tolist() == pytest.approx([(actor - reference).item()] * 2, abs=1e-6)


def test_reference_args_keep_everything_but_the_truncation():
    args = {"fp32": True, "temperature": 0.7, "packing": None, "truncation": (50, 0.9)}
    assert reference_args(args) == {**args, "truncation": None}
