"""The safetensors header parse: the bulk check accepts exactly what the entry-by-entry check accepts.

``read_header`` validates in bulk (list-wide operations, fast on 37k-key MoE adapters) and falls
back to the entry-by-entry check, which names the bad entry. A bulk check that accepted an entry
the other refuses would let a hostile header through, so thousands of mutated headers are run
through both and must agree: the same result, or both refuse.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.reader import _check_entries_in_bulk, _check_entries_one_by_one, read_header


def _header(path: Path) -> tuple[dict[str, Any], int, int]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    raw = json.loads(blob[8:8 + n])
    raw.pop("__metadata__", None)
    return raw, 8 + n, len(blob)


def _both(raw: dict[str, Any], base: int, size: int) -> tuple[Any, Any]:
    bulk = _check_entries_in_bulk(copy.deepcopy(raw), size - base)
    try:
        slow = _check_entries_one_by_one(copy.deepcopy(raw), "f", base, size)
    except AdapterFormatError:
        slow = None
    return bulk, slow


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "a.safetensors"
    save_file({"b": torch.zeros(3, 5, dtype=torch.bfloat16), "a": torch.ones(2, dtype=torch.float32),
               "scalar": torch.tensor(1.5, dtype=torch.float64), "empty": torch.zeros(0, 4, dtype=torch.float16),
               "empty2": torch.zeros(0, dtype=torch.int8), "i": torch.arange(6, dtype=torch.int64).reshape(2, 3)},
              str(path), metadata={"format": "pt"})
    return path


def test_bulk_and_one_by_one_agree_on_a_valid_file(sample: Path) -> None:
    raw, base, size = _header(sample)
    bulk, slow = _both(raw, base, size)
    assert bulk is not None and bulk == slow
    header = read_header(sample)
    assert list(header.shapes) == bulk[0]
    assert header.tensors["b"].shape == (3, 5) and header.tensors["b"].nbytes == 30
    assert header.offsets["a"][1] - header.offsets["a"][0] == 8


_BAD_VALUES: list[Any] = [None, True, False, -1, 1.5, 2**70, "3", [], [1], [1, 2, 3], {}, [True, 2], [-1, 2],
                          [0, 2**64], ["BF16"], "BF16", "F4", "bf16", 0]


def _mutate(raw: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    whole = [k for k, e in raw.items() if isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
             and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2
             and all(isinstance(x, int) for x in e["data_offsets"])]
    if not whole:
        return raw
    key = rng.choice(whole)
    entry = raw[key]
    what = rng.randrange(8)
    if what == 0:
        entry["dtype"] = rng.choice(["BF16", "F32", "F16", "I8", "F64", "XX", "F4", "F6_E2M3", 7, None, ["BF16"]])
    elif what == 1:
        entry["shape"] = rng.choice(_BAD_VALUES + [[*entry["shape"], 1], entry["shape"][:-1], [2] * 9, [1] * 8])
    elif what == 2:
        entry["data_offsets"] = rng.choice(_BAD_VALUES + [[entry["data_offsets"][0], entry["data_offsets"][1] + 1]])
    elif what == 3:
        shift = rng.choice([-2, -1, 1, 2])
        entry["data_offsets"] = [entry["data_offsets"][0] + shift, entry["data_offsets"][1] + shift]
    elif what == 4:
        del entry[rng.choice(["dtype", "shape", "data_offsets"])]
    elif what == 5:
        raw[key] = rng.choice(_BAD_VALUES)
    elif what == 6 and entry["shape"] and all(isinstance(d, int) for d in entry["shape"]):
        i = rng.randrange(len(entry["shape"]))
        entry["shape"][i] = rng.choice([entry["shape"][i] + 1, 0, -entry["shape"][i], float(entry["shape"][i]), True])
    else:
        other = rng.choice(list(raw))
        if isinstance(raw[other], dict) and "data_offsets" in raw[other] and "data_offsets" in entry:
            entry["data_offsets"], raw[other]["data_offsets"] = raw[other]["data_offsets"], entry["data_offsets"]
    return raw


def test_bulk_check_never_accepts_what_the_entry_by_entry_check_refuses(sample: Path) -> None:
    raw, base, size = _header(sample)
    rng = random.Random(0)
    refused = 0
    for _ in range(3000):
        bad = _mutate(raw, rng)
        if rng.random() < 0.3:
            bad = _mutate(bad, rng)
        for data_end in (size, size + rng.choice([-1, 1])):  # and truncated or trailing bytes
            bulk, slow = _both(bad, base, data_end)
            assert bulk is None or bulk == slow, bad
            refused += slow is None
    assert refused > 2000  # the mutations are mostly invalid


def test_a_refused_header_names_the_entry(tmp_path: Path, sample: Path) -> None:
    raw, base, size = _header(sample)
    raw["b"]["shape"] = [3, 6]
    blob = json.dumps(raw).encode()
    data = sample.read_bytes()[base:]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    with pytest.raises(AdapterFormatError, match="tensor 'b' declares shape"):
        read_header(bad)
