"""The model weights of a Hugging Face checkpoint folder, under the names `from_pretrained` expects.

A Trainer folder holds the model as `model.safetensors` (or `model-00001-of-0000N.safetensors`
shards beside an index), as `pytorch_model.bin` (and its shards) when safetensors is off, or as
`adapter_model.*` for a PEFT adapter. Every other file (optimizer, scheduler, RNG, trainer state,
config) is training state or text, not weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ckptstore.errors import CheckpointFormatError
from ckptstore.formats import SAFETENSORS, TORCH, CheckpointFile, file_state, safetensors_file
from ckptstore.state import RawTensor, materialize, raw_from_torch

_WEIGHTS = re.compile(r"^(?P<stem>model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(?P<ext>safetensors|bin)$")
# one set of weights per folder: a folder holding two (safetensors and .bin) names each tensor twice
_PREFERENCE = (("model", "safetensors"), ("pytorch_model", "bin"), ("adapter_model", "safetensors"),
               ("adapter_model", "bin"))


def weight_files(files: list[CheckpointFile]) -> list[CheckpointFile]:
    """The files holding the model's weights (shards in name order), or [] when the folder has none.

    A weights file the commit kept as bytes (a torch file that only full unpickling reads) is refused:
    exporting the folder without it would write a "model" holding none of its weights.
    """
    groups: dict[tuple[str, str], list[CheckpointFile]] = {}
    for record in files:
        found = _WEIGHTS.match(record.name)
        if found:
            groups.setdefault((found["stem"], found["ext"]), []).append(record)
    for group in _PREFERENCE:
        if group in groups:
            unread = [record.name for record in groups[group] if record.format not in (SAFETENSORS, TORCH)]
            if unread:
                raise CheckpointFormatError(
                    f"{unread[0]} holds the model's weights but was committed as file bytes (reading it needs full "
                    "unpickling): export cannot take the weights from it; `ckpt checkout REF -o DIR` gives the "
                    "folder back as it was")
            return sorted(groups[group], key=lambda r: r.name)
    return []


def weights(record: CheckpointFile, raw_of: Callable[[str], RawTensor]) -> dict[str, RawTensor] | None:
    """The tensors of weight file `record` by name; `raw_of(path)` gives each stored entry.

    None for a torch file that is no flat map of names to tensors (see `torch_state`).
    """
    if record.format == SAFETENSORS:
        return safetensors_file.as_state(record.skeleton, raw_of)
    state = torch_state(record, raw_of)
    return None if state is None else {name: raw_from_torch(value, name) for name, value in state.items()}


def torch_state(record: CheckpointFile, raw_of: Callable[[str], RawTensor]) -> dict[str, Any] | None:
    """A torch weights file's state dict as torch.load gives it (tied weights one storage, `_metadata` kept).

    None where it is no flat map of names to tensors (a `{"module": ...}` wrapper), which
    `from_pretrained` does not read either.
    """
    import torch

    state = file_state(record, lambda path: materialize(raw_of(path)))  # views and shared storages resolved
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        return None
    return state
