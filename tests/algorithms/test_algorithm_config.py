"""AlgorithmConfig: defaults build, bad values raise ValueError naming `algorithm.<field>`."""

import pytest

from moe_rl.algorithms import AlgorithmConfig
from moe_rl.config import from_dict


def test_defaults_and_yaml_section():
    assert AlgorithmConfig().advantage_estimator == "grpo"
    config = from_dict(
        AlgorithmConfig,
        {
            "advantage_estimator": "dr_grpo",
            "dr_grpo_norm_len": 512,
            "clip_high": 0.28,
            "off_policy": "icepop",
            "icepop_high": 5,
        },
    )
    assert config.icepop_high == 5.0 and isinstance(config.icepop_high, float)
    assert not config.needs_reference and AlgorithmConfig(kl_coef=0.01).needs_reference


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"advantage_estimator": "ppo"}, "algorithm.advantage_estimator"),
        ({"kl_estimator": "k4"}, "algorithm.kl_estimator"),
        ({"off_policy": "is"}, "algorithm.off_policy"),
        ({"adv_eps": 0.0}, "algorithm.adv_eps"),
        ({"advantage_estimator": "dr_grpo"}, "algorithm.dr_grpo_norm_len"),
        ({"dr_grpo_norm_len": 128}, "algorithm.dr_grpo_norm_len"),
        ({"clip_low": 1.0}, "algorithm.clip_low"),
        ({"clip_high": 0.0}, "algorithm.clip_high"),
        ({"kl_coef": -0.1}, "algorithm.kl_coef"),
        ({"tis_cap": 0.5}, "algorithm.tis_cap"),
        ({"icepop_low": 1.5}, "algorithm.icepop_low"),
        ({"mis_high": 0.9}, "algorithm.mis_high"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        AlgorithmConfig(**kwargs)


def test_staleness_requires_a_correction():
    AlgorithmConfig(off_policy="none").check_staleness(0)
    AlgorithmConfig(off_policy="tis").check_staleness(4)
    with pytest.raises(ValueError, match=r"algorithm\.off_policy.*tis, icepop or mis"):
        AlgorithmConfig(off_policy="none").check_staleness(1)
