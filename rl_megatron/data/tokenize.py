"""Prompts → token ids: a thin wrapper over a Hugging Face tokenizer, and length handling.

`PromptTokenizer` renders a prompt (text, or chat messages through the tokenizer's chat
template) and encodes it the same way everywhere — training, generation and evaluation.
`tokenize_prompts` encodes a whole dataset once at start-up and applies the prompt-length
policy, reporting how many prompts it filtered, truncated or rejected (never silently).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rl_megatron.data.datasets import DataError, Prompt, PromptDataset, dataset_from_config

if TYPE_CHECKING:
    from rl_megatron.config import Config

__all__ = [
    "Overflow",
    "PromptTokenizer",
    "TokenizedPrompts",
    "tokenize_prompts",
    "prompts_from_config",
]

# What to do with a prompt longer than max_prompt_length:
#   filter        drop it from the dataset (count reported; error if none is left)
#   truncate_left keep its last max_prompt_length tokens (count reported)
#   reject        refuse to start, naming the first such prompt and the count
Overflow = Literal["filter", "truncate_left", "reject"]

_ENCODE_CHUNK = 1024  # prompts per call to the fast tokenizer (batched Rust encoding)


class PromptTokenizer:
    """Renders and encodes prompts; decodes responses.

    Args:
        tokenizer: a Hugging Face tokenizer (`PreTrainedTokenizerBase`).
        apply_chat_template: render prompts through `tokenizer.chat_template` with the
            generation prompt appended; a text prompt becomes one user message. When
            false, prompts must be text and are encoded as they are.
        name: how the tokenizer is named in errors (its path).
    """

    def __init__(self, tokenizer: Any, apply_chat_template: bool = False, name: str = "tokenizer"):
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.name = name
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"data.apply_chat_template: the tokenizer {name} has no chat_template; "
                "set data.apply_chat_template=false or use a tokenizer that has one"
            )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, apply_chat_template: bool = False, trust_remote_code: bool = False
    ) -> PromptTokenizer:
        """Load with `AutoTokenizer` from a local directory (or a hub name, if cached)."""
        from transformers import AutoTokenizer  # heavy import; only where a tokenizer loads

        local = Path(path).expanduser()
        # Anything that reads as a filesystem path must exist: otherwise AutoTokenizer
        # would take it for a hub name and reach for the network (minutes on a cluster
        # without internet) before failing.
        if (local.is_absolute() or str(path).startswith((".", "~"))) and not local.is_dir():
            raise DataError(f"model.tokenizer_path: no tokenizer directory at {path}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(local) if local.is_dir() else str(path), trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(
                f"model.tokenizer_path: cannot load a tokenizer from {path} ({first})"
            ) from None
        return cls(tokenizer, apply_chat_template, name=str(path))

    @classmethod
    def from_config(cls, config: Config) -> PromptTokenizer:
        """`model.tokenizer_path` (defaults to `model.hf_path`) and `data.apply_chat_template`."""
        path = config.model.tokenizer_path or config.model.hf_path
        if path is None:
            raise DataError("model.tokenizer_path: not set (and no model.hf_path to default to)")
        return cls.from_pretrained(path, config.data.apply_chat_template)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the tokenizer's files (what an exported model folder carries)."""
        self.tokenizer.save_pretrained(str(directory))

    def render(self, prompt: Prompt) -> str:
        """The prompt as the text the model sees (chat template applied when enabled)."""
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        if not isinstance(prompt, str):
            raise ValueError("chat messages need data.apply_chat_template=true")
        return prompt

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt."""
        return self.encode_texts([self.render(prompt)])[0]

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of already rendered prompt texts."""
        # A chat template writes its own special tokens (BOS included): adding them again
        # would double the BOS. Plain text gets the tokenizer's usual ones (e.g. Llama's BOS).
        encoded = self.tokenizer(list(texts), add_special_tokens=not self.apply_chat_template)
        return [list(ids) for ids in encoded["input_ids"]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of one response (special tokens such as EOS dropped by default)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True):
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        # Many chat models ship without a pad token; padding is always masked out, so EOS
        # serves as well as any other id there.
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def __len__(self) -> int:
        """Vocabulary size including added tokens (≤ the model's padded vocabulary)."""
        return len(self.tokenizer)


@dataclass
class TokenizedPrompts:
    """A dataset after tokenization and the length policy, with what the policy did.

    `dataset[i]` and `input_ids[i]` describe the same prompt; filtered prompts are gone from
    both. `num_overlong` prompts were longer than the limit; of those, `num_filtered` were
    dropped and `num_truncated` cut to their last `max_prompt_length` tokens.
    """

    dataset: PromptDataset
    input_ids: list[list[int]]
    max_prompt_length: int
    num_read: int
    num_overlong: int
    num_filtered: int
    num_truncated: int

    def __len__(self) -> int:
        return len(self.input_ids)

    def metrics(self, split: str = "train") -> dict[str, float]:
        """Flat `data/...` counts, for the run's metrics file."""
        return {
            f"data/{split}_prompts": float(len(self)),
            f"data/{split}_prompts_overlong": float(self.num_overlong),
            f"data/{split}_prompts_filtered": float(self.num_filtered),
            f"data/{split}_prompts_truncated": float(self.num_truncated),
        }


def tokenize_prompts(
    dataset: PromptDataset,
    tokenizer: PromptTokenizer,
    max_prompt_length: int,
    overflow: Overflow = "filter",
    what: str = "data.train_files",
    logger: logging.Logger | None = None,
) -> TokenizedPrompts:
    """Encode every prompt of `dataset` and apply the `overflow` policy.

    Args:
        dataset: the loaded records.
        tokenizer: renders (chat template) and encodes.
        max_prompt_length: longest prompt kept as is, in tokens.
        overflow: `filter`, `truncate_left` or `reject` (see `Overflow`).
        what: the setting named in messages (`data.train_files`, `data.val_files`).
        logger: where the one summary line goes (default: the `rl_megatron` logger, INFO).

    Raises DataError naming the record (file:line) when a prompt cannot be rendered or is
    empty once tokenized, when `overflow=reject` meets a long prompt, and when `filter`
    leaves no prompt at all. Each message carries the counts.
    """
    if max_prompt_length <= 0:
        raise DataError(f"rollout.max_prompt_length: must be > 0, got {max_prompt_length}")
    if overflow not in ("filter", "truncate_left", "reject"):
        raise DataError(
            f"rollout.prompt_overflow: {overflow!r} is not one of filter, truncate_left, reject"
        )
    logger = logger or logging.getLogger("rl_megatron")

    texts = []
    for i in range(len(dataset)):
        try:
            texts.append(tokenizer.render(dataset.prompt(i)))
        except Exception as exc:  # chat templates raise their own errors (jinja, roles)
            raise DataError(
                f"{dataset.sources[i]}: cannot render the prompt ({type(exc).__name__}: "
                f"{_first_line(exc)})"
            ) from None
    all_ids: list[list[int]] = []
    for start in range(0, len(texts), _ENCODE_CHUNK):
        all_ids.extend(tokenizer.encode_texts(texts[start : start + _ENCODE_CHUNK]))

    keep: list[int] = []
    kept_ids: list[list[int]] = []
    overlong: list[int] = []
    for i, ids in enumerate(all_ids):
        if not ids:
            raise DataError(f"{dataset.sources[i]}: the prompt is empty once tokenized")
        if len(ids) <= max_prompt_length:
            keep.append(i)
            kept_ids.append(ids)
            continue
        overlong.append(i)
        if overflow == "truncate_left":
            # The end of a prompt (the question, the generation prompt) matters most for
            # the response, so the start is what gets cut.
            keep.append(i)
            kept_ids.append(ids[-max_prompt_length:])

    n = len(dataset)
    longest = max(len(ids) for ids in all_ids)
    limit = f"rollout.max_prompt_length={max_prompt_length} tokens"
    if overlong and overflow == "reject":
        first = overlong[0]
        raise DataError(
            f"{what}: {len(overlong)} of {n} prompts are longer than {limit} (first: "
            f"{dataset.sources[first]}, {len(all_ids[first])} tokens; longest {longest}); "
            "raise the limit or set rollout.prompt_overflow=truncate_left"
        )
    if not keep:
        raise DataError(
            f"{what}: all {n} prompts are longer than {limit} (shortest "
            f"{min(len(ids) for ids in all_ids)}, longest {longest}); raise the limit"
        )

    result = TokenizedPrompts(
        dataset=dataset.select(keep) if len(keep) < n else dataset,
        input_ids=kept_ids,
        max_prompt_length=max_prompt_length,
        num_read=n,
        num_overlong=len(overlong),
        num_filtered=n - len(keep),
        num_truncated=len(overlong) if overflow == "truncate_left" else 0,
    )
    if overlong:
        action = "filtered out" if overflow == "filter" else "truncated on the left"
        logger.info(
            "%s: %d prompts read, %d longer than %s %s (longest %d); %d prompts used",
            what,
            n,
            len(overlong),
            limit,
            action,
            longest,
            len(result),
        )
    else:
        logger.info("%s: %d prompts read, none longer than %s", what, n, limit)
    return result


def prompts_from_config(
    config: Config, tokenizer: PromptTokenizer, split: str = "train"
) -> TokenizedPrompts:
    """Load and tokenize `data.{split}_files` with `rollout.max_prompt_length/prompt_overflow`."""
    dataset = dataset_from_config(config, split)
    return tokenize_prompts(
        dataset,
        tokenizer,
        config.rollout.max_prompt_length,
        overflow=config.rollout.prompt_overflow,
        what=f"data.{split}_files",
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
