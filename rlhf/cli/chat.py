"""Talk to an exported actor from the terminal (DeepSpeed-Chat's chatbot.py, plain transformers).

    python -m rlhf.cli.chat --path RUN/ppo/actor          # or RUN/sft/model, any causal LM export
    echo "What is 3 + 4?" | python -m rlhf.cli.chat --path RUN/sft/model --max-new-tokens 32

Each line read from stdin is one turn. The conversation is kept in the format the data used,
``"\\n\\nHuman: {question}\\n\\nAssistant:"`` followed by the answer, turn after turn, and the whole
of it is the next prompt (its start is dropped when it no longer fits). Answers are greedy unless
``--sample``, and stop at the end-of-text token or where the model starts a new "Human:" turn.
``clear`` forgets the conversation, ``quit`` (or end of input) exits.

With ``--env TASK`` (a task with an environment: ``toy_tools``, or ``package.module:attribute``)
each answer is an episode, played by the loop PPO trains with: the model's turn ends at one of
the task's turn stops (a tool call's closing tag), the environment's observation (the tool's
result) is appended, and the model goes on, up to ``--max-turns`` turns. The answer printed is
the whole transcript, so the call and its result are seen::

    echo "What is 123 + 456?" | python -m rlhf.cli.chat --path RUN/ppo/actor --env toy_tools
    Assistant: <call> 123 + 456</call> = 579 The answer is 579.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STOPS = ("Human:", "Assistant:")  # the model writing the next turn itself


def turn(question: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant:"


class Chat:
    """A conversation with one model: :meth:`reply` adds a turn and returns the answer."""

    def __init__(
        self,
        path: str,
        device: str = "auto",
        max_new_tokens: int = 128,
        trust_remote_code: bool = False,
        env: str | None = None,
        max_turns: int = 4,
        **sampling,
    ):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
            .to(device)
            .eval()
        )
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling  # do_sample, temperature, top_p, top_k
        self.history = ""
        self.episodes = None
        if env is not None:
            self.episodes = self._episodes(env, max_turns)

    def reset(self) -> None:
        self.history = ""

    def _episodes(self, env_name: str, max_turns: int):
        """The training loop's episode player on this model (rlhf.rl.episodes)."""
        from rlhf import tasks
        from rlhf.config import MultiTurnConfig
        from rlhf.rl.episodes import EpisodeRollouts
        from rlhf.rl.rollouts import ModuleDecoder

        env = tasks.resolve(env_name)
        if not tasks.is_environment(env):
            raise tasks.TaskError(f"{env_name} has no step(episode, turn): not an environment")
        end = self._end_ids()[0] if len(self._end_ids()) == 1 else self.tokenizer.eos_token_id
        decoder = ModuleDecoder(self.model, self.tokenizer.pad_token_id, end, synced=False)
        # each answer is warned of its environment's faults: a person reads them, no bound
        bounds = MultiTurnConfig(max_turns=max_turns, max_failed_rollouts=0)
        return EpisodeRollouts(
            decoder, env, self.tokenizer, bounds, self.max_new_tokens, end, synced=False
        )

    def _episode(self, ids: list[int]) -> str:
        from rlhf.rl.generation import Sampling, decode_responses

        sample = self.sampling.get("do_sample", False)
        sampling = Sampling(
            self.max_new_tokens,
            greedy=not sample,
            temperature=self.sampling.get("temperature", 1.0),
            top_p=self.sampling.get("top_p", 1.0),
            top_k=self.sampling.get("top_k", 0),
        )
        rollout = self.episodes.generate([ids], sampling)
        return decode_responses(self.tokenizer, rollout)[0]

    def reply(self, question: str) -> str:
        import torch

        prompt = self.history + turn(question)
        ids = self._fit(self.tokenizer(prompt)["input_ids"])
        if self.episodes is not None:
            answer = cut_at_stop(self._episode(ids))
            self.history = prompt + answer.rstrip()
            return answer.strip()
        input_ids = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=self.max_new_tokens,
                eos_token_id=self._end_ids(),
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                **self.sampling,
            )
        text = self.tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
        answer = cut_at_stop(text)
        self.history = prompt + answer.rstrip()
        return answer.strip()

    def _fit(self, ids: list[int]) -> list[int]:
        """Keep BOS and the most recent tokens: room for the answer within the model's context."""
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        room = max(limit - self.max_new_tokens, 1)
        if len(ids) <= room:
            return ids
        bos = self.tokenizer.bos_token_id
        head = [bos] if ids[0] == bos else []
        return head + ids[len(ids) - room + len(head) :]

    def _end_ids(self) -> list[int]:
        """The tokenizer's EOS, the export's generation config EOS, and an added end-of-text
        token (``model.end_of_text_token`` is saved as an additional special token)."""
        ends = self.model.generation_config.eos_token_id
        ends = list(ends) if isinstance(ends, (list, tuple)) else [ends]
        ends.append(self.tokenizer.eos_token_id)
        extra = getattr(self.tokenizer, "additional_special_tokens", None) or []
        ends += self.tokenizer.convert_tokens_to_ids(list(extra))
        return sorted({e for e in ends if e is not None})


def cut_at_stop(text: str) -> str:
    """The answer up to where the model starts another turn."""
    cut = min((i for i in (text.find(s) for s in STOPS) if i >= 0), default=len(text))
    return text[:cut]


def main(argv: list[str] | None = None) -> int:
    from rlhf.config import ConfigError

    args = _parser().parse_args(argv)
    if problem := model_problem(Path(args.path)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.max_turns < 1:
        print(f"error: --max-turns {args.max_turns}: expected an integer >= 1", file=sys.stderr)
        return 2
    sampling = {"do_sample": args.sample}
    if args.sample:
        sampling.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    try:
        chat = Chat(
            args.path,
            args.device,
            args.max_new_tokens,
            args.trust_remote_code,
            args.env,
            args.max_turns,
            **sampling,
        )
    except ValueError as err:  # TaskError: an --env that does not resolve
        print(f"error: --env {args.env}: {err}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message; 'clear' forgets the conversation, 'quit' exits.", file=sys.stderr)
    while True:
        try:
            line = input("Human: " if interactive else "")
        except EOFError:
            break
        question = line.strip()
        if question == "quit":
            break
        if question == "clear":
            chat.reset()
            continue
        if not question:
            continue
        try:
            answer = chat.reply(question)
        except ConfigError as err:  # --env's step returned what no episode can take
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"Assistant: {answer}", flush=True)
    return 0


def model_problem(path: Path) -> str | None:
    """Why ``path`` is no model to talk to: no save_pretrained directory, or a reward model
    (a sequence classifier scores an answer; it writes none: PPO refuses it as an actor too)."""
    config = path / "config.json"
    if not config.is_file():
        return f"{path}: not a save_pretrained model directory"
    architectures = json.loads(config.read_text()).get("architectures") or []
    heads = [a for a in architectures if a.endswith("ForSequenceClassification")]
    if heads:
        return (
            f"{path}: a reward model ({heads[0]} in its config.json), not a causal LM; chat "
            "with an actor or an SFT export (RUN/ppo/actor, RUN/sft/model, RUN/dpo/model)"
        )
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlhf.cli.chat", description=__doc__.split("\n")[0])
    p.add_argument("--path", required=True, help="an exported model: RUN/ppo/actor, RUN/sft/model")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--env",
        help="play episodes against this task's environment (toy_tools, package.module:attribute)",
    )
    p.add_argument("--max-turns", type=int, default=4, help="model turns an episode takes at most")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model repository's own code (off by default)",
    )
    return p


if __name__ == "__main__":
    sys.exit(main())
