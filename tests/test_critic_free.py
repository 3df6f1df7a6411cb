"""Step 3's critic-free estimators as configured: the keys' bad values are refused by name
before anything is built."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, register_configs
from rlhf.validate import validated
from tests.conftest import compose

register_configs()

PPO = ["step=ppo", "actor.model.path=/tmp", "critic.model.path=/tmp"]
BAD = [
    (["ppo.advantage_estimator=ppo"], "ppo.advantage_estimator", "'ppo'", "gae, grpo, rloo"),
    (["ppo.advantage_estimator=grpo"], "ppo.num_samples_per_prompt", "1", ">= 2 with"),
    (["ppo.num_samples_per_prompt=0"], "ppo.num_samples_per_prompt", "0", ">= 1"),
    (["ppo.dynamic_sampling=true"], "ppo.dynamic_sampling", "True", "grpo or rloo"),
    (
        ["ppo.advantage_estimator=remax", "ppo.greedy=true"],
        "ppo.greedy",
        "True",
        "every advantage would be 0",
    ),
    (["ppo.clip_low=1.0"], "ppo.clip_low", "1.0", "[0, 1)"),
    (["ppo.clip_high=-0.1"], "ppo.clip_high", "-0.1", ">= 0"),
    (["ppo.loss_aggregation=sum"], "ppo.loss_aggregation", "'sum'", "seq-mean-token-sum"),
    (["ppo.overlong_buffer=-1"], "ppo.overlong_buffer", "-1", ">= 0"),
    (
        ["ppo.max_new_tokens=16", "ppo.overlong_buffer=16"],
        "ppo.overlong_buffer",
        "16",
        "fewer tokens than ppo.max_new_tokens (16)",
    ),
    (["ppo.dynamic_sampling_rounds=-2"], "ppo.dynamic_sampling_rounds", "-2", ">= 0"),
    (
        [
            "ppo.advantage_estimator=rloo",
            "ppo.num_samples_per_prompt=3",
            "ppo.per_device_generation_batch_size=2",
            "ppo.per_device_training_batch_size=4",
        ],
        "ppo.per_device_training_batch_size",
        "4",
        "num_samples_per_prompt (6)",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "key", "value", "accepted"), BAD, ids=[b[0][-1] for b in BAD]
)
def test_bad_estimator_values_are_refused_by_name(overrides, key, value, accepted):
    with pytest.raises(ConfigError) as err:
        validated(compose([*PPO, *overrides]))
    [line] = [ln for ln in str(err.value).splitlines() if ln.strip().startswith(f"{key}=")]
    assert line.strip().startswith(f"{key}={value}: expected ")
    assert accepted in line


def test_a_group_estimator_with_groups_validates():
    overrides = ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"]
    config = validated(compose([*PPO, *overrides, "ppo.dynamic_sampling=true"]))
    assert not config.ppo.uses_critic
    assert validated(compose(PPO)).ppo.uses_critic  # gae, today's PPO, is the default
