"""What mix and convert write, as PEFT reads it: an embedding's factor names, and a config's lora_alpha."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factories import make_peft_adapter, tiny_llama
from moe_factories import make_truth, write_moe_adapter
from vllm_lora_ext.cli import main

E, H, I, R = 8, 32, 12, 4
BASE = {"num_experts": E, "hidden_size": H, "moe_intermediate_size": I}


def test_mix_and_convert_keep_an_embeddings_factor_names_so_peft_applies_them(tmp_path: Path) -> None:
    """PEFT stores an embedding's factors as ``lora_embedding_A``/``_B`` and reads only those for an embedding layer:
    a mix (or a conversion) that wrote ``lora_A.weight`` lost the embedding's delta in PEFT, with exit 0."""
    import peft
    from safetensors.torch import save_file

    make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["embed_tokens", "q_proj"], rank=4, alpha=8, seed=1)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if "base_layer" not in k}, str(weights))  # factors
    assert main(["mix", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "mix")]) == 0
    assert main(["mix", f"{tmp_path / 'a'}=0.5", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "twice")]) == 0

    def delta(folder: Path) -> torch.Tensor:
        model = peft.PeftModel.from_pretrained(tiny_llama(), str(folder))
        return model.merge_and_unload().model.embed_tokens.weight - tiny_llama().model.embed_tokens.weight

    whole = delta(tmp_path / "a")
    assert whole.abs().max() > 0
    torch.testing.assert_close(delta(tmp_path / "mix"), 0.5 * whole, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(delta(tmp_path / "twice"), whole, rtol=1e-4, atol=1e-6)
    # convert (an MoE adapter with an embedding beside its experts): the embedding's keys as they were, bit for bit
    emb = {f"base_model.model.model.embed_tokens.lora_embedding_{w}": torch.randn(*s) for w, s in (("A", (R, 32)),
                                                                                                 ("B", (H, R)))}
    write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, 0)], ["2d"], rank=R, alpha=16, extra=emb)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["convert", str(tmp_path / "moe"), "--to", "3d", "-o", str(tmp_path / "moe3d"),
                 "--base-config", str(tmp_path / "config.json")]) == 0
    written = load_file(str(tmp_path / "moe3d" / "adapter_model.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in emb.items())


def test_a_config_without_lora_alpha_is_refused_not_read_as_alpha_r(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """PEFT reads a missing ``lora_alpha`` as 8 and vLLM refuses it; it was read as alpha = r (scaling 1), so a mix
    of an r4 adapter was half of what PEFT applies, with exit 0."""
    from factories import dense_tensors, llama_shapes, lora_config, write_adapter

    cfg = lora_config(4, 8, ("q_proj", "v_proj"))
    del cfg["lora_alpha"]
    write_adapter(tmp_path / "a", dense_tensors(llama_shapes(), rank=4, seed=3), cfg)
    for argv in (["inspect", str(tmp_path / "a")], ["mix", f"{tmp_path / 'a'}=1", "-o", str(tmp_path / "m")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "has no 'lora_alpha', so its scaling is unknown: PEFT reads a missing one as 8" in err, err
    assert not (tmp_path / "m").exists()
