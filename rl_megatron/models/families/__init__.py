"""One name table per model family (`table.py` is the format; one module per family).

Adding a family is adding a module here that builds a `Family` from rows, and listing it
in `FAMILIES` (DESIGN.md §7, "Adding a model family").
"""

from __future__ import annotations

from rl_megatron.models.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from rl_megatron.models.families.table import Family

# config.json's model_type → its table; the order is the one error messages list.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        llama.FAMILY,
        qwen2.FAMILY,
        mistral.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        mixtral.FAMILY,
    )
}


def family(model_type: str) -> Family:
    """The table of `model_type` (parse_hf_config has already refused any other type)."""
    return FAMILIES[model_type]
