"""`tests/mutations.py`'s table stays runnable: a malformed entry (two joined into one) or a
line the code no longer has would only show when someone runs the slow script."""

from __future__ import annotations

from tests.mutations import MUTATIONS, ROOT


def test_every_mutation_names_one_existing_line_and_a_test():
    problems = []
    for entry in MUTATIONS:
        if len(entry) != 5:
            problems.append(f"{entry[0]!r}: {len(entry)} fields, not 5")
            continue
        name, path, old, new, test = entry
        text = (ROOT / path).read_text()
        if text.count(old) != 1:
            problems.append(f"{name!r}: {path} holds its line {text.count(old)} times")
        if old == new:
            problems.append(f"{name!r}: the replacement is the line itself")
        if not (ROOT / test.split("::")[0]).is_file():
            problems.append(f"{name!r}: no test file {test}")
    assert not problems, "\n".join(problems)
    assert len({entry[0] for entry in MUTATIONS}) == len(MUTATIONS), "duplicate names"
