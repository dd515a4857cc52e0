"""A step's row layout (`engine.layout.StepLayout`) on its docstring's table: rows owned, logits rows, kept rows."""
from __future__ import annotations

from specdec.engine.layout import StepLayout


def test_the_docstring_step():
    """seq 0: a 4-token prefill chunk short of its prompt's end; seq 1: its last token and 3 draft nodes; seq 2: its
    last token and 1 draft node."""
    layout = StepLayout.build([4, 1, 1], [0, 3, 1], ready=[1, 2])
    assert layout.starts == [0, 4, 8, 10]
    assert [list(layout.rows(i)) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert layout.fed_rows(0) == slice(0, 4) and layout.fed_rows(1) == slice(4, 5)
    assert layout.logits_rows == [4, 5, 6, 7, 8, 9]  # the ready sequences' last token and draft rows
    assert layout.kept_rows(1, [0, 2]) == [4, 5, 7]  # its fed token, then accepted nodes 0 and 2
    assert layout.kept_rows(2, []) == [8]
    # as an index: a slice where the rows are consecutive (a chain's accepted prefix), else the list
    assert layout.kept_index(1, [0, 1]) == slice(4, 7) and layout.kept_index(2, []) == slice(8, 9)
    assert layout.kept_index(1, [0, 2]) == [4, 5, 7] and layout.kept_index(1, [1]) == [4, 6]
    assert layout.kept_index(0, []) == slice(0, 4)
    logits = layout.logits  # ready sequence k is sequence k there
    assert logits.starts == [0, 4, 6] and logits.ready == [0, 1]
    assert logits.kept_rows(0, [0, 2]) == [0, 1, 3] and logits.kept_rows(1, [0]) == [4, 5]


def test_a_prefill_chunk_ending_its_prompt_chooses_from_its_last_row():
    layout = StepLayout.build([5, 3], [0, 0], ready=[0, 1])
    assert layout.logits_rows == [4, 7]
    assert layout.kept_rows(0, []) == [0, 1, 2, 3, 4] and layout.logits.starts == [0, 1, 2]
