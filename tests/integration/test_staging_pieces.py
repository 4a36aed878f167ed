"""The staging copy's chunking (runs without a GPU): the chunks rebuild the GPU buffer's image exactly."""

from __future__ import annotations

import random

import torch

from vllm_lora_ext.integration.staging import _pieces


def test_chunks_cover_every_region_byte_at_its_offset_and_stay_within_a_chunk() -> None:
    rng = random.Random(0)
    for chunk in (7, 64, 1000):
        regions, offset = [], 0
        for _ in range(40):
            n = rng.choice([0, 1, 5, 63, 64, 65, 300, 2500])
            if n:
                regions.append((offset, torch.randint(0, 255, (n,), dtype=torch.uint8)))
            offset += -(-n // 16) * 16 + rng.choice([0, 16])
        want = torch.zeros(offset + 1, dtype=torch.uint8)
        data = torch.zeros(offset + 1, dtype=torch.bool)  # the padding between regions is free to hold anything
        for off, src in regions:
            want[off:off + src.numel()] = src
            data[off:off + src.numel()] = True
        got = torch.zeros_like(want)
        covered = 0
        for start, batch in _pieces(regions, chunk):
            span = batch[-1][0] + batch[-1][1].numel()
            assert span <= chunk
            window = torch.zeros(chunk, dtype=torch.uint8)
            for rel, piece in batch:
                window[rel:rel + piece.numel()] = piece
                covered += piece.numel()
            mask = data[start:start + span]
            got[start:start + span][mask] = window[:span][mask]
        assert covered == sum(src.numel() for _, src in regions)
        assert torch.equal(got, want)


def test_tensors_holding_the_same_bytes_share_one_region_and_are_sized_once() -> None:
    from vllm_lora_ext.integration.staging import _ALIGN, _layout

    memory = torch.arange(4 * 8 * 16, dtype=torch.bfloat16).reshape(4, 8, 16)
    as_gate, as_up = memory.view(4, 8, 16), memory.view(4, 8, 16)  # a fused A serving gate and up: two objects
    other = memory.clone()  # equal values, other memory: its own region
    strided = memory.transpose(1, 2)  # not contiguous: copied into a region of its own
    total, regions, places = _layout([as_gate, other, as_up, strided, as_gate])
    region = -(-memory.nbytes // _ALIGN) * _ALIGN
    assert total == 3 * region and len(regions) == 3
    assert places == [0, region, 0, 2 * region, 0]
    assert regions[0][1] is as_gate and regions[1][1] is other and regions[2][1] is strided
