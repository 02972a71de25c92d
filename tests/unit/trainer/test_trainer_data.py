"""Trainer task sources: JSONL and Parquet rows, seeded epochs addressed by a cursor."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treadle_trainer.data import DatasetError, TaskSource, load_rows

pytestmark = pytest.mark.unit
ROWS = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(5)]


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    assert load_rows(jsonl) == load_rows(parquet) == ROWS


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.jsonl", '{"q": 1}\nnot json\n', "a.jsonl:2: not JSON"),
        ("b.jsonl", "[1, 2]\n", "each a JSON object"),
        ("c.csv", "q\n1\n", "expected .jsonl or .parquet"),
    ],
)
def test_bad_datasets_are_refused_with_the_place(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_rows(tmp_path / name)
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")


def test_cursor_walks_seeded_epochs():
    source = TaskSource(ROWS, seed=3)
    first, second = source.take(0, 5), source.take(5, 5)
    assert sorted(r["answer"] for r in first) == sorted(r["answer"] for r in ROWS)
    assert sorted(r["answer"] for r in second) == sorted(r["answer"] for r in ROWS)
    assert first != second  # a new permutation per epoch
    # the cursor addresses tasks: a restored trainer continues exactly where it was
    assert TaskSource(ROWS, seed=3).take(3, 4) == (first + second)[3:7]
    assert TaskSource(ROWS, seed=0, shuffle=False).take(4, 2) == [ROWS[4], ROWS[0]]
