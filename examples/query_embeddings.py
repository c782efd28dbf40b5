"""Query the columns an inference job added: the rows the model gets wrong, and the nearest
neighbours of one row by its embedding (Lance's own vector search; LanceDB reads the same files).

    python examples/query_embeddings.py data/digits_val.lance [--row 0] [--k 5]
"""

from __future__ import annotations

import argparse

import lance
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="a dataset with label, predicted, score and embedding columns")
    parser.add_argument("--row", type=int, default=0, help="the row whose neighbours are shown")
    parser.add_argument("--k", type=int, default=5, help="neighbours to show")
    args = parser.parse_args()
    dataset = lance.dataset(args.uri)
    wrong = dataset.to_table(columns=["label", "predicted", "score"], filter="predicted != label", with_row_id=True)
    print(f"{wrong.num_rows} of {dataset.count_rows()} rows predicted wrong (version {dataset.version}):")
    for row in wrong.to_pylist()[:20]:
        print(f"  row {row['_rowid']}: label {row['label']}, predicted {row['predicted']} (score {row['score']:.3f})")
    query = dataset.take([args.row], columns=["embedding", "label"]).to_pylist()[0]
    near = dataset.to_table(
        columns=["label", "predicted", "_distance"],
        nearest={"column": "embedding", "q": np.asarray(query["embedding"], np.float32), "k": args.k},
    )
    print(f"the {args.k} nearest rows to row {args.row} (label {query['label']}) by embedding:")
    for row in near.to_pylist():
        print(f"  label {row['label']}, predicted {row['predicted']}, distance {row['_distance']:.3f}")


if __name__ == "__main__":
    main()
