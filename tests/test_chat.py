"""``python -m rlhf.cli.chat``: a tiny OPT model saved here with the shipped tokenizer answers scripted
turns, in the data's prompt format, greedily (the same answer as transformers' own generate)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.cli.chat import Chat, cut_at_stop, turn
from tests.conftest import REPO

MAX_NEW = 12


def _save_tiny(path, always_end: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = OPTConfig(
        vocab_size=(len(tokenizer) + 7) // 8 * 8,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = OPTForCausalLM(config)
    if always_end:  # every position's output is the EOS embedding: EOS always wins
        with torch.no_grad():
            eos = model.model.decoder.embed_tokens.weight[tokenizer.eos_token_id]
            eos.mul_(0).add_(3.0)
            norm = model.model.decoder.final_layer_norm
            norm.weight.zero_()
            norm.bias.copy_(eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("chat-model"))


def _greedy(model_dir, prompt: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = OPTForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=1)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_answers_scripted_prompts(model_dir):
    script = "What is 3 + 4?\n\nclear\nWhat is 5 + 5?\nquit\nNever answered\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf.cli.chat",
            "--path",
            str(model_dir),
            "--max-new-tokens",
            str(MAX_NEW),
        ],
        input=script,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    answers = [ln for ln in proc.stdout.splitlines() if ln.startswith("Assistant:")]
    assert len(answers) == 2  # the blank line is skipped, nothing after quit
    expected = [
        cut_at_stop(_greedy(model_dir, turn(q))).strip()
        for q in ("What is 3 + 4?", "What is 5 + 5?")
    ]
    assert all(expected)  # the untrained model does say something
    assert answers == [f"Assistant: {a}" for a in expected]  # clear: a fresh prompt


def test_conversation_accumulates_in_the_datas_format(model_dir):
    chat = Chat(str(model_dir), device="cpu", max_new_tokens=MAX_NEW, do_sample=False)
    first = chat.reply("Give me the plural of woman.")
    after_first = chat.history
    assert after_first.startswith("\n\nHuman: Give me the plural of woman.\n\nAssistant:")
    assert after_first.rstrip().endswith(first)
    second = chat.reply("And of man?")
    assert chat.history.startswith(after_first + "\n\nHuman: And of man?\n\nAssistant:")
    expected = cut_at_stop(_greedy(model_dir, after_first + turn("And of man?"))).strip()
    assert second == expected  # the second prompt holds the whole conversation
    chat.reset()
    assert chat.history == ""


def test_answer_stops_at_end_of_text(tmp_path):
    chat = Chat(str(_save_tiny(tmp_path / "m", always_end=True)), device="cpu", max_new_tokens=8)
    assert chat.reply("Hello?") == ""
    assert chat.history.endswith("Assistant:")


def test_answer_is_cut_where_the_model_starts_a_new_turn():
    assert cut_at_stop(" Paris.\n\nHuman: and Italy?") == " Paris.\n\n"
    assert cut_at_stop(" 7") == " 7"


def test_missing_model_is_an_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.chat", "--path", str(tmp_path)],
        input="",
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not a save_pretrained model directory" in proc.stderr


def test_a_reward_model_is_refused(tmp_path):
    """A reward export is a sequence classifier: chat (like PPO) refuses it instead of
    decoding through a causal-LM head it does not have."""
    causal = _save_tiny(tmp_path / "causal")
    reward = OPTForSequenceClassification.from_pretrained(causal, num_labels=1)
    reward.save_pretrained(tmp_path / "reward")
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.chat", "--path", str(tmp_path / "reward")],
        input="What is 3 + 4?\n",
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert (
        "a reward model (OPTForSequenceClassification in its config.json), not a causal LM" in line
    )


# ---------------------------------------------------------------------------------- --env: episodes
TOOL_QUESTION = "What is 123 + 456?"
# the demonstration it memorises has the wrong sum: only the environment writes " = 579"
MEMORISED = " <call> 123 + 456</call> = 578 The answer is 578."


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """The tiny model overfitted on one toy_tools transcript, so that greedily it calls the tool."""
    path = _save_tiny(tmp_path_factory.mktemp("tool-caller"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = OPTForCausalLM.from_pretrained(path)
    ids = tokenizer(turn(TOOL_QUESTION) + MEMORISED)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([ids])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def _chat(path, *args: str, script: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlhf.cli.chat", "--path", str(path), *args]
    return subprocess.run(
        command, input=script, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _episode_by_hand(path, max_new_tokens: int) -> str:
    """Transformers' generate turn by turn: to the tool call's closing tag, the calculator's
    observation appended as its own token ids, then on to end-of-text."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = OPTForCausalLM.from_pretrained(path).eval()
    prompt = tokenizer(turn(TOOL_QUESTION), return_tensors="pt")["input_ids"]
    greedy = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    first = model.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        stop_strings=["</call>"],
        tokenizer=tokenizer,
        **greedy,
    )
    observation = tokenizer(" = 579", add_special_tokens=False, return_tensors="pt")["input_ids"]
    context = torch.cat([first, observation], dim=1)
    left = max_new_tokens - (context.shape[1] - prompt.shape[1])
    out = model.generate(context, max_new_tokens=left, **greedy)
    return tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()


def test_chat_env_plays_the_episode_with_the_tools_answer(tool_caller):
    plain = _chat(tool_caller, "--max-new-tokens", "40", script=TOOL_QUESTION + "\n")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == f"Assistant: {MEMORISED.strip()}"  # the model's own sum
    played = _chat(
        tool_caller, "--max-new-tokens", "40", "--env", "toy_tools", script=TOOL_QUESTION + "\n"
    )
    assert played.returncode == 0, played.stderr
    [answer] = [ln for ln in played.stdout.splitlines() if ln.startswith("Assistant:")]
    assert answer.startswith("Assistant: <call> 123 + 456</call> = 579")  # the calculator's
    assert answer == f"Assistant: {_episode_by_hand(tool_caller, 40)}"


def test_chat_env_stops_at_max_turns(tool_caller):
    played = _chat(
        tool_caller,
        *("--max-new-tokens", "40", "--env", "toy_tools", "--max-turns", "1"),
        script=TOOL_QUESTION + "\n",
    )
    assert played.returncode == 0, played.stderr
    assert played.stdout.strip() == "Assistant: <call> 123 + 456</call>"  # no turn to go on


def test_chat_env_must_be_an_environment(tool_caller):
    for env, message in (("toy", "not an environment"), ("no_such_task", "no_such_task")):
        proc = _chat(tool_caller, "--env", env, script=TOOL_QUESTION + "\n")
        assert proc.returncode == 2 and proc.stdout == ""
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: --env {env}:") and message in line
