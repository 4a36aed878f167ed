"""The two sides of ``vllm-lora verify``, each run in a process of its own: ``python -m
vllm_lora_ext.integration.verify_run {hf,vllm} JOB.json``.

Each side runs in its own process so the GPU memory one holds is free before the other starts, and so the CLI's
process never holds CUDA or vLLM state. The job file (written by ``vllm_lora_ext.cli.verify``) names the model,
the truncation overrides, the prompts and the adapter runs; each side writes its per-position logprobs as JSON.

- ``hf`` runs first. Where the check needs a checkpoint of its own (``--layers K`` on real weights, or random
  weights), it writes it: the first K layers' tensors of the real checkpoint (only the shards that hold them
  are downloaded), or random weights from the (truncated) config, saved in the dtype vLLM serves. vLLM cannot
  load a checkpoint's extra layers under ``hf_overrides={"num_hidden_layers": K}`` (its weight loaders refuse
  unknown layer names), and its own dummy weights cannot be reproduced by transformers, so both sides load this
  one checkpoint and see the same weights by construction. It then tokenizes the prompts, extends each with
  the adapter's greedy continuation (HF + PEFT, float32), and scores every run teacher-forced.
- ``vllm`` loads the same checkpoint with the plugin (``enable_lora``) and scores the same token sequences with
  ``prompt_logprobs``, one ``LoRARequest`` per adapter run (no adapter for the base run).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_lora_ext.errors import VerifyError
from vllm_lora_ext.verification import BASE, FULL, apply_overrides, keep_layers

__all__ = ["main", "run_hf", "run_vllm"]

_SMALL_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.py", "*.jinja"]


def _write_json(path: str | Path, data: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _model_files(job: Mapping[str, Any]) -> Path:
    """A local folder with the model's config, tokenizer and index (hub models: the small files only)."""
    local = Path(os.path.expanduser(job["model"]))
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(job["model"], revision=job.get("revision"), allow_patterns=_SMALL_FILES))


def _shard_file(job: Mapping[str, Any], folder: Path, name: str) -> Path:
    if (folder / name).is_file():
        return folder / name
    if Path(os.path.expanduser(job["model"])).is_dir():
        raise VerifyError(f"Model folder {job['model']!r} has no {name}: --layers reads safetensors weights only.")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(job["model"], name, revision=job.get("revision")))


def write_truncated_checkpoint(job: Mapping[str, Any], out: Path) -> None:
    """Write the first K layers of the real checkpoint (all other tensors kept) with the truncated config.

    Only the shards that hold a kept tensor are read (downloaded, for a hub model); the small files (tokenizer,
    generation config, remote code) are copied.
    """
    from fnmatch import fnmatch

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = _model_files(job)
    index_path = src / "model.safetensors.index.json"
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"] if index_path.is_file() else {}
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    out.mkdir(parents=True, exist_ok=True)
    new_map: dict[str, str] = {}
    for shard in sorted(by_shard) or ["model.safetensors"]:
        wanted = keep_layers(by_shard.get(shard, []), job["layers"])
        if weight_map and not wanted:
            continue  # a shard of later layers only: never read
        with safe_open(str(_shard_file(job, src, shard)), framework="pt") as f:
            keys = wanted or keep_layers(list(f.keys()), job["layers"])
            tensors = {k: f.get_tensor(k) for k in keys}
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        new_map.update(dict.fromkeys(tensors, shard))
    for f in src.iterdir():
        small = any(fnmatch(f.name, pat) for pat in _SMALL_FILES)
        if f.is_file() and small and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    if weight_map:
        _write_json(out / "model.safetensors.index.json", {"metadata": {}, "weight_map": new_map})
    _write_json(out / "config.json", apply_overrides(job["model_config"], job["overrides"]))


def write_random_checkpoint(job: Mapping[str, Any], out: Path) -> None:
    """Write random weights for the (truncated) config, seeded, in the dtype vLLM will serve, with the tokenizer."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", apply_overrides(job["model_config"], job["overrides"]))
    cfg = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=job["trust_remote_code"])
    dtype = getattr(torch, str(job["vllm"]["dtype"])) if job["vllm"]["dtype"] not in ("auto", None) else None
    dtype = dtype or getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(job["seed"])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                              trust_remote_code=job["trust_remote_code"])
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    tok = _tokenizer(job["model"], job.get("revision"), job)
    if tok is not None:
        tok.save_pretrained(str(out))


def _tokenizer(model: str, revision: str | None, job: Mapping[str, Any]) -> Any:
    """The model's tokenizer, or ``None`` where it has none (a bare config folder, as benchmarks use)."""
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(model, revision=revision,
                                                         trust_remote_code=job["trust_remote_code"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    # transformers 5 answers a folder without tokenizer files with an empty tokenizer (a vocabulary of one)
    return tok if len(tok) > 2 else None


def _prompt_ids(job: Mapping[str, Any], tok: Any, vocab: int) -> list[list[int]]:
    """The prompts as token ids; without a tokenizer, seeded random ids (4 prompts of 24 tokens), unless the user
    gave prompts, which then cannot be read."""
    if tok is not None:
        ids = [list(tok(p)["input_ids"]) for p in job["prompts"]]
        if any(len(x) < 1 for x in ids):
            raise VerifyError(f"The tokenizer of {job['model']!r} gives no tokens for a prompt; give other --prompt texts.")
        return ids
    if job.get("prompts_given"):
        raise VerifyError(f"Model {job['model']!r} has no tokenizer, so the --prompt texts cannot be tokenized. Add "
                          f"the tokenizer's files to the model folder, or leave --prompt out (random token ids).")
    g = random.Random(job["seed"])
    return [[g.randrange(3, vocab) for _ in range(24)] for _ in range(4)]


def _check_peft_loaded(result: Any, path: str) -> None:
    """Refuse a reference that would not apply the adapter as stored (PEFT only warns, or says nothing)."""
    unused, unset = list(result.unexpected_keys), list(result.missing_keys)
    if unused or unset:
        what = (f"{len(unused)} keys of the adapter match no module PEFT built (first: {unused[0]!r})" if unused else
                f"PEFT built {len(unset)} LoRA weights the adapter file does not hold (first: {unset[0]!r})")
        raise VerifyError(f"HF + PEFT would not apply the adapter {path!r} as stored: {what}, so its reference would "
                          f"be wrong. Check that the adapter was trained on this model and that its "
                          f"adapter_config.json lists what it targets (per-expert 2D expert keys on a model whose "
                          f"experts are fused: write them as 3D with 'vllm-lora convert --to 3d').")


def _score(model: Any, ids: Sequence[int]) -> list[float]:
    import torch

    with torch.no_grad():
        x = torch.tensor([list(ids)], device=model.device)
        lp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
    return [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


def _greedy(model: Any, ids: Sequence[int], n: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([out], device=model.device)
            out.append(int(model(input_ids=x).logits[0, -1].float().argmax()))
    return out


def run_hf(job: Mapping[str, Any]) -> dict[str, Any]:
    """The HF + PEFT side: write the checkpoint if needed, build the sequences, score every run in float32."""
    import peft
    import torch
    import transformers

    model_dir = job["model"]
    if job["load_format"] == "dummy":
        model_dir = job["checkpoint_dir"]
        write_random_checkpoint(job, Path(model_dir))
    elif job["overrides"]:
        model_dir = job["checkpoint_dir"]
        write_truncated_checkpoint(job, Path(model_dir))
    revision = job.get("revision") if model_dir == job["model"] else None
    tok = _tokenizer(model_dir, revision, job)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, revision=revision, dtype=torch.float32,
                                                             device_map="auto",
                                                             trust_remote_code=job["trust_remote_code"])
    runs: dict[str, str] = job["hf_adapters"]
    names = {run: f"run{i}" for i, run in enumerate(runs)}  # PEFT adapter names may not hold '.' or spaces
    model = peft.PeftModel.from_pretrained(base, runs[FULL], adapter_name=names[FULL])
    for run, path in runs.items():  # the full adapter again too: load_adapter returns what matched
        _check_peft_loaded(model.load_adapter(path, adapter_name=names[run]), path)
    model.eval()
    model.set_adapter(names[FULL])
    vocab = int(model.get_input_embeddings().weight.shape[0])
    sequences = [_greedy(model, ids, job["tokens"]) for ids in _prompt_ids(job, tok, vocab)]
    logprobs: dict[str, list[list[float]]] = {}
    with model.disable_adapter():
        logprobs[BASE] = [_score(model, s) for s in sequences]
    for run in runs:
        model.set_adapter(names[run])
        logprobs[run] = [_score(model, s) for s in sequences]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    versions = {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}
    return {"model_dir": str(model_dir), "sequences": sequences, "logprobs": logprobs, "device": device,
            "versions": versions, "tokenizer": tok is not None}


def run_vllm(job: Mapping[str, Any], hf: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM side: the same checkpoint and token sequences, one LoRA request per run, ``prompt_logprobs``."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    opts = job["vllm"]
    model_dir = hf["model_dir"]
    sequences: list[list[int]] = hf["sequences"]
    runs: dict[str, str] = job["vllm_adapters"]
    # Token ids in, logprobs out: vLLM needs no tokenizer (and a bare config folder has none).
    llm = LLM(model=model_dir, revision=job.get("revision") if model_dir == job["model"] else None,
              trust_remote_code=job["trust_remote_code"], skip_tokenizer_init=True, enable_lora=True,
              max_lora_rank=opts["max_lora_rank"], max_loras=1, max_cpu_loras=len(runs) + 1,
              enforce_eager=opts["enforce_eager"], dtype=opts["dtype"], quantization=opts["quantization"],
              gpu_memory_utilization=opts["gpu_memory_utilization"], tensor_parallel_size=opts["tensor_parallel_size"],
              max_model_len=max(map(len, sequences)) + 16, seed=job["seed"])
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=s) for s in sequences]
    logprobs: dict[str, list[list[float]]] = {}
    requests: list[tuple[str, Any]] = [(BASE, None)]
    requests += [(run, LoRARequest(lora_name=f"verify-{i}", lora_int_id=i, lora_path=path))
                 for i, (run, path) in enumerate(runs.items(), 1)]
    for run, req in requests:
        outs = llm.generate(prompts, params, lora_request=req, use_tqdm=False)
        logprobs[run] = [[float(o.prompt_logprobs[i][t].logprob) for i, t in enumerate(s) if i > 0]
                         for o, s in zip(outs, sequences)]
    return {"logprobs": logprobs, "versions": {"vllm": vllm.__version__}}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one side: ``hf JOB`` or ``vllm JOB``; the job names where the result goes."""
    side, job_path = (sys.argv[1:] if argv is None else list(argv))[:2]
    job = json.loads(Path(job_path).read_text())
    if side == "hf":
        _write_json(job["hf_out"], run_hf(job))
    elif side == "vllm":
        hf = json.loads(Path(job["hf_out"]).read_text())
        _write_json(job["vllm_out"], run_vllm(job, hf))
    else:
        raise VerifyError(f"Unknown side {side!r}: give hf or vllm.")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
