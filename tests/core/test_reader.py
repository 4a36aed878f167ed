"""The safetensors header parse: the bulk check accepts exactly what the entry-by-entry check accepts.

``read_header`` validates in bulk (msgspec's typed decoding, then list-wide operations: fast on 37k-key MoE
adapters) and falls back to json and the entry-by-entry check, which names the bad entry. A bulk check that
accepted an entry the other refuses would let a hostile header through, so thousands of mutated headers are run
through both and must agree: the same result, or the bulk check refuses.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_lora_ext.errors import AdapterFormatError
import vllm_lora_ext.headers as reader_module
from vllm_lora_ext.headers import _check_header_in_bulk, _check_header_one_by_one, read_header


def _header(path: Path) -> tuple[dict[str, Any], int, int]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    raw = json.loads(blob[8:8 + n])
    raw.pop("__metadata__", None)
    return raw, 8 + n, len(blob)


def _both(raw: dict[str, Any], base: int, size: int) -> tuple[Any, Any]:
    """Both checks of ``raw`` written as a header: ``(entries, metadata)`` each, or ``None`` where refused."""
    blob = json.dumps(raw).encode()
    bulk = _check_header_in_bulk(blob, size - base)
    try:
        slow = _check_header_one_by_one(blob, "f", base, size)
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
    assert _both({**raw, "__metadata__": {"format": "pt"}}, base, size)[0][1] == {"format": "pt"}
    header = read_header(sample)
    assert list(header.shapes) == bulk[0][0] and header.metadata == {"format": "pt"}
    assert header.tensors["b"].shape == (3, 5) and header.tensors["b"].nbytes == 30
    assert header.offsets["a"][1] - header.offsets["a"][0] == 8


_BAD_VALUES: list[Any] = [None, True, False, -1, 1.5, 2**70, "3", [], [1], [1, 2, 3], {}, [True, 2], [-1, 2],
                          [0, 2**64], ["BF16"], "BF16", "F4", "bf16", 0]


_BAD_METADATA: list[Any] = [{"format": "pt"}, None, 0, [], {}, "pt", {"a": 1}, {"a": None}, {"dtype": "F32"},
                             {"shape": [1], "data_offsets": [0, 4], "dtype": "F32"}, [["a", "b"]]]


def _mutate(raw: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    whole = [k for k, e in raw.items() if isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)
             and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2
             and all(isinstance(x, int) for x in e["data_offsets"])]
    if not whole:
        return raw
    key = rng.choice(whole)
    entry = raw[key]
    what = rng.randrange(9)
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
    elif what == 7:
        raw["__metadata__"] = rng.choice(_BAD_METADATA)
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
    refused = accepted_in_bulk = 0
    for _ in range(3000):
        bad = _mutate(raw, rng)
        if rng.random() < 0.3:
            bad = _mutate(bad, rng)
        for data_end in (size, size + rng.choice([-1, 1])):  # and truncated or trailing bytes
            bulk, slow = _both(bad, base, data_end)
            assert bulk is None or bulk == slow, bad
            accepted_in_bulk += bulk is not None
            refused += slow is None
    assert refused > 2000  # the mutations are mostly invalid
    assert accepted_in_bulk > 100  # and the valid ones mostly pass in bulk


def test_without_msgspec_headers_are_parsed_entry_by_entry(monkeypatch: pytest.MonkeyPatch, sample: Path) -> None:
    fast = read_header(sample)
    monkeypatch.setattr(reader_module, "_DECODERS", None)
    assert _check_header_in_bulk(b"{}", 0) is None
    slow = read_header(sample)
    assert (slow.shapes, slow.dtypes, slow.offsets, slow.nbytes, slow.metadata) == \
        (fast.shapes, fast.dtypes, fast.offsets, fast.nbytes, fast.metadata)
    assert list(slow.offsets) == list(fast.offsets)


def test_the_shared_decoders_parse_the_same_header_on_many_threads_at_once(tmp_path: Path) -> None:
    """Mix components are read on several threads at once: they share the module's msgspec decoders."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "m.safetensors"
    save_file({f"m.layers.{i}.mlp.experts.{e}.up_proj.lora_A.weight": torch.zeros(2, 3) for i in range(8)
               for e in range(16)}, str(path), metadata={"format": "pt"})
    want = read_header(path)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: read_header(path), range(32)))
    assert all(list(h.offsets.items()) == list(want.offsets.items()) and h.shapes == want.shapes
               and h.metadata == want.metadata for h in got)


def test_a_refused_header_names_the_entry(tmp_path: Path, sample: Path) -> None:
    raw, base, size = _header(sample)
    raw["b"]["shape"] = [3, 6]
    blob = json.dumps(raw).encode()
    data = sample.read_bytes()[base:]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    with pytest.raises(AdapterFormatError, match="tensor 'b' declares shape"):
        read_header(bad)


# ------------------------------------------------------------------------------------------------ read_stacks


def _experts_file(path: Path, experts: int = 12, *, odd: int | None = None) -> dict[str, torch.Tensor]:
    """Per-expert factors saved the way PEFT saves them (keys sorted by name: experts 0, 1, 10, 11, 2, ...).
    ``odd``: that expert's down A gets another shape."""
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(experts):
        p = f"m.layers.0.mlp.experts.{e}"
        tensors[f"{p}.down_proj.lora_A.weight"] = torch.randn(4 if e != odd else 2, 6, generator=g).to(torch.bfloat16)
        tensors[f"{p}.down_proj.lora_B.weight"] = torch.randn(10, 4, generator=g).to(torch.bfloat16)
        tensors[f"{p}.gate_proj.lora_A.weight"] = torch.randn(4, 10, generator=g).to(torch.bfloat16)
        tensors[f"{p}.gate_proj.lora_B.weight"] = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    tensors["m.layers.0.self_attn.q_proj.lora_A.weight"] = torch.randn(3, 3, generator=g)
    save_file(tensors, str(path))
    return tensors


def test_read_stacks_equals_stacking_the_tensors_read_one_by_one_and_counts_only_their_bytes(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import ReadStats, SafetensorsReader

    path = tmp_path / "a.safetensors"
    tensors = _experts_file(path)
    groups = [[f"m.layers.0.mlp.experts.{e}.{proj}.lora_{w}.weight" for e in range(12)]
              for proj in ("gate_proj", "down_proj") for w in "AB"]
    groups.append([f"m.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight" for e in (5, 0, 11)])  # any order
    stats = ReadStats()
    reader = SafetensorsReader(path, stats=stats)
    header_bytes = stats.bytes_read
    got = reader.read_stacks(groups)
    for group, stacked in zip(groups, got):
        assert stacked is not None
        assert torch.equal(stacked, torch.stack([tensors[k] for k in group])) and stacked.dtype == torch.bfloat16
    assert stats.bytes_read - header_bytes == sum(tensors[k].nbytes for k in {k for g in groups for k in g})
    assert stats.tensors_read == sum(len(g) for g in groups)


def test_read_stacks_writes_into_the_memory_it_is_given(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "a.safetensors"
    tensors = _experts_file(path)
    groups = [[f"m.layers.0.mlp.experts.{e}.{proj}.lora_{w}.weight" for e in range(12)]
              for proj in ("gate_proj", "down_proj") for w in "AB"]  # a block's keys: one run of the file
    arena = torch.zeros(4096, dtype=torch.bfloat16)
    given: list[torch.Tensor] = []

    def into(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = 64 + sum(t.numel() for t in given)
        given.append(arena[start:start + math.prod(shape)].view(shape))
        return given[-1]

    got = SafetensorsReader(path).read_stacks(groups, into)
    for group, stacked, mine in zip(groups, got, given):
        assert stacked is mine and stacked.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert torch.equal(stacked, torch.stack([tensors[k] for k in group]))


def test_read_stacks_gives_none_for_what_it_cannot_gather_and_pairs_stay_whole(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "a.safetensors"
    _experts_file(path, odd=3)
    reader = SafetensorsReader(path)
    down_a = [f"m.layers.0.mlp.experts.{e}.down_proj.lora_A.weight" for e in range(12)]  # expert 3's shape differs
    down_b = [f"m.layers.0.mlp.experts.{e}.down_proj.lora_B.weight" for e in range(12)]
    gate_a = [f"m.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight" for e in range(12)]
    mixed = [gate_a[0], down_b[1]]  # other shapes
    dtypes = [gate_a[0], "m.layers.0.self_attn.q_proj.lora_A.weight"]
    calls: list[tuple[int, ...]] = []

    def into(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        calls.append(shape)
        return torch.empty(shape, dtype=dtype)

    got = reader.read_stacks([down_a, down_b, gate_a, mixed, dtypes, []], into, bundle=2)
    assert got[0] is None and got[1] is None  # down A cannot be gathered: its B is not either (bundle=2)
    assert got[2] is None and got[3] is None and got[4] is None and got[5] is None
    assert calls == []  # no memory asked for a pair that is not read
    tensors = _experts_file(path, odd=3)
    sparse = [f"m.layers.0.mlp.experts.{e}.gate_proj.lora_B.weight" for e in (0, 2, 7)]  # a rank's share: 3 runs
    (stacked,) = reader.read_stacks([sparse])
    assert stacked is not None and torch.equal(stacked, torch.stack([tensors[k] for k in sparse]))
    # Experts at no regular stride in the file (expert 3's smaller down A lies between them): still one read each.
    odd_a = "m.layers.0.mlp.experts.3.down_proj.lora_A.weight"
    irregular = [f"m.layers.0.mlp.experts.{e}.gate_proj.lora_B.weight" for e in (0, 3, 4)]
    before = reader.stats.bytes_read
    got = reader.read_stacks([irregular, [odd_a]])
    assert got[0] is not None and torch.equal(got[0], torch.stack([tensors[k] for k in irregular]))
    assert got[1] is not None and torch.equal(got[1][0], tensors[odd_a])
    assert reader.stats.bytes_read - before == tensors[odd_a].nbytes + sum(tensors[k].nbytes for k in irregular)


def test_read_stacks_reads_a_key_asked_for_twice_once(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "a.safetensors"
    tensors = _experts_file(path)
    k0, k1 = (f"m.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight" for e in (0, 1))
    reader = SafetensorsReader(path)
    before = reader.stats.bytes_read
    got = reader.read_stacks([[k0, k1, k0], [k1, k0, k0]])
    assert torch.equal(got[0], torch.stack([tensors[k0], tensors[k1], tensors[k0]]))  # type: ignore[arg-type]
    assert torch.equal(got[1], torch.stack([tensors[k1], tensors[k0], tensors[k0]]))  # type: ignore[arg-type]
    assert reader.stats.bytes_read - before == tensors[k0].nbytes + tensors[k1].nbytes


def test_read_stacks_splits_runs_longer_than_one_call_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_lora_ext.preads as preads_mod
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "a.safetensors"
    tensors = _experts_file(path)
    monkeypatch.setattr(preads_mod, "IOV_MAX", 5)  # a block's 48 adjacent tensors take ten calls
    calls: list[int] = []
    real = os.preadv

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers[:2], offset) if len(buffers) > 2 else real(fd, buffers, offset)  # short reads too

    monkeypatch.setattr(preads_mod.os, "preadv", counted)
    groups = [[f"m.layers.0.mlp.experts.{e}.{proj}.lora_{w}.weight" for e in range(12)]
              for proj in ("gate_proj", "down_proj") for w in "AB"]
    got = SafetensorsReader(path).read_stacks(groups)
    for group, stacked in zip(groups, got):
        assert stacked is not None and torch.equal(stacked, torch.stack([tensors[k] for k in group]))
    assert max(calls) <= 5 and len(calls) > 48 // 5


def test_read_stacks_refuses_a_truncated_file(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "a.safetensors"
    _experts_file(path)
    reader = SafetensorsReader(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])  # the last tensors lose their bytes after the header was read
    groups = [[f"m.layers.0.mlp.experts.{e}.{proj}.lora_{w}.weight" for e in range(12)]
              for proj in ("gate_proj", "down_proj") for w in "AB"]
    with pytest.raises(AdapterFormatError, match="truncated"):
        reader.read_stacks(groups)


def _fused_b_file(path: Path, rows: int = 37, rank: int = 4, experts: int = 6) -> torch.Tensor:
    """A fused 3D B as PEFT stores it, (out, r·E) in (i, e) column order, between two other tensors."""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(rows, rank * experts, generator=g).to(torch.bfloat16)
    save_file({"a.first": torch.randn(5, 3, generator=g), "m.experts.lora_B.weight": b,
               "z.last": torch.randn(2, generator=g)}, str(path))
    return b


def _expert_columns(rank: int, experts: int, ranges: list[tuple[int, int]]) -> Any:
    """``pieces`` for `gather`: experts [s, e) of each range, as (experts, out, r)."""
    return lambda t: [t.view(t.shape[0], rank, experts)[:, :, s:e].permute(2, 0, 1) for s, e in ranges]


@pytest.mark.parametrize("block_rows", [1, 3, 8, 1000])  # one row at a time, blocks with a rest, one block
@pytest.mark.parametrize("ranges", [[(0, 2)], [(1, 2), (3, 4), (5, 6)], [(0, 6)], [(4, 6), (0, 1)]])
def test_gather_equals_the_pieces_of_the_whole_tensor_and_counts_their_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_rows: int, ranges: list[tuple[int, int]]) -> None:
    import vllm_lora_ext.reader as reader_mod
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "b.safetensors"
    b = _fused_b_file(path)
    row_bytes = b.shape[1] * b.element_size()
    monkeypatch.setattr(reader_mod, "_GATHER_BLOCK", block_rows * row_bytes)
    reader = SafetensorsReader(path)
    before = reader.stats.bytes_read
    pieces = _expert_columns(4, 6, ranges)
    got = reader.gather("m.experts.lora_B.weight", pieces)
    want = torch.cat(pieces(b))
    assert got.is_contiguous() and got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert reader.stats.bytes_read - before == want.nbytes  # the kept columns, not the rows read through
    # control: other experts' columns are other values
    assert not torch.equal(got, torch.cat(_expert_columns(4, 6, [(s + 1, e + 1) if e < 6 else (s - 1, e - 1)
                                                                  for s, e in ranges])(b)))


def test_gather_writes_into_the_memory_it_is_given(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "b.safetensors"
    b = _fused_b_file(path)
    arena = torch.zeros(4096, dtype=torch.bfloat16)
    given: list[torch.Tensor] = []

    def into(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        given.append(arena[128:128 + math.prod(shape)].view(shape))
        return given[-1]

    got = SafetensorsReader(path).gather("m.experts.lora_B.weight", _expert_columns(4, 6, [(2, 5)]), into)
    assert got is given[0] and got.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert torch.equal(got, torch.cat(_expert_columns(4, 6, [(2, 5)])(b)))


def test_gather_refuses_pieces_that_do_not_keep_the_rows_and_a_truncated_file(tmp_path: Path) -> None:
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "b.safetensors"
    _fused_b_file(path)
    reader = SafetensorsReader(path)
    key = "m.experts.lora_B.weight"
    with pytest.raises(ValueError, match="second dim"):
        reader.gather(key, lambda t: [t[:2]])  # rows sliced: the blocks would not line up
    with pytest.raises(ValueError, match="second dim"):
        reader.gather(key, lambda t: [])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 300])  # B's last rows go after the header was read
    with pytest.raises(AdapterFormatError, match="truncated"):
        reader.gather(key, _expert_columns(4, 6, [(0, 2)]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_rows", [1, 7, 64, 100000])  # a row at a time, blocks with a rest, one block
@pytest.mark.parametrize(("rows", "cols"), [(96, 128), (37, 6), (5, 1)])  # above and below torch's tiled size
@pytest.mark.parametrize("scale", [None, 2.0, 0.3])
def test_read_transposed_is_the_transpose_of_the_bytes_scaled_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block_rows: int, rows: int, cols: int,
        scale: float | None) -> None:
    """The tensor's bytes as a (rows, cols) matrix, transposed and multiplied as torch.mul does (in float32 for
    16-bit floats, rounded once); the control (not transposed) differs."""
    import vllm_lora_ext.reader as reader_mod
    from vllm_lora_ext.reader import SafetensorsReader

    g = torch.Generator().manual_seed(rows + cols)
    stored = torch.randn(cols, rows, generator=g).to(dtype)  # stored in another shape: only its bytes count
    path = tmp_path / "t.safetensors"
    save_file({"a.first": torch.randn(3, generator=g), "m.b": stored, "z.last": torch.randn(2, generator=g)},
              str(path))
    monkeypatch.setattr(reader_mod, "_GATHER_BLOCK", block_rows * cols * stored.element_size())
    reader = SafetensorsReader(path)
    before = reader.stats.bytes_read
    got = reader.read_transposed("m.b", cols, scale=scale)
    flat = stored.reshape(-1, cols).t()
    want = flat.contiguous() if scale is None else torch.mul(flat, scale)
    assert got is not None and got.is_contiguous() and got.dtype == dtype and got.shape == (cols, rows)
    assert torch.equal(got, want)
    assert reader.stats.bytes_read - before == stored.nbytes
    if cols > 1:
        assert not torch.equal(got, stored.reshape(cols, rows) if scale is None else stored.reshape(cols, rows) * scale)


def test_read_transposed_writes_into_the_memory_it_is_given_and_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    """Into an allocator's memory; ``None`` (nothing read) for another stored dtype; a ``cols`` that does not
    divide the tensor, and a file truncated after its header was read, are refused."""
    from vllm_lora_ext.reader import SafetensorsReader

    path = tmp_path / "b.safetensors"
    b = _fused_b_file(path)  # (37, 24) bfloat16
    arena = torch.zeros(4096, dtype=torch.bfloat16)
    reader = SafetensorsReader(path)
    got = reader.read_transposed("m.experts.lora_B.weight", 6, lambda shape, dt: arena[64:64 + math.prod(shape)]
                                 .view(shape), scale=2.0, dtype=torch.bfloat16)
    assert got is not None and got.data_ptr() == arena[64:].data_ptr()
    assert torch.equal(got, b.reshape(-1, 6).t() * 2.0)
    before = reader.stats.bytes_read
    assert reader.read_transposed("m.experts.lora_B.weight", 6, dtype=torch.float32) is None
    assert reader.stats.bytes_read == before
    with pytest.raises(ValueError, match="do not divide"):
        reader.read_transposed("m.experts.lora_B.weight", 5)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 300])
    with pytest.raises(AdapterFormatError, match="truncated"):
        reader.read_transposed("m.experts.lora_B.weight", 6)


@pytest.mark.parametrize("name, torch_name", [("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")])
def test_fnuz_float8_tensors_read_back_bitwise_as_safetensors_wrote_them(tmp_path: Path, name: str,
                                                                          torch_name: str) -> None:
    from vllm_lora_ext.headers import dtype_by_name
    from vllm_lora_ext.reader import SafetensorsReader

    dt = getattr(torch, torch_name)
    t = torch.randn(4, 6).to(dt)
    save_file({"w": t}, str(tmp_path / "f.safetensors"))
    assert read_header(tmp_path / "f.safetensors").dtypes["w"] == name
    with SafetensorsReader(tmp_path / "f.safetensors") as r:
        got = r.read("w")
    assert got.dtype == dt and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    assert dtype_by_name(name) is dtype_by_name(torch_name) is dt


def test_dtype_by_name_refuses_a_name_outside_the_table() -> None:
    from vllm_lora_ext.headers import dtype_by_name

    with pytest.raises(AdapterFormatError, match="Unknown dtype 'float128'"):
        dtype_by_name("float128")


def _big(path: Path, seed: float = 0.0) -> Path:
    """A safetensors file whose header passes the size kept (64 KiB: 1,024 keys of about 70 bytes of JSON each)."""
    save_file({f"base_model.model.layers.{i}.mlp.experts.{e}.up_proj.lora_A.weight": torch.full((2, 3), seed)
               for i in range(16) for e in range(64)}, str(path), metadata={"format": "pt"})
    return path


def test_a_header_of_the_same_bytes_and_file_size_is_not_parsed_again(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's next adapter of one shape has the same header bytes: kept from the last parse (its file's own path
    and stamp, maps of its own), not decoded and checked again; a file of another size is parsed (and refused)."""
    parses: list[int] = []
    real = reader_module._check_header_in_bulk
    monkeypatch.setattr(reader_module, "_check_header_in_bulk", lambda *a: parses.append(1) or real(*a))
    reader_module._KEPT_HEADERS.clear()
    first = read_header(_big(tmp_path / "a.safetensors", 0.5))
    second_path = _big(tmp_path / "b.safetensors", 2.0)  # other values, the same header bytes
    assert parses == [1]
    second = read_header(second_path)
    assert parses == [1] and second.path == second_path and second.stamp != first.stamp
    assert (second.shapes, second.dtypes, second.offsets, second.nbytes, second.metadata) == \
        (first.shapes, first.dtypes, first.offsets, first.nbytes, first.metadata)
    assert list(second.offsets) == list(first.offsets) and second.shapes is not first.shapes
    second.shapes.clear()  # a caller's maps are its own
    assert read_header(second_path).shapes == first.shapes and parses == [1]
    longer = tmp_path / "c.safetensors"
    longer.write_bytes(second_path.read_bytes() + b"\0\0")  # the same header, two bytes past its last span
    with pytest.raises(AdapterFormatError):
        read_header(longer)
    assert parses == [1, 1]


def test_a_refused_header_is_never_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _big(tmp_path / "a.safetensors")
    raw, base, size = _header(good)
    raw[next(k for k in raw if k != "__metadata__")]["shape"] = [3, 3]  # its span no longer fits its shape
    blob = json.dumps(raw).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + good.read_bytes()[base:])
    reader_module._KEPT_HEADERS.clear()
    for _ in range(2):
        with pytest.raises(AdapterFormatError, match="declares shape"):
            read_header(bad)
    assert not reader_module._KEPT_HEADERS
