"""Tokenizer fixtures in the formats of the Llama-3, Qwen2.5 and Qwen3 chat templates.

Written by us (templates and vocabularies), small word-level tokenizers with each family's
special tokens, for tests of token-in/token-out trajectories (`rollout/trajectory.py`).
Qwen3's keeps the behaviour that matters there: an assistant message before the last user
message is rendered without its <think> content.
"""

from __future__ import annotations

WORDS = (  # noqa: SIM905  (a sentence of words reads better than a list literal)
    "ping pong user assistant system tool ipython tools you are a helper : look up add what is "
    "the key of answer result error think hmm maybe call done ok again please thanks . , ? ! "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 lookup calc x y z w"
).split()

LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\n\ntools : ' -}}"
    "{%- for t in tools -%}{{- t.function.name + ' ' -}}{%- endfor -%}{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}"
    "{%- endif -%}"
)

_QWEN_HEAD = (
    "{%- if tools -%}{{- '<|im_start|>system\ntools : ' -}}"
    "{%- for t in tools -%}{{- t.function.name + ' ' -}}{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- elif messages[0].role != 'system' -%}"
    "{{- '<|im_start|>system\nyou are a helper .<|im_end|>\n' -}}"
    "{%- endif -%}"
)
_QWEN_TOOL = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\n' -}}{%- endif -%}"
)

QWEN25 = (
    _QWEN_HEAD + "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}" + _QWEN_TOOL + "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Qwen3: an assistant message after the last user message keeps its reasoning (the last
# message always shows a <think> block, empty or not); one before it loses it.
QWEN3 = (
    _QWEN_HEAD + "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}" + _QWEN_TOOL + "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

FAMILIES = {
    "llama3": dict(
        template=LLAMA3,
        special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        plain=["\n\n", "\n"],
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",  # encode() adds it, as the real Llama-3 tokenizer does
    ),
    "qwen2.5": dict(
        template=QWEN25,
        special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        plain=["<tool_response>", "</tool_response>", "\n\n", "\n"],
        eos="<|im_end|>",
    ),
    "qwen3": dict(
        template=QWEN3,
        special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        plain=["<think>", "</think>", "<tool_response>", "</tool_response>", "\n\n", "\n"],
        eos="<|im_end|>",
    ),
}


def make_chat_tokenizer(family: str):
    """A word-level tokenizer (WORDS, whitespace dropped) with the family's template and
    tokens; its newlines are tokens of their own, as in the real vocabularies."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    vocab = {"<unk>": 0}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in spec["special"]])
    backend.add_tokens([AddedToken(t, normalized=False) for t in spec["plain"]])
    bos = spec.get("bos")
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token=spec["eos"], bos_token=bos
    )
    tokenizer.chat_template = spec["template"]
    return tokenizer
