"""Writes the parquet golden files of tests/parquet_data.rs (run from the repository root:
`pip install pyarrow`, then `python tests/golden/make_parquet_golden.py`).

tests/golden/parquet/
  docs.jsonl              the documents as JSON lines ({"text": ...}), the reference
  docs.parquet            the same documents: columns `id` (int64), `text` (string),
                          `source` (string); row groups of 7 rows, snappy (pyarrow's
                          default codec)
  shards/train-0000{0,1,2}-of-00003.parquet
                          the same documents cut into three files (as `datasets`
                          shards them): the first and last snappy, the middle zstd,
                          row groups of 5 rows, the text column named `content`
  bad/no_text.parquet     no `text` column (only `id` and `body`)
  bad/int_text.parquet    `text` is int64
  bad/null_text.parquet   `text` is a string column with a null in row 3
The documents are fixed text (no randomness): a rerun writes the same files.
"""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

OUT = os.path.join("tests", "golden", "parquet")

WORDS = (
    "the model reads every shard of the data once per epoch and each rank keeps only "
    "its own documents while the loss falls slowly over many small steps"
).split()


def documents():
    docs = []
    for i in range(41):
        n = 3 + (i * 7) % 23
        words = [WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n)]
        text = " ".join(words)
        if i % 4 == 1:
            text += "\nsecond line of document %d" % i
        if i % 6 == 2:
            text = "caf\u00e9 na\u00efve \u00fcber \u2014 " + text
        if i % 9 == 5:
            text += " " + "long " * (40 + i)
        docs.append(text.strip())
    return docs


def main():
    os.makedirs(os.path.join(OUT, "shards"), exist_ok=True)
    os.makedirs(os.path.join(OUT, "bad"), exist_ok=True)
    docs = documents()
    with open(os.path.join(OUT, "docs.jsonl"), "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    table = pa.table(
        {
            "id": pa.array(range(len(docs)), pa.int64()),
            "text": pa.array(docs, pa.string()),
            "source": pa.array(["golden"] * len(docs), pa.string()),
        }
    )
    pq.write_table(table, os.path.join(OUT, "docs.parquet"), row_group_size=7)
    cuts = [0, 13, 30, len(docs)]
    for k in range(3):
        part = pa.table({"content": pa.array(docs[cuts[k] : cuts[k + 1]], pa.string())})
        name = "train-%05d-of-00003.parquet" % k
        codec = "zstd" if k == 1 else "snappy"
        pq.write_table(
            part, os.path.join(OUT, "shards", name), row_group_size=5, compression=codec
        )
    pq.write_table(
        pa.table({"id": pa.array([1, 2], pa.int64()), "body": pa.array(["a", "b"])}),
        os.path.join(OUT, "bad", "no_text.parquet"),
    )
    pq.write_table(
        pa.table({"text": pa.array([1, 2, 3], pa.int64())}),
        os.path.join(OUT, "bad", "int_text.parquet"),
    )
    pq.write_table(
        pa.table({"text": pa.array(["a", "b", "c", None, "e"], pa.string())}),
        os.path.join(OUT, "bad", "null_text.parquet"),
    )
    print("wrote", OUT, "pyarrow", pa.__version__)


if __name__ == "__main__":
    main()
