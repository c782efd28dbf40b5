"""The columns an inference job added, queried with LanceDB: the rows the model gets wrong (a SQL
filter), and the nearest neighbours of the first of them by its ``embedding`` (a vector search).
LanceDB opens the dataset lance_hpc wrote as a table: the dataset's directory is the database, its
name without ``.lance`` the table.

    python3 -m pip install lancedb
    python3 examples/lancedb_search.py data/digits_val.lance [--k 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lancedb
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="a Lance dataset with label, predicted and embedding columns (path/to/name.lance)")
    parser.add_argument("--k", type=int, default=5, help="neighbours to show")
    args = parser.parse_args()
    path = Path(args.uri)
    table = lancedb.connect(str(path.parent)).open_table(path.name.removesuffix(".lance"))
    wrong = table.search().where("predicted != label").select(["label", "predicted", "embedding"]).limit(None).to_list()
    print(
        f"{len(wrong)} of {table.count_rows()} rows predicted wrong (table {path.name.removesuffix('.lance')} in {path.parent})"
    )
    for row in wrong[:10]:
        print(f"  label {row['label']}, predicted {row['predicted']}")
    query = wrong[0] if wrong else table.search().select(["label", "predicted", "embedding"]).limit(1).to_list()[0]
    near = (
        table.search(np.asarray(query["embedding"], np.float32), vector_column_name="embedding")
        .select(["label", "predicted", "_distance"])
        .limit(args.k)
        .to_list()
    )
    print(f"the {args.k} rows nearest to one with label {query['label']}, predicted {query['predicted']}, by embedding:")
    for row in near:
        print(f"  label {row['label']}, predicted {row['predicted']}, distance {row['_distance']:.3f}")


if __name__ == "__main__":
    main()
