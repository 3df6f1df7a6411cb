"""PPO experience and update plumbing on a tiny random OPT built here (no DeepSpeed): which
columns the losses read, that masked or padded positions change nothing, where the reward lands,
and that re-padding, whitening and make_experience keep every row's numbers.

Sequences are (B, P + R): a left-padded prompt of width P, then the response, right-padded.
"""

import math

import torch
import torch.nn.functional as F
from transformers import OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf import algos
from rlhf.data.collate import left_pad, right_pad
from rlhf.modeling.loading import ValueModel, scale_value_head
from rlhf.rl.experience import (
    Experience,
    make_experience,
    mask_short_answers,
    response_logprobs,
    response_values,
)
from rlhf.rl.experience_batch import concat, whiten_advantages
from rlhf.rl.generation import Rollout, response_mask
from rlhf.rl.shaping import Shaping

PAD, BOS, EOS = 0, 1, 2
G = 1e30  # large finite garbage at masked positions
ATOL = 1e-5


def _config(**extra) -> OPTConfig:
    # init_std 0.5 (not OPT's 0.02): log-probs and values vary by whole units from token to
    # token, so reading the wrong column could never pass a 1e-5 comparison by accident
    return OPTConfig(
        vocab_size=24,
        hidden_size=16,
        word_embed_proj_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        init_std=0.5,
        **extra,
    )


def _lm(seed: int = 0) -> OPTForCausalLM:
    torch.manual_seed(seed)
    return OPTForCausalLM(_config()).eval()


def _critic(seed: int = 1) -> ValueModel:
    torch.manual_seed(seed)
    return ValueModel(OPTForSequenceClassification(_config(num_labels=1))).eval()


class Trained(torch.nn.Module):
    """A DeepSpeed engine's surface as the collector and train_step use it: forward,
    backward, step, and the accumulation boundary train_step sets before each backward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.boundaries: list[bool] = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundaries.append(is_boundary)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


# three prompts of different lengths (left-padded to P = 5) and answers that end at EOS, cut at
# max_new_tokens (no EOS) and stop at once
PROMPTS = [[BOS, 5, 6, 7, 8], [BOS, 9, 10], [BOS, 11]]
RESPONSES = [[12, 13, 14, EOS], [15, EOS], [16, 17, 18, 19]]


def _rollout(prompts=PROMPTS, responses=RESPONSES) -> Rollout:
    """What generation returns for these prompts and answers (padding after each end)."""
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    response_ids, answer_mask = right_pad(responses, PAD)
    sequences = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, answer_mask], dim=1)
    return Rollout(sequences, attention_mask, prompt_ids.shape[1], answer_mask.bool())


def _manual_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response[j] | prompt + response[:j]) from one unpadded forward pass."""
    ids = torch.tensor([prompt + response])
    logp = F.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    rows = torch.arange(len(response)) + len(prompt) - 1
    return logp[rows, torch.tensor(response)]


def _manual_values(critic, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Value of the state before each response token: the last position of each unpadded prefix."""
    out = []
    for j in range(len(response)):
        ids = torch.tensor([prompt + response[:j]])
        out.append(critic(ids, torch.ones_like(ids))[0, -1])
    return torch.stack(out)


# ---------------------------------------------------------------- response columns


@torch.no_grad()
def test_response_logprobs_column_j_is_response_token_j():
    model, rollout = _lm(), _rollout()
    P, R = rollout.prompt_width, rollout.response_mask.shape[1]
    logprobs, logits = response_logprobs(
        model, rollout.sequences, rollout.attention_mask, start=P - 1
    )
    assert logprobs.shape == (3, R) and logits.shape == (3, R, 24)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        expected = _manual_logprobs(model, prompt, response)
        torch.testing.assert_close(logprobs[i, : len(response)], expected, atol=ATOL, rtol=0)
    # the comparison can tell columns apart: neighbouring tokens' log-probs differ by far more
    real = logprobs[rollout.response_mask]
    assert (real[1:] - real[:-1]).abs().min() > 100 * ATOL


@torch.no_grad()
def test_response_values_column_j_is_the_state_before_response_token_j():
    critic, rollout = _critic(), _rollout()
    P, R = rollout.prompt_width, rollout.response_mask.shape[1]
    values = response_values(critic, rollout.sequences, rollout.attention_mask, start=P - 1)
    assert values.shape == (3, R)
    full = critic(rollout.sequences, rollout.attention_mask)  # (B, P + R)
    for j in range(R):
        torch.testing.assert_close(values[:, j], full[:, P - 1 + j])
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        expected = _manual_values(critic, prompt, response)
        torch.testing.assert_close(values[i, : len(response)], expected, atol=ATOL, rtol=0)


def _policy_loss(model, rollout: Rollout, old_logprobs, advantages):
    model.zero_grad()
    logprobs, _ = response_logprobs(
        model, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1
    )
    loss, _ = algos.policy_loss(logprobs, old_logprobs, advantages, rollout.response_mask, 0.2, 0.2)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_policy_loss_ignores_prompt_padding_and_masked_positions():
    model, rollout = _lm(), _rollout()
    mask = rollout.response_mask
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logprobs, _ = response_logprobs(
            model, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1
        )
    old = logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)  # ratios clip
    advantages = torch.randn(logprobs.shape, generator=generator)
    loss, grads = _policy_loss(model, rollout, old, advantages)
    assert loss.abs() > 1e-3 and grads

    # garbage in old log-probs and advantages wherever the response mask is False
    loss2, grads2 = _policy_loss(
        model,
        rollout,
        torch.where(mask, old, G),
        torch.where(mask, advantages, -G),
    )
    assert torch.equal(loss2, loss)
    for g, g2 in zip(grads, grads2, strict=True):
        assert torch.equal(g, g2)

    # other token ids under the attention mask: left padding of the prompts, padding after EOS
    noise = torch.randint(3, 24, rollout.sequences.shape, generator=generator)
    sequences = torch.where(rollout.attention_mask.bool(), rollout.sequences, noise)
    assert not torch.equal(sequences, rollout.sequences)
    loss3, grads3 = _policy_loss(model, rollout._replace(sequences=sequences), old, advantages)
    torch.testing.assert_close(loss3, loss, atol=1e-6, rtol=0)
    for g, g3 in zip(grads, grads3, strict=True):
        torch.testing.assert_close(g3, g, atol=1e-5, rtol=1e-4)

    # ... while the loss does read every real response token
    changed = old.clone()
    changed[1, 0] += 0.5
    assert not torch.equal(_policy_loss(model, rollout, changed, advantages)[0], loss)


# ---------------------------------------------------------------- masks and rewards


def test_mask_short_answers_masks_and_counts_but_keeps_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]).bool()
    masked, short = mask_short_answers(mask, min_tokens=2)
    assert masked.shape == mask.shape  # no row dropped: every rank keeps its batch size
    assert short.tolist() == [False, True, True, False]
    assert int(short.sum()) == 2
    assert masked.tolist() == [
        [True, True, True, False],
        [False] * 4,
        [False] * 4,
        [True, True, False, False],
    ]
    masked, short = mask_short_answers(mask, min_tokens=1)
    assert torch.equal(masked, mask) and short.tolist() == [False, False, True, False]


def test_compute_rewards_puts_the_score_at_each_rows_last_real_token():
    # right-padded answers of 3, 1 and 4 tokens (G: padding)
    logprobs = torch.tensor([[-1.0, -2.0, -1.0, G], [-0.5, G, G, G], [-1.0, -1.0, -1.0, -2.0]])
    ref = torch.tensor([[-2.0, -2.0, -3.0, G], [-1.0, G, G, G], [-1.0, -2.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    scores = torch.tensor([1.5, -8.0, 9.0])
    rewards, kl = algos.compute_rewards(scores, logprobs, ref, mask, 0.2, 5.0)
    # kl (k1) = logp - ref: [1, 0, 2, -], [0.5, -, -, -], [0, 1, -1, -1]; -0.2 * kl elsewhere
    # scores clipped to +-5: 1.5, -5, 5 at columns 2, 0 and 3
    torch.testing.assert_close(
        kl, torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.5, 0.0, 0.0, 0.0], [0.0, 1.0, -1.0, -1.0]])
    )
    torch.testing.assert_close(
        rewards,
        torch.tensor(
            [
                [-0.2, 0.0, -0.4 + 1.5, 0.0],
                [-0.1 - 5.0, 0.0, 0.0, 0.0],
                [0.0, -0.2, 0.2, 0.2 + 5.0],
            ]
        ),
    )


def test_response_mask_through_the_first_eos():
    ids = torch.tensor([[5, EOS, 7, EOS], [5, 6, 7, 8], [EOS, 5, EOS, 5], [5, 6, 7, EOS]])
    assert response_mask(ids, EOS).tolist() == [
        [True, True, False, False],
        [True, True, True, True],  # cut at max_new_tokens: every token counts
        [True, False, False, False],
        [True, True, True, True],
    ]


# ---------------------------------------------------------------- experiences


class ConstantReward(torch.nn.Module):
    """A reward model that gives every position the same value."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, input_ids, attention_mask):
        return torch.full(input_ids.shape, self.value)


def _experience(rollout: Rollout, actor, critic, min_response_tokens: int = 1) -> Experience:
    """The rollout scored by ``actor``, another random model as reference, ``critic`` and a
    reward model that gives 7 (clipped to 5)."""
    shaping = Shaping(
        kl_coef=0.1,
        kl_estimator="k1",
        clip_reward_value=5.0,
        gamma=1.0,
        lam=0.95,
        min_response_tokens=min_response_tokens,
        score_position="last",
        reward_stats=None,
    )
    return make_experience(
        rollout, actor, _lm(seed=2), critic, ConstantReward(7.0), shaping, torch.device("cpu")
    )


def test_make_experience_shapes_returns_and_masking():
    prompts = [*PROMPTS, [BOS, 20, 21]]
    responses = [*RESPONSES, [EOS]]  # one token: shorter than min_response_tokens=2
    rollout = _rollout(prompts, responses)
    actor, critic = _lm(), _critic()
    exp = _experience(rollout, actor, critic, min_response_tokens=2)
    B, P, R = 4, rollout.prompt_width, rollout.response_mask.shape[1]

    assert exp.sequences.shape == exp.attention_mask.shape == (B, P + R)
    assert exp.prompt_width == P
    for name in ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "rewards"):
        assert getattr(exp, name).shape == (B, R), name
    for name in ("kl", "advantages", "returns"):
        assert getattr(exp, name).shape == (B, R), name
    assert exp.scores.shape == exp.short.shape == (B,)
    assert exp.short.tolist() == [False, False, False, True]
    assert torch.equal(exp.response_mask[:3], rollout.response_mask[:3])
    assert not exp.response_mask[3].any()
    torch.testing.assert_close(exp.scores, torch.full((B,), 7.0))  # before clipping

    mask = exp.response_mask
    torch.testing.assert_close(exp.returns[mask], exp.advantages[mask] + exp.old_values[mask])
    for name in ("returns", "advantages", "rewards", "kl"):
        assert (getattr(exp, name)[~mask] == 0).all(), name

    # the old log-probs and values are the actor's and critic's at the response columns
    logprobs, _ = response_logprobs(actor, exp.sequences, exp.attention_mask, P - 1)
    torch.testing.assert_close(exp.old_logprobs[mask], logprobs[mask].detach())
    values = response_values(critic, exp.sequences, exp.attention_mask, P - 1)
    torch.testing.assert_close(exp.old_values[mask], values[mask].detach())
    # rewards: -0.1 * (old - ref) everywhere, plus the clipped score (5) at the last real token
    kl = exp.old_logprobs - exp.ref_logprobs
    torch.testing.assert_close(exp.kl[mask], kl[mask])
    expected = -0.1 * kl
    for i, length in enumerate((4, 2, 4)):
        expected[i, length - 1] += 5.0
    torch.testing.assert_close(exp.rewards[:3][mask[:3]], expected[:3][mask[:3]])
    assert kl[mask].abs().max() > 0.1  # the reference is another model: the KL term is tested


@torch.no_grad()
def test_concat_repads_without_changing_any_rows_numbers():
    actor, critic = _lm(), _critic()
    wide_prompts = _rollout([[BOS, 3, 4], [BOS, 5, 6, 7, 8, 9]], [[10, 11, 12, 13, EOS], [14]])
    wide_answers = _rollout([[BOS, 15]], [[16, 17, EOS]])
    a = _experience(wide_prompts, actor, critic)
    b = _experience(wide_answers, actor, critic)
    assert (a.prompt_width, a.response_mask.shape[1]) == (6, 5)
    assert (b.prompt_width, b.response_mask.shape[1]) == (2, 3)

    cat = concat([a, b])
    P, R = cat.prompt_width, cat.response_mask.shape[1]
    assert (P, R) == (6, 5)
    assert cat.sequences.shape == cat.attention_mask.shape == (3, P + R)
    assert cat.response_mask.tolist()[2] == [True, True, True, False, False]

    # the recomputed log-probs and values of the re-padded rows are the originals
    logprobs, _ = response_logprobs(actor, cat.sequences, cat.attention_mask, P - 1)
    values = response_values(critic, cat.sequences, cat.attention_mask, P - 1)
    mask = cat.response_mask
    torch.testing.assert_close(logprobs[mask], cat.old_logprobs[mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(values[mask], cat.old_values[mask], atol=ATOL, rtol=0)
    for rows, e in ((slice(0, 2), a), (slice(2, 3), b)):
        width = e.response_mask.shape[1]
        for name in ("old_logprobs", "old_values", "advantages", "returns", "rewards"):
            assert torch.equal(getattr(cat, name)[rows, :width], getattr(e, name)), name
            assert (getattr(cat, name)[rows, width:] == 0).all(), name
        assert torch.equal(cat.scores[rows], e.scores) and torch.equal(cat.short[rows], e.short)


def _advantages_only(advantages: torch.Tensor, mask: torch.Tensor) -> Experience:
    zeros = torch.zeros_like(advantages)
    B, R = advantages.shape
    return Experience(
        sequences=torch.zeros(B, R + 1, dtype=torch.long),
        attention_mask=torch.ones(B, R + 1, dtype=torch.long),
        prompt_width=1,
        response_mask=mask,
        old_logprobs=zeros,
        ref_logprobs=zeros,
        old_values=zeros,
        scores=torch.zeros(B),
        rewards=zeros,
        kl=zeros,
        advantages=advantages,
        returns=zeros,
        short=torch.zeros(B, dtype=torch.bool),
    )


def test_whiten_advantages_over_all_experiences():
    generator = torch.Generator().manual_seed(0)
    experiences = []
    for shift, (B, R) in ((3.0, (4, 6)), (-2.0, (3, 9))):
        mask = torch.rand(B, R, generator=generator) > 0.3
        advantages = torch.randn(B, R, generator=generator) * 2 + shift
        experiences.append(_advantages_only(torch.where(mask, advantages, G), mask))
    whitened = whiten_advantages(experiences)

    real = torch.cat([w.advantages[w.response_mask] for w in whitened]).double()
    assert math.isclose(real.mean().item(), 0.0, abs_tol=1e-5)
    assert math.isclose(real.std().item(), 1.0, abs_tol=1e-4)  # unbiased, as masked_whiten
    # one mean and std for all: each experience keeps its own offset
    assert whitened[0].advantages[whitened[0].response_mask].mean() > 0.5
    assert whitened[1].advantages[whitened[1].response_mask].mean() < -0.5
    for w, e in zip(whitened, experiences, strict=True):
        assert (w.advantages[~w.response_mask] == 0).all()
        assert w.advantages.shape == e.advantages.shape


def test_scale_value_head_scales_every_value():
    torch.manual_seed(0)
    critic = ValueModel(OPTForSequenceClassification(_config(num_labels=1)).eval())
    ids = torch.tensor([[PAD, BOS, 5, 6, 7], [BOS, 8, 9, 10, EOS]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        before = critic(ids, mask)
        scale_value_head(critic, 0.25, zero_stage=0)
        after = critic(ids, mask)
    assert before.abs().min() > 1e-3  # a zero value would pass any scale
    torch.testing.assert_close(after, before * 0.25, rtol=1e-5, atol=1e-6)
