"""Prompt datasets (JSONL, Parquet), chat templates and prompt-length handling.

Every file is written into tmp_path; the tokenizer is a word-level one built in the test
and wrapped in `transformers.PreTrainedTokenizerFast` (no download).
"""

from __future__ import annotations

import json
import logging

import pytest

from rl_megatron.config import Config
from rl_megatron.data.datasets import DataError, dataset_from_config, load_prompt_dataset
from rl_megatron.data.tokenize import PromptTokenizer, prompts_from_config, tokenize_prompts

CORPUS = "what is one two three four five plus minus the answer of hello you are a helper"
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_hf_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A word-level tokenizer trained on CORPUS, with BOS added to plain text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS)
    backend.train_from_iterator([CORPUS], trainer=trainer)
    bos = backend.token_to_id("<s>")
    # Llama-style: plain text gets a BOS; a chat template writes its own.
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer():
    return make_hf_tokenizer()


# --------------------------------------------------------------------------- datasets


def test_jsonl_reads_every_record_in_order(tmp_path):
    rows = [{"prompt": f"what is {i}", "answer": str(i), "id": i} for i in range(37)]
    a = write_jsonl(tmp_path / "a.jsonl", rows[:20])
    b = write_jsonl(tmp_path / "b.jsonl", rows[20:])
    dataset = load_prompt_dataset([a, b], required_keys=("answer",))
    assert len(dataset) == 37 == len(a.read_text().splitlines()) + len(b.read_text().splitlines())
    assert dataset.samples == rows  # every field kept, file order, files in the given order
    assert dataset.sources[0] == f"{a}:1" and dataset.sources[-1] == f"{b}:17"
    assert dataset.prompt(5) == "what is 5"


def test_blank_lines_are_not_records_but_line_numbers_stay_true(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    dataset = load_prompt_dataset([path])
    assert [s["prompt"] for s in dataset] == ["one", "two"]
    assert dataset.sources == [f"{path}:1", f"{path}:3"]


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "three",\n')
    with pytest.raises(DataError) as info:
        load_prompt_dataset([path])
    message = str(info.value)
    assert message.startswith(f"{path}:3: malformed JSON")
    assert "\n" not in message


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    text = '{"prompt": "one"}\n\n{"prompt": "caf\u00e9"}\n'
    path.write_bytes(text.encode("latin-1"))  # é is the single byte 0xe9 in Latin-1
    with pytest.raises(DataError) as info:
        load_prompt_dataset([path])
    assert str(info.value) == (
        f"{path}:3: not UTF-8 text (byte 0xe9 at byte 16 of the line); "
        "JSON Lines files must be UTF-8, re-encode it"
    )
    path.write_bytes(text.encode("utf-8"))  # the same text as UTF-8 reads
    assert load_prompt_dataset([path]).prompt(1) == "caf\u00e9"


def test_non_utf8_parquet_string_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # pyarrow refuses such strings when building them, but not a binary column cast
    # without validation (other writers do not validate at all).
    prompts = pa.array([b"one", b"two", b"caf\xe9"], pa.binary()).cast(pa.string(), safe=False)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path, row_group_size=2)
    with pytest.raises(DataError) as info:
        load_prompt_dataset([path])
    assert str(info.value) == (
        f"{path} row 2: not UTF-8 text in a string column; re-write the file with UTF-8 strings"
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"question": "hi", "answer": "1"}', "no 'prompt' field (fields: question, answer)"),
        ('{"prompt": "hi"}', "no 'answer' field, which the reward needs"),
        ('{"prompt": "hi", "answer": null}', "no 'answer' field"),
        ('["prompt", "hi"]', "expected a JSON object, got list"),
        ('{"prompt": 7, "answer": "1"}', "'prompt' must be a string or a list of chat messages"),
        ('{"prompt": "  ", "answer": "1"}', "'prompt' is an empty string"),
        ('{"prompt": [{"role": "user"}], "answer": "1"}', "'prompt'[0] must be a message"),
        ('{"prompt": [], "answer": "1"}', "'prompt' is an empty list of messages"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, line, expected):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine", "answer": "1"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        load_prompt_dataset([path], required_keys=("answer",))
    assert str(info.value).startswith(f"{path}:2: ")
    assert expected in str(info.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="data.train_files: file not found"):
        load_prompt_dataset([tmp_path / "missing.jsonl"], what="data.train_files")
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_prompt_dataset([tmp_path / "d.csv"])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records in"):
        load_prompt_dataset([tmp_path / "empty.jsonl"])
    with pytest.raises(DataError, match="no files given"):
        load_prompt_dataset([])


def test_parquet_round_trip_with_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "messages": [
                {"role": "system", "content": "you are a helper"},
                {"role": "user", "content": f"what is {i} plus one"},
            ],
            "answer": str(i + 1),
            "level": i % 3,
        }
        for i in range(25)
    ]
    path = tmp_path / "d.parquet"
    # Small row groups so the reader crosses record batches.
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    dataset = load_prompt_dataset([path], prompt_key="messages", required_keys=("answer",))
    assert dataset.samples == rows
    assert dataset.sources[24] == f"{path} row 24"


def test_parquet_bad_row_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi"}, {"prompt": None}]), path)
    with pytest.raises(DataError, match=r"d\.parquet row 1: 'prompt' is null"):
        load_prompt_dataset([path])
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match="cannot read Parquet"):
        load_prompt_dataset([path])


def test_dataset_from_config_requires_the_answer_only_for_rule_rewards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi"}])
    config = Config()
    config.data.train_files = [str(path)]
    config.data.prompt_key = "question"
    config.reward.function = "gsm8k"
    with pytest.raises(DataError, match="no 'answer' field"):
        dataset_from_config(config, "train")
    config.reward.function = "my_pkg.rewards:score"  # a user function picks its own fields
    assert len(dataset_from_config(config, "train")) == 1
    with pytest.raises(DataError, match="data.val_files: no files given"):
        dataset_from_config(config, "val")


# --------------------------------------------------------------------------- tokenizer


def test_chat_messages_rendered_with_the_template(hf_tokenizer):
    tokenizer = PromptTokenizer(hf_tokenizer, apply_chat_template=True)
    messages = [
        {"role": "system", "content": "you are a helper"},
        {"role": "user", "content": "what is two plus two"},
    ]
    text = tokenizer.render(messages)
    assert text == "<s><|system|> you are a helper <|user|> what is two plus two <|assistant|>"
    ids = tokenizer.encode(messages)
    tokens = hf_tokenizer.convert_ids_to_tokens(ids)
    # The template's BOS only: no second one from the tokenizer's post-processor.
    assert tokens[:2] == ["<s>", "<|system|>"] and tokens.count("<s>") == 1
    assert tokens[-1] == "<|assistant|>"
    # A text prompt becomes one user message.
    assert tokenizer.render("hello") == "<s><|user|> hello <|assistant|>"


def test_plain_text_gets_the_tokenizers_special_tokens(hf_tokenizer):
    tokenizer = PromptTokenizer(hf_tokenizer, apply_chat_template=False)
    ids = tokenizer.encode("what is two")
    assert hf_tokenizer.convert_ids_to_tokens(ids) == ["<s>", "what", "is", "two"]
    assert tokenizer.decode(ids) == "what is two"
    assert tokenizer.pad_token_id == hf_tokenizer.convert_tokens_to_ids("<pad>")
    with pytest.raises(ValueError, match="need data.apply_chat_template=true"):
        tokenizer.render([{"role": "user", "content": "hi"}])


def test_template_missing_is_a_config_error():
    with pytest.raises(
        DataError, match="data.apply_chat_template: the tokenizer .* no chat_template"
    ):
        PromptTokenizer(make_hf_tokenizer(chat_template=None), apply_chat_template=True)


def test_from_pretrained_loads_a_saved_tokenizer(tmp_path, hf_tokenizer):
    hf_tokenizer.save_pretrained(tmp_path / "tok")
    tokenizer = PromptTokenizer.from_pretrained(tmp_path / "tok", apply_chat_template=True)
    messages = [{"role": "user", "content": "what is one"}]
    assert tokenizer.encode(messages) == PromptTokenizer(hf_tokenizer, True).encode(messages)
    with pytest.raises(DataError, match="model.tokenizer_path: no tokenizer directory at"):
        PromptTokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="model.tokenizer_path: cannot load a tokenizer from"):
        PromptTokenizer.from_pretrained(tmp_path / "empty")


def _length_dataset(tmp_path, word_counts):
    rows = [{"prompt": " ".join(["one"] * k), "answer": str(k)} for k in word_counts]
    return load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", rows)])


# Plain text: BOS + one token per word, so a prompt of k words is k + 1 tokens long.
WORD_COUNTS = [2, 9, 4, 3, 12, 4, 7]  # lengths 3, 10, 5, 4, 13, 5, 8


def test_length_filter_drops_and_counts(tmp_path, hf_tokenizer, caplog):
    dataset = _length_dataset(tmp_path, WORD_COUNTS)
    tokenizer = PromptTokenizer(hf_tokenizer)
    with caplog.at_level(logging.INFO, logger="rl_megatron"):
        result = tokenize_prompts(dataset, tokenizer, max_prompt_length=5, overflow="filter")
    assert [len(ids) for ids in result.input_ids] == [3, 5, 4, 5]
    assert (result.num_read, result.num_overlong, result.num_filtered) == (7, 3, 3)
    assert result.num_truncated == 0
    # The kept records and their ids stay aligned, sources included.
    assert [s["answer"] for s in result.dataset] == ["2", "4", "3", "4"]
    assert result.dataset.sources[1].endswith("d.jsonl:3")
    assert "7 prompts read, 3 longer than rollout.max_prompt_length=5 tokens filtered" in (
        caplog.text
    )
    assert result.metrics("train")["data/train_prompts_filtered"] == 3.0


def test_length_truncate_left_keeps_the_end_and_counts(tmp_path, hf_tokenizer):
    rows = [{"prompt": "one two three four five"}, {"prompt": "one two"}]
    dataset = load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", rows)])
    tokenizer = PromptTokenizer(hf_tokenizer)
    result = tokenize_prompts(dataset, tokenizer, max_prompt_length=3, overflow="truncate_left")
    assert len(result) == 2 and (result.num_truncated, result.num_filtered) == (1, 0)
    assert hf_tokenizer.convert_ids_to_tokens(result.input_ids[0]) == ["three", "four", "five"]


def test_length_reject_and_all_filtered_are_errors_with_counts(tmp_path, hf_tokenizer):
    dataset = _length_dataset(tmp_path, WORD_COUNTS)
    tokenizer = PromptTokenizer(hf_tokenizer)
    with pytest.raises(DataError) as info:
        tokenize_prompts(dataset, tokenizer, max_prompt_length=5, overflow="reject")
    assert "3 of 7 prompts are longer than rollout.max_prompt_length=5 tokens" in str(info.value)
    assert "d.jsonl:2, 10 tokens; longest 13" in str(info.value)
    with pytest.raises(DataError, match="all 7 prompts are longer than .*shortest 3, longest 13"):
        tokenize_prompts(dataset, tokenizer, max_prompt_length=2, overflow="filter")


def test_chat_prompt_without_template_names_the_record(tmp_path, hf_tokenizer):
    rows = [{"prompt": "hi"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    dataset = load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", rows)])
    with pytest.raises(DataError, match=r"d\.jsonl:2: cannot render the prompt"):
        tokenize_prompts(dataset, PromptTokenizer(hf_tokenizer), max_prompt_length=8)


def test_prompts_from_config(tmp_path, hf_tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "what is one plus two"}], "answer": "3"},
        {"messages": [{"role": "user", "content": " ".join(["one"] * 20)}], "answer": "1"},
    ]
    config = Config()
    config.data.train_files = [str(write_jsonl(tmp_path / "d.jsonl", rows))]
    config.data.prompt_key = "messages"
    config.data.apply_chat_template = True
    config.rollout.max_prompt_length = 10
    config.rollout.prompt_overflow = "truncate_left"
    result = prompts_from_config(config, PromptTokenizer(hf_tokenizer, True), "train")
    assert result.num_truncated == 1 and [len(ids) for ids in result.input_ids] == [8, 10]
