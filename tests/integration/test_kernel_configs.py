"""vLLM's own lookup reads the shipped LoRA kernel tables for any shape and slice count, never its default."""

from __future__ import annotations

import itertools
import json

import pytest

from vllm_lora_ext.kernel_configs import FOLDER, config_file_names, shipped_gpus

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("stem", shipped_gpus() or ["(none shipped)"])
def test_vllm_finds_a_tuned_config_for_every_shape(stem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if stem == "(none shipped)":
        pytest.skip("no tuned configs in the package")
    import torch
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(FOLDER))
    # vLLM names the file after torch.cuda.get_device_name(); the stem is already in that form.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: stem)
    tables = {name: json.loads((FOLDER / name).read_text()) for name in config_file_names(stem)}
    leaves = {name: [json.dumps(c, sort_keys=True) for s in t.values() for ms in s.values() for ks in ms.values()
                     for ns in ks.values() for c in ns.values()] for name, t in tables.items()}
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        for op, add_inputs, name in (("shrink", None, config_file_names(stem)[0]),
                                     ("expand", True, config_file_names(stem)[1]),
                                     ("expand", False, config_file_names(stem)[2])):
            for slots, slices, m, hidden, rank in itertools.product((1, 4, 16, 32, 64, 128), range(1, 17),
                                                                     (1, 3, 32, 100, 512, 8192, 65536),
                                                                     (896, 2048, 5120, 14336, 29568), (8, 16, 64, 256)):
                config = utils.get_lora_op_configs(op, slots + 1, m, hidden, rank, slices, add_inputs=add_inputs)
                assert json.dumps(config, sort_keys=True) in leaves[name], (op, slots, slices, m, hidden, rank)
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
