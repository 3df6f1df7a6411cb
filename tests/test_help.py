"""``python -m rlhf --help [words] [overrides]``: a word keeps the keys it names (a prefix, else a
dotted part), overrides show the values they compose to, a mistake is one line and exit 2, and
meanings wrap to the terminal. In-process: nothing trains."""

from __future__ import annotations

import pytest

from rlhf.cli import help as key_help
from rlhf.cli.compose import print_help


def _help(capsys, *args: str) -> list[str]:
    print_help(list(args))
    return capsys.readouterr().out.splitlines()


def _settings(lines: list[str]) -> list[str]:
    """The key=value of each key line."""
    return [ln.split()[0] for ln in lines if ln.startswith("  ") and ln[2:3].strip()]


def test_a_prefix_keeps_only_the_keys_it_starts(capsys):
    lines = _help(capsys, "ppo")
    settings = _settings(lines)
    assert "ppo.kl.coef=0.3" in settings
    assert all(s.startswith("ppo.") for s in settings), settings
    assert "ppo: default" in lines  # the group of that name, with its options


def test_a_ppo_section_prints_alone(capsys):
    lines = _help(capsys, "ppo.loss")
    settings = _settings(lines)
    assert "ppo.loss.clip_range=0.2" in settings
    assert all(s.startswith("ppo.loss.") for s in settings), settings
    assert [ln for ln in lines if ln.startswith("-- ")] == ["-- ppo.loss"]


def test_ppo_prints_every_section_under_its_own_heading(capsys):
    headings = [ln[3:] for ln in _help(capsys, "ppo") if ln.startswith("-- ")]
    rollout = ["ppo.rollout", "ppo.rollout.vllm", "ppo.rollout.multi_turn"]
    others = ["update", "loss", "kl", "reward", "advantage", "ema", "ptx", "eval"]
    assert headings == [*rollout, "ppo.asynchronous", *(f"ppo.{name}" for name in others)]


def test_a_word_no_key_starts_with_matches_a_dotted_part(capsys):
    keys = {s.split("=")[0] for s in _settings(_help(capsys, "lr"))}
    assert {"optim.lr", "actor.optim.lr", "critic.optim.lr"} <= keys
    assert all(k.rsplit(".", 1)[-1].startswith("lr") for k in keys), keys


def test_filters_show_what_the_overrides_compose_to(capsys):
    settings = _settings(
        _help(capsys, "actor.optim.lr=5e-06", "actor.optim.lr", "zero=stage3", "zero")
    )
    assert "actor.optim.lr=5e-06" in settings
    assert "zero.stage=3" in settings


def test_a_sweep_file_is_read_as_a_run_reads_it(capsys):
    settings = _settings(_help(capsys, "-cd", "sweeps", "-cn", "step1", "model.name"))
    assert settings == ["model.name=opt-1.3b"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["ppo.kl_coeff=1"], "ppo.kl_coeff=1: no such key; the closest known key is ppo.kl.coef"),
        (["ppo.kl.coef=abc"], "could not be converted to Float"),
        (
            ["ppo.kl_coef=0.1"],  # a former key
            "ppo.kl_coef=0.1: no such key; renamed to ppo.kl.coef",
        ),
        (["model=opt-13"], "model=opt-13: no such option; model's options: llama-2-7b, opt-1.3b"),
        (["zzzz"], "--help zzzz: no key starts with 'zzzz'"),
        (["ppo.kl_coeff"], "--help ppo.kl_coeff: no key starts with 'ppo.kl_coeff'; the closest"),
        (["data.sources.local.path=/tmp/é.jsonl"], "quote the value inside the argument"),
    ],
)
def test_a_mistake_after_help_is_one_line(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_:
        print_help(args)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    [line] = out.err.splitlines()
    assert line.startswith("error: ") and expected in line, line


def test_long_meanings_wrap_to_the_width():
    composed, _ = key_help.composed_for_help([])
    for width in (120, 100, 80, 60):  # 80 and less: meanings below their keys
        lines = key_help.text(composed, key_help.config_groups(), width=width).splitlines()
        assert max(len(ln) for ln in lines if ln.startswith("  ")) <= width
        kl = next(i for i, ln in enumerate(lines) if ln.startswith("  ppo.kl.coef="))
        rest = lines[kl + 1 : kl + 8]
        meaning = rest[: next(i for i, ln in enumerate(rest) if ln[2:3].strip())]
        text = " ".join(ln.strip() for ln in [lines[kl], *meaning])
        assert "weight of the per-token KL penalty to the reference" in text, (width, text)
        assert len(meaning) >= 2  # a long meaning continues in its column
        column = lines[kl].find("weight") if width > 80 else 6
        assert all(len(ln) - len(ln.lstrip()) == column for ln in meaning), (width, meaning)
