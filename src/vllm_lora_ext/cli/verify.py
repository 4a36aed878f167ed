"""``vllm-lora verify MODEL ADAPTER``: does vLLM, with this plugin, apply the adapter as HF + PEFT does? (GPU)

Both sides score the same token sequences teacher-forced (the prompts plus the adapter's greedy continuation):
vLLM with ``prompt_logprobs``, HF transformers + PEFT in float32. The command prints the mean and max
``|Δ logprob|`` against the base model's own noise (vLLM vs HF, no adapter), the no-adapter control, and per
module group what removing it changes on each side, then one ``verdict: PASS ...`` or ``verdict: FAIL ...``
line. Exit codes: 0 PASS, 1 FAIL (or a side failed), 2 usage error or no CUDA GPU.

This process never imports vLLM, transformers or PEFT: each side runs in a process of its own
(``vllm_lora_ext.integration.verify_run``), HF first, so each has the GPU to itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_lora_ext.cli._args import positive_int
from vllm_lora_ext.constants import VLLM_MAX_LORA_RANK_CHOICES, max_lora_rank_for
from vllm_lora_ext.errors import AdapterCompatibilityError, VerifyError
from vllm_lora_ext.verification import (FULL, Thresholds, VerifyReport, ablation_name, adapter_groups,
                                        check_layers_cover, judge, keep_layers, truncate_config, without_group)

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog because",
    "In a mixture-of-experts model, each token is routed to",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: What is the capital of France?\nAnswer:",
)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a fraction in (0, 1]")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty prompt has nothing to score; give some text")
    return text


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="check on a GPU that vLLM applies an adapter as HF + PEFT does (start here "
                                      "when LoRA outputs look wrong)")
    p.add_argument("model", metavar="MODEL", help="the base model: hub id (org/model or hf:org/model) or local folder")
    p.add_argument("adapter", metavar="ADAPTER",
                   help="the adapter as trained (PEFT folder with adapter_config.json, or hf: source)")
    p.add_argument("--layers", type=positive_int, default=None, metavar="K",
                   help="keep only the first K decoder layers on both sides (adapter keys of later layers dropped)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights (seeded), written once and loaded by both sides")
    p.add_argument("--served", default=None, metavar="SOURCE",
                   help="the adapter vLLM serves, if not ADAPTER itself (e.g. the output of convert or mix)")
    p.add_argument("--prompt", action="append", type=_prompt, default=None, help="a prompt to score (repeatable)")
    p.add_argument("--tokens", type=positive_int, default=16, help="greedy tokens appended to each prompt (default 16)")
    p.add_argument("--tolerance", type=_positive, default=None,
                   help="mean |Δ logprob| allowed (default: max(3 x base noise, 0.02))")
    p.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (default auto)")
    p.add_argument("--quantization", default=None, help="vLLM's --quantization (the HF side stays float32)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="vLLM's tensor-parallel size (default 1)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.8,
                   help="the share of GPU memory vLLM may take (default 0.8)")
    p.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (default: eager)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model repo's own code in vLLM and transformers (its architecture needs it)")
    p.add_argument("--revision", default=None, help="the model's revision on the hub")
    p.add_argument("--seed", type=int, default=0, help="seed of both sides (default 0)")
    p.add_argument("--workdir", default=None, help="keep the checkpoint, adapters and logs here (default: temporary)")
    p.set_defaults(func=run)


def gpu_problem() -> str | None:
    """Return why verify cannot run here (no CUDA GPU, missing packages: all of it), or ``None``."""
    import torch

    problems = []
    if not torch.cuda.is_available():
        problems.append("it runs vLLM and HF transformers on a CUDA GPU, and none is visible here "
                        "(torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU")
    missing = [m for m in ("vllm", "transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        problems.append(f"it needs {', '.join(missing)}: pip install 'vllm-lora-ext[vllm]' transformers peft")
    return f"vllm-lora verify cannot run here: {'; and '.join(problems)}." if problems else None


def _hub_or_path(model: str) -> tuple[str, str]:
    """(what vLLM and transformers take, what ``load_base_config`` takes) for MODEL."""
    bare = model[3:] if model.startswith("hf:") else model
    local = os.path.expanduser(model)
    if not model.startswith("hf:") and os.path.exists(local):
        return str(Path(local)), str(Path(local))
    return bare, f"hf:{bare}"


def _read_adapter(source: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    from safetensors.torch import load_file

    from vllm_lora_ext.sources import resolve_source

    resolved = resolve_source(source)
    if resolved.is_pickle or resolved.config_path is None:
        raise VerifyError(f"Adapter {source!r}: verify needs safetensors weights with an adapter_config.json beside "
                          f"them (HF + PEFT builds its reference from that config). Add the config, or save the "
                          f"adapter with PEFT's save_pretrained.")
    config = json.loads(resolved.config_path.read_text())
    return load_file(str(resolved.weights_path)), config, resolved.identity


def _max_rank(config: Mapping[str, Any], source: str) -> int:
    ranks = [int(config.get("r", 8)), *[int(v) for v in (config.get("rank_pattern") or {}).values()]]
    fit = max_lora_rank_for(max(ranks))
    if fit is None:
        raise AdapterCompatibilityError(f"Adapter {source!r} has rank {max(ranks)}, above the largest max_lora_rank "
                                        f"vLLM accepts ({VLLM_MAX_LORA_RANK_CHOICES[-1]}).", adapter=source)
    return fit


def _write_runs(tensors: Mapping[str, Any], config: Mapping[str, Any], groups: Sequence[str],
                out: Path) -> dict[str, str]:
    """Write the adapter and, per group, the adapter without it; return ``{run: folder}``."""
    from safetensors.torch import save_file

    runs = {FULL: dict(tensors), **{ablation_name(g): without_group(tensors, g) for g in groups}}
    paths = {}
    for i, (run, ts) in enumerate(runs.items()):
        folder = out / f"run{i}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        paths[run] = str(folder)
    return paths


def _side(side: str, job_path: Path, log: Path, args: argparse.Namespace) -> None:
    label = {"hf": "HF transformers + PEFT (float32)", "vllm": "vLLM with the plugin"}[side]
    verbose = bool(getattr(args, "verbose", 0))
    if not getattr(args, "quiet", False):
        print(f"verify: scoring with {label} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "vllm_lora_ext.integration.verify_run", side, str(job_path)]
    with open(log, "wb") as f:
        done = subprocess.run(cmd, stdout=None if verbose else f, stderr=subprocess.STDOUT if not verbose else None,
                              check=False)
    if done.returncode != 0:
        text = log.read_text(errors="replace") if log.exists() else ""
        cause = root_cause(text)
        hint = (" Another process may hold the GPU's memory: free it, or lower --gpu-memory-utilization."
                if cause and "memory" in cause.lower() else "")
        raise VerifyError(f"The {label} side failed (exit {done.returncode})"
                          + (f": {cause}." if cause else ".") + hint
                          + f" Its log is {log}. Last lines: {text[-1200:]}")


_WRAPPERS = ("Engine core initialization failed",)


def root_cause(log_text: str) -> str | None:
    """The first exception line of a side's log (``ValueError: No available memory ...``), skipping vLLM's wrapper
    errors that only say a worker failed; ``None`` when the log has none."""
    for line in log_text.splitlines():
        m = re.search(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", line)
        if m and not any(w in line for w in _WRAPPERS):
            return f"{m.group(1)}: {m.group(2).strip()}"[:400]
    return None


def prepare_job(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[str]]:
    """Read the model's config and the adapter(s), cut them to ``--layers``, and write the adapter runs under ``work``
    (the adapter, and the adapter without each module group, for each side). Needs no GPU.

    Returns:
        `tuple[dict, list[str]]`: the job both sides read, and the module groups ablated.

    Raises:
        [`VerifyError`], [`AdapterCompatibilityError`]: a config or adapter verify cannot check (the message says why).
    """
    from vllm_lora_ext.offline_ops import load_base_config

    model, config_src = _hub_or_path(args.model)
    model_config = load_base_config(config_src + (f"@{args.revision}" if args.revision and
                                                  config_src.startswith("hf:") else ""))
    overrides = truncate_config(model_config, args.layers) if args.layers is not None else {}
    trained, trained_cfg, trained_id = _read_adapter(args.adapter)
    served, served_cfg, served_id = _read_adapter(args.served) if args.served else (trained, trained_cfg, trained_id)
    if overrides:
        check_layers_cover(list(trained), args.layers, adapter=trained_id)
        trained = {k: trained[k] for k in keep_layers(list(trained), args.layers)}
        served = {k: served[k] for k in keep_layers(list(served), args.layers)}
    groups = sorted({*adapter_groups(list(trained)), *adapter_groups(list(served))})
    if not groups:
        raise VerifyError(f"Adapter {trained_id!r} holds no LoRA weights (lora_A/lora_B) to check.")
    hf_runs = _write_runs(trained, trained_cfg, groups, work / "adapters" / "trained")
    vllm_runs = (hf_runs if not args.served else _write_runs(served, served_cfg, groups, work / "adapters" / "served"))
    job = {
        "model": model, "model_config": model_config, "overrides": overrides, "layers": args.layers,
        "load_format": args.load_format, "checkpoint_dir": str(work / "model"), "revision": args.revision,
        "prompts": list(args.prompt or DEFAULT_PROMPTS), "prompts_given": bool(args.prompt), "tokens": args.tokens,
        "seed": args.seed,
        "trust_remote_code": args.trust_remote_code, "hf_adapters": hf_runs, "vllm_adapters": vllm_runs,
        "hf_out": str(work / "hf.json"), "vllm_out": str(work / "vllm.json"),
        "vllm": {"dtype": args.dtype, "quantization": args.quantization, "enforce_eager": not args.cuda_graphs,
                 "tensor_parallel_size": args.tensor_parallel_size,
                 "gpu_memory_utilization": args.gpu_memory_utilization,
                 "max_lora_rank": max(_max_rank(trained_cfg, trained_id), _max_rank(served_cfg, served_id))},
        "adapter": trained_id, "served": served_id,
        "group_keys": {g: len(adapter_groups(list(trained)).get(g, [])) for g in groups},
    }
    return job, groups


def format_report(report: VerifyReport) -> str:
    """The human-readable table; the verdict line comes last."""
    rows = [("base noise (vLLM vs HF, no adapter)", report.noise), ("adapter (vLLM vs HF + PEFT)", report.gap),
            ("no-adapter control (vLLM base vs HF + PEFT)", report.control)]
    lines = [f"{'':46} {'mean |Δ|':>9} {'max |Δ|':>9}"]
    lines += [f"{name:46} {g.mean:9.4f} {g.max:9.4f}" for name, g in rows]
    lines.append(f"tolerance (mean) {report.tolerance:.4f} over {report.gap.positions} positions")
    lines.append("")
    lines.append(f"{'module group (removed)':28} {'HF effect':>10} {'vLLM effect':>12} {'gap w/o it':>11}  status")
    for c in report.groups:
        lines.append(f"{c.group:28} {c.effect_hf.mean:10.4f} {c.effect_vllm.mean:12.4f} {c.gap_without.mean:11.4f}  "
                     f"{c.status}")
    lines.append(report.verdict_line())
    return "\n".join(lines)


def _compare(args: argparse.Namespace, work: Path, job: dict[str, Any], groups: list[str]) -> VerifyReport:
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))
    _side("hf", job_path, work / "hf.log", args)
    _side("vllm", job_path, work / "vllm.log", args)
    hf, vl = json.loads((work / "hf.json").read_text()), json.loads((work / "vllm.json").read_text())
    report = judge(hf["logprobs"], vl["logprobs"], groups, thresholds=Thresholds(tolerance=args.tolerance))
    extra = {"model": args.model, "adapter": job["adapter"], "served": job["served"], "layers": args.layers,
             "load_format": args.load_format, "sequences": len(hf["sequences"]), "tokens": args.tokens,
             "group_keys": job["group_keys"], "device": hf.get("device"),
             "versions": {**hf.get("versions", {}), **vl.get("versions", {})}}
    return dataclasses.replace(report, extra=extra)


def _resolve_adapters(args: argparse.Namespace, *, remote: bool) -> None:
    """Resolve ``ADAPTER`` and ``--served``: without ``remote`` the local ones (cheap, so a mistyped path answers at
    once) and the syntax of the ``hf:`` ones; with it the ``hf:`` ones, a download, run only once the GPU check
    passed (a user with no GPU, or offline, learns that first, not after a download or a silent Hub's timeout)."""
    from vllm_lora_ext.cli._args import resolve_offline
    from vllm_lora_ext.sources import parse_source

    for source in (args.adapter, args.served):
        if source and (parse_source(source).kind == "hf") == remote:
            resolve_offline(source)


def run(args: argparse.Namespace) -> int:
    from vllm_lora_ext.cli._args import one_line
    from vllm_lora_ext.errors import VllmLoraExtError

    try:  # usage errors exit 2, as a FAIL verdict exits 1
        _resolve_adapters(args, remote=False)  # a mistyped adapter answers here, not on the GPU machine
        if args.tokens > 512:
            raise VerifyError(f"--tokens {args.tokens}: give at most 512 tokens to generate after each prompt.")
        json_path = Path(os.path.expanduser(args.json)).absolute() if args.json else None
        if json_path is not None and (json_path.is_dir() or not (json_path.parent.is_dir()
                                                                 and os.access(json_path.parent, os.W_OK))):
            raise VerifyError(f"--json {args.json}: it is a folder, or its folder does not exist or cannot be "
                              f"written. Name a file in a folder that exists, before the GPU run is spent.")
        problem = gpu_problem()
        if problem is None:
            _resolve_adapters(args, remote=True)
    except VllmLoraExtError as err:
        problem = one_line(err)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    temporary = not args.workdir
    work = (Path(tempfile.mkdtemp(prefix="vllm-lora-verify-")) if temporary
            else Path(os.path.expanduser(args.workdir)).absolute())
    work.mkdir(parents=True, exist_ok=True)
    try:
        job, groups = prepare_job(args, work)  # (no side has run: what it refuses is the input's, exit 2)
    except BaseException as err:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
        if not isinstance(err, VllmLoraExtError):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        report = _compare(args, work, job, groups)
    except BaseException:
        if temporary and (work / "job.json").exists():
            print(f"verify: kept {work} (the job, both sides' logs)", file=sys.stderr)
        elif temporary:
            shutil.rmtree(work, ignore_errors=True)
        raise
    if temporary:
        shutil.rmtree(work, ignore_errors=True)
    print(format_report(report))
    if args.json:
        Path(os.path.expanduser(args.json)).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.passed else 1


__all__ = ["DEFAULT_PROMPTS", "add_parser", "format_report", "gpu_problem", "prepare_job", "run"]
