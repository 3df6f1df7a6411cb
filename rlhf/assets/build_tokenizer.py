"""(Re)build the tiny tokenizer shipped in ``rlhf/assets/tiny_tokenizer``: ``python -m rlhf.assets.build_tokenizer``.

A byte-level BPE with facebook/opt-*'s conventions, so code written for OPT works unchanged: ``<s>`` 0,
``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3; BOS = EOS = ``</s>``; every encoding starts with ``</s>`` and no EOS is
appended; any UTF-8 text round-trips (256 byte symbols, never an unknown). Trained on the toy task's texts plus a
small English sample below, so toy rows take few tokens and general text is not spelled byte by byte.
Deterministic: the training text is a pure function of this file and ``rlhf.tasks.toy``, and the BPE trainer
breaks count ties by token ids, so two builds give byte-identical files (tests check it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.tasks import toy

# 1280 entries = 260 fixed ones (4 specials + 256 bytes) + 1020 merges: the smallest round size (5 x 256, a
# GPU-friendly multiple) at which every word and number of the toy task is one token (with its leading space),
# so a toy prompt is ~16 tokens and an answer ~7, and every answer value is a single token to predict. At 1024,
# ~50 answer values (cities, "BREAD", "18") still split into pieces; 1200 is the measured minimum. The
# embedding and the softmax stay small next to a ~1-3M-parameter model (1280 x 128 = 164k parameters at
# d_model 128); a larger vocabulary would only add English words the toy task never uses.
VOCAB_SIZE = 1280
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3, as in facebook/opt-*
MODEL_MAX_LENGTH = 512

ENGLISH = """\
Hello! How can I help you today? I am an assistant, and I am happy to help.
Please tell me what you would like to know. Thank you very much for your question.
Sure, here is the answer. I think that is a good idea. Let me explain it step by step.
The weather is nice today, so we went for a walk in the park with our friends.
She reads a book every night before she goes to sleep. He likes to play music with his brother.
They were talking about the best way to learn a new language. Practice a little every day.
What time is it? It is ten o'clock in the morning. The train leaves at half past four.
Where do you live? I live in a small town near the sea, not far from the mountains.
Can you give me some advice about cooking? Start with simple dishes like soup, rice or pasta.
Why is the sky blue? Because air scatters blue light from the sun more than red light.
How many people live in this city? More than one million people live here.
This is important: always check your work, and ask for help when you need it.
The children played in the garden while their parents made dinner in the kitchen.
We should write a short list of things to buy: milk, bread, eggs, cheese, fruit and water.
A good friend listens, tells the truth and helps when things are hard.
The first step is to read the question; the second step is to think; the last step is to answer.
I don't know the answer, but I can try to find out. Could you say that again, please?
Yes, that is right. No, that is not correct. Maybe you are thinking of something else.
The company said that its new product would be ready next year, after a long period of work.
Water boils at one hundred degrees. Ice melts when it gets warm. Plants need light to grow.
My favourite colour is green, and my favourite food is bread with butter and honey.
There are seven days in a week, twelve months in a year, and about thirty days in a month.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 60 70 80 90 100 1000 2024.
He said, "I will be there at 8." She asked: "Is it true?" We answered (quickly) - yes!
Students often work in groups, share their ideas and learn from each other at school.
Computers, phones and the internet have changed how people work, talk and study.
The doctor told him to drink more water, eat fresh food and get enough sleep.
If you have any other questions, feel free to ask. Have a nice day!
"""


def training_texts() -> list[str]:
    """The BPE training text: realistic toy rows (for the frequencies), every toy question, answer and
    wrong answer once (for coverage), the LM corpus, and the English sample (weighted up a little)."""
    rows = toy.generate_toy_rows("train", 20000, seed=0)
    rows += toy.generate_toy_rows("test", 2000, seed=0)
    texts = [row[col] for row in rows for col in ("prompt", "response", "chosen", "rejected")]
    for family in toy.FAMILIES.values():
        for inst in family.instances:
            questions = [family.question(inst, p) for p in range(len(family.questions))]
            texts += [toy.toy_prompt(q) for q in questions]
            texts += [" " + family.sentence(inst, value) for value in (inst.value, *inst.wrong)]
    texts += toy.toy_corpus(2000, seed=0)
    texts += ENGLISH.splitlines() * 20
    return texts


def build(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    # "<unk>" is never produced: all 256 bytes are in the vocabulary.
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    # OPT: "</s>" (its BOS) before every sequence, nothing appended (no EOS).
    tokenizer.post_processor = processors.TemplateProcessing(
        single="</s>:0 $A:0", pair="</s>:0 $A:0 $B:1", special_tokens=[("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=MODEL_MAX_LENGTH,
    )


def save(out_dir: Path = TINY_TOKENIZER_DIR, vocab_size: int = VOCAB_SIZE) -> Path:
    """Build and write the tokenizer to ``out_dir`` (only the tokenizer files are replaced)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build(vocab_size).save_pretrained(str(out_dir))
    # transformers 5 names its class "TokenizersBackend"; the old alias loads in 4.x and 5.x alike.
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_TOKENIZER_DIR, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    print(f"wrote {save(args.out, args.vocab_size)}")


if __name__ == "__main__":
    main()
