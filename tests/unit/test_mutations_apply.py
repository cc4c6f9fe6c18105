"""Every one-line fault in `tests/mutations.py` still applies: its target text appears exactly
once in its file. A refactor that moves a line silently retires its mutation otherwise
(three had, found when the roles were split)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutations import MUTATIONS, ROOT


@pytest.mark.parametrize("name, path, old", [(m[0], m[1], m[2]) for m in MUTATIONS])
def test_every_mutation_target_appears_once(name, path, old):
    text = (Path(ROOT) / path).read_text()
    assert text.count(old) == 1, f"{name}: {path} holds its target {text.count(old)} times"
