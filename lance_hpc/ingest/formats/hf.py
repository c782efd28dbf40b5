"""``hf:<dir>``: one split of a Hugging Face dataset saved with ``save_to_disk``, each of its Arrow
files a shard, in the dataset's own order; a ``ClassLabel`` label keeps its class names."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats.files import FileFormat, Part, sliced
from lance_hpc.ingest.reading import Reading


class HuggingFace(FileFormat):
    name = "hf"

    def shards(self, source: str) -> list[str]:
        directory = self.open(source).rstrip("/")
        splits = self._read_json(f"{directory}/dataset_dict.json")
        if splits is not None:
            names = ", ".join(splits.get("splits", []))
            raise UserError(
                f"hf:{self.uri(directory)} holds several splits ({names}): name one, e.g. hf:{self.uri(directory)}/"
                f"{(splits.get('splits') or ['train'])[0]}"
            )
        state = self._read_json(f"{directory}/state.json")
        if state is None or not state.get("_data_files"):
            raise UserError(
                f"hf:{self.uri(directory)} is not a Hugging Face dataset saved with save_to_disk (no state.json listing "
                "its data files)\n  fix: point hf: at the directory save_to_disk wrote (one split)"
            )
        for entry in state["_data_files"]:
            path = f"{directory}/{entry['filename']}"
            self.parts[path] = Part(path, self.filesystem.get_file_info(path).size or 0)
        return list(self.parts)

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        with self.filesystem.open_input_stream(self.parts[shard].path) as stream:
            yield from sliced(iter(pa.ipc.open_stream(stream)))

    def class_names(self, label_field: str) -> list[str] | None:
        info = self._read_json(f"{self.pattern.rstrip('/')}/dataset_info.json") or {}
        feature = (info.get("features") or {}).get(label_field) or {}
        names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
        return [str(name) for name in names] if names else None

    def _read_json(self, path: str) -> Any:
        try:
            with self.filesystem.open_input_stream(path) as handle:
                return json.loads(handle.read())
        except FileNotFoundError:
            return None
