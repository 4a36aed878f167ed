"""Tiny random models (dense Llama, Qwen3-MoE) with a trained-on-the-fly tokenizer, and the HF reference.

Everything is built in code, seeded: a byte-level BPE tokenizer trained with ``tokenizers`` on a
generated corpus, random-weight transformers models (``initializer_range`` large enough that greedy
outputs are not degenerate), and PEFT adapters with ``init_lora_weights=False`` (non-zero deltas).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB = 512


def build_tokenizer(folder: Path, vocab: int = 400) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["lora", "adapter", "expert", "mixture", "vllm", "serve", "token", "model", "weight", "delta", "rank",
             "alpha", "hub", "revision", "commit", "layer", "gate", "down", "up", "query", "key", "value"]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    return fast


ROUTER_SCALE = 8.0


def _save(model: Any, folder: Path) -> Path:
    # Random routers give near-tied expert scores; bf16 vs fp32 then picks different experts and the
    # comparison measures tie-breaking, not LoRA. Scaled routers make the top-k choice decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
                p.mul_(ROUTER_SCALE)
    model.to(torch.bfloat16).save_pretrained(str(folder), safe_serialization=True)
    build_tokenizer(folder)
    return folder


def build_dense(folder: Path, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return _save(transformers.LlamaForCausalLM(cfg), folder)


def build_qwen3_moe(folder: Path, seed: int = 0, *, num_experts: int = 8) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=num_experts, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=512,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return _save(transformers.Qwen3MoeForCausalLM(cfg), folder)


def build_mixtral(folder: Path, seed: int = 0, *, num_experts: int = 8) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=num_experts, num_experts_per_tok=2,
        max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return _save(transformers.MixtralForCausalLM(cfg), folder)


def build_gpt_oss(folder: Path, seed: int = 0, *, num_experts: int = 8) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=num_experts, num_experts_per_tok=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
                         "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False},
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return _save(transformers.GptOssForCausalLM(cfg), folder)


def build_peft_adapter(model_dir: Path, folder: Path, *, seed: int, rank: int = 8, alpha: float = 16,
                       targets: Sequence[str] | None = None, target_parameters: Sequence[str] | None = None) -> Path:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"r": rank, "lora_alpha": alpha, "init_lora_weights": False,
                              "target_modules": list(targets) if targets else []}
    if target_parameters:
        kwargs["target_parameters"] = list(target_parameters)
    pm = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    pm.save_pretrained(str(folder))
    return folder


def build_adapters(model_dir: Path, roots: Path, names: Sequence[str], *, seed: int, targets: Sequence[str]) -> None:
    """One PEFT adapter (rank 8, alpha 16) per name, in ``roots / name``, seeded ``seed``, ``seed + 1``, ..."""
    for i, name in enumerate(names):
        build_peft_adapter(model_dir, roots / name, seed=seed + i, rank=8, alpha=16, targets=targets)


class HFReference:
    """HF transformers (+ PEFT) on the GPU in float32: greedy continuations and teacher-forced logprobs."""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None, *, device: str = "cuda",
                 mix: dict[Path, float] | None = None) -> None:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            import peft

            model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
        elif mix:  # PEFT's exact weighted combination: add_weighted_adapter(..., combination_type="cat")
            import peft

            paths = list(mix)
            model = peft.PeftModel.from_pretrained(model, str(paths[0]), adapter_name="m0")
            for i, p in enumerate(paths[1:], 1):
                model.load_adapter(str(p), adapter_name=f"m{i}")
            model.add_weighted_adapter([f"m{i}" for i in range(len(paths))], list(mix.values()), adapter_name="mix",
                                       combination_type="cat")
            model.set_adapter("mix")
        self.model = model.to(device).eval()
        self.device = device

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], device=self.device)
        return self.model(input_ids=x).logits[0].float()

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]

    @torch.no_grad()
    def token_logprobs(self, prompt: Sequence[int], continuation: Sequence[int]) -> list[float]:
        ids = list(prompt) + list(continuation)
        lp = torch.log_softmax(self.logits(ids), dim=-1)
        return [float(lp[len(prompt) + i - 1, t]) for i, t in enumerate(continuation)]


def vllm_token_logprobs(llm: Any, prompt: Sequence[int], continuation: Sequence[int], lora_request: Any = None) -> list[float]:
    """Teacher-forced logprobs of ``continuation`` after ``prompt`` from vLLM (``prompt_logprobs``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = list(prompt) + list(continuation)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       lora_request=lora_request, use_tqdm=False)[0]
    plp = out.prompt_logprobs
    return [float(plp[len(prompt) + i][t].logprob) for i, t in enumerate(continuation)]


def logprob_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean and largest |delta| between two sets of per-position logprobs, and how many positions."""
    diffs = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "positions": len(diffs)}


def vllm_greedy(llm: Any, prompts: Sequence[Sequence[int]], n: int, lora_request: Any = None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        lora_request=lora_request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def prompts(n: int = 4, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[1] + [g.randrange(3, 400) for _ in range(length - 1)] for _ in range(n)]
