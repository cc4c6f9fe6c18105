"""A task generated on the fly, with its own character tokenizer: the embedded CPU demo.

`data.synthetic_task: digit_echo` needs no files, no tokenizer download and no pretrained
model. Each prompt is a few random digits separated by spaces; the answer is the last
digit, and the response should repeat it (`rewards.rules.digit_echo` scores every character:
1 for the answer, 0.2 for another digit, 0 otherwise). A randomly initialised model
samples each of ~100 token ids about equally often, so it starts near 0.02 and learns,
from reward alone, first to emit digits and then the right one: the climb is visible in a
few dozen steps of a 4-layer model on two CPU cores.

`data.synthetic_task: key_lookup` is the multi-turn demo (`yaml_configs/tiny_agent_cpu.yaml`,
environment `key_lookup`): each prompt is a two-letter key whose value, one digit, is a
hash of the key the model cannot see; a lookup turn gets the value from the tool, and an
answer citing it ("=") is right (`environments/key_lookup.py`). Without the tool the
value is a guess.

`CharTokenizer` maps one character to one token id. It has the methods of
`data.tokenize.PromptTokenizer` that the trainer uses, so the rest of the pipeline (length
policy, decoding, rewards) runs unchanged.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rl_megatron.data.datasets import DataError, Prompt, PromptDataset

__all__ = ["CharTokenizer", "SYNTHETIC_TASKS", "synthetic_dataset"]

SYNTHETIC_TASKS = ("digit_echo", "key_lookup")

PAD_ID, EOS_ID = 0, 1
# Digits first, so that the task's tokens are the same ids whatever else is added later.
ALPHABET = (
    string.digits + " " + string.ascii_lowercase + string.ascii_uppercase + ".,:;!?=+-*/()<>#"
)
UNKNOWN = "\ufffd"  # decoded for ids the model may sample beyond the alphabet
# The chat template's role markers (`CharChatTemplate`): ids after the alphabet and the
# `<unk>` that `save_pretrained` adds; each renders as one character outside the alphabet.
ROLE_IDS = {"user": len(ALPHABET) + 3, "assistant": len(ALPHABET) + 4, "tool": len(ALPHABET) + 5}
_ROLE_CHARS = {"user": "\x02", "assistant": "\x03", "tool": "\x05"}
_END_OF_TURN = "\x04"  # renders EOS: an assistant turn ends where the engine stops it
_ROLE_NAMES = {i: f"<{r}>" for r, i in ROLE_IDS.items()}


class CharTokenizer:
    """One token per character of `ALPHABET`; id 0 pads, id 1 ends a response."""

    name = "synthetic character tokenizer"
    apply_chat_template = False

    def __init__(self) -> None:
        self._ids = {c: i + 2 for i, c in enumerate(ALPHABET)}

    def render(self, prompt: Prompt) -> str:
        if not isinstance(prompt, str):
            raise ValueError("the synthetic character tokenizer takes text prompts only")
        return prompt

    def encode(self, prompt: Prompt) -> list[int]:
        return self.encode_texts([self.render(prompt)])[0]

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            bad = next((c for c in text if c not in self._ids), None)
            if bad is not None:
                raise ValueError(f"character {bad!r} is not in the synthetic tokenizer's alphabet")
            out.append([self._ids[c] for c in text])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        chars = []
        for i in ids:
            if i in (PAD_ID, EOS_ID):
                if not skip_special_tokens:
                    chars.append("<pad>" if i == PAD_ID else "<eos>")
                continue
            k = int(i) - 2
            if not skip_special_tokens and int(i) in _ROLE_NAMES:
                # The chat template's markers, readable in rollout records; skipped, they
                # stay UNKNOWN, so single-turn decoding and its rewards are unchanged.
                chars.append(_ROLE_NAMES[int(i)])
                continue
            chars.append(ALPHABET[k] if 0 <= k < len(ALPHABET) else UNKNOWN)
        return "".join(chars)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True):
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def chat_tokenizer(self) -> CharChatTemplate:
        """The chat rendering multi-turn rollouts need (`rollout/trajectory.py`)."""
        return CharChatTemplate(self)

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    def __len__(self) -> int:
        return len(ALPHABET) + 2

    def save_pretrained(self, directory: str | Path) -> None:
        """Write this tokenizer as a Hugging Face one (`tokenizer.json` and its config), so
        an exported model loads with `AutoTokenizer` and encodes every text as `encode` does.

        Characters outside the alphabet, which `encode` refuses, become `<unk>` (one id past
        the alphabet: the models' vocabularies have room for it).
        """
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": PAD_ID, "</s>": EOS_ID, **self._ids, "<unk>": len(self)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
        )
        fast.save_pretrained(str(directory))


class CharChatTemplate:
    """A chat template for the character tokenizer: `<role>content<eos>` per message, the
    generation prompt `<assistant>`. What `ChatIncrements` reads of a Hugging Face
    tokenizer: `apply_chat_template(..., tokenize=False)`, `encode`, `decode`, EOS."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.base = tokenizer
        self._special = {c: ROLE_IDS[r] for r, c in _ROLE_CHARS.items()} | {_END_OF_TURN: EOS_ID}

    eos_token_id = EOS_ID

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False
    ) -> str:
        if tokenize:
            raise ValueError("CharChatTemplate renders text only (tokenize=False)")
        parts = []
        for m in messages:
            if m["role"] not in _ROLE_CHARS:
                raise ValueError(f"the character chat template has no role {m['role']!r}")
            parts.append(_ROLE_CHARS[m["role"]] + str(m.get("content", "")) + _END_OF_TURN)
        if add_generation_prompt:
            parts.append(_ROLE_CHARS["assistant"])
        return "".join(parts)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, plain = [], []
        for c in text + "\x00":  # a sentinel flushes the last run of plain characters
            if c in self._special or c == "\x00":
                if plain:
                    out.extend(self.base.encode_texts(["".join(plain)])[0])
                    plain = []
                if c != "\x00":
                    out.append(self._special[c])
            else:
                plain.append(c)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = []
        for i in ids:
            if int(i) in _ROLE_NAMES:
                text.append("" if skip_special_tokens else _ROLE_NAMES[int(i)])
            else:
                text.append(self.base.decode([i], skip_special_tokens))
        return "".join(text)


def key_value(key: str) -> str:
    """The key_lookup task's hidden value of `key`: one digit, a hash of the key."""
    return str(int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10)


def synthetic_dataset(
    task: str, num_prompts: int, seed: int, split: str = "train", length: int | None = None
) -> PromptDataset:
    """`num_prompts` records of `task`, a pure function of (seed, split, length).

    Records are `{"prompt": "3 8 1", "answer": "1"}`; sources read `synthetic:<split>:<i>`
    so that error messages name the record as they would a file line. `length`: every
    prompt has (length + 1) // 2 digits, 2k - 1 tokens for k digits (None: 3 to 6 digits).
    """
    if task not in SYNTHETIC_TASKS:
        raise DataError(
            f"data.synthetic_task: unknown task {task!r}; use one of {', '.join(SYNTHETIC_TASKS)}"
        )
    if num_prompts <= 0:
        raise DataError(f"data.synthetic_size: must be > 0, got {num_prompts}")
    if length is not None and length < 1:
        raise DataError(f"data.synthetic_prompt_length: must be >= 1, got {length}")
    # Train and validation draw from different streams, so evaluation prompts are held out
    # in the sense of never being the same draw (the task space is small; that is fine).
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    samples, sources = [], []
    if task == "key_lookup":
        letters = np.array(list(string.ascii_lowercase))
        for i in range(num_prompts):
            key = "".join(rng.choice(letters, size=2))
            samples.append({"prompt": key, "key": key, "answer": key_value(key)})
            sources.append(f"synthetic:{split}:{i}")
        return PromptDataset(samples, sources, prompt_key="prompt", files=[f"synthetic:{task}"])
    for i in range(num_prompts):
        count = int(rng.integers(3, 7)) if length is None else (length + 1) // 2
        digits = rng.integers(0, 10, size=count)
        samples.append({"prompt": " ".join(map(str, digits)), "answer": str(digits[-1])})
        sources.append(f"synthetic:{split}:{i}")
    return PromptDataset(samples, sources, prompt_key="prompt", files=[f"synthetic:{task}"])
