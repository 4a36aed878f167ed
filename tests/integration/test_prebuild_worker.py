"""Background adapter builds with real vLLM objects: probes through the patched add_adapter, the step takes the build.

The worker side is vLLM's own ``WorkerLoRAManager`` (patched ``add_adapter``/``_load_adapter``);
the server side is the plugin's routes with an engine client that hands ``add_lora`` to that worker
from a thread, as the engine core does between steps.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from factories import make_peft_adapter, tiny_llama
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.integration import plugin, server
from vllm_lora_ext.integration.prebuild import probe_for, table

pytestmark = pytest.mark.vllm


def _request(path: Path | str, name: str = "a", lora_id: int = 7) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))


def _same(a: Any, b: Any) -> None:
    assert sorted(a.loras) == sorted(b.loras)
    for name in a.loras:
        assert torch.equal(a.loras[name].lora_a, b.loras[name].lora_a)
        assert torch.equal(a.loras[name].lora_b, b.loras[name].lora_b)
        assert a.loras[name].scaling == b.loras[name].scaling


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_llama(), tmp_path_factory.mktemp("pre") / "a", targets=["q_proj", "v_proj"],
                             rank=8, alpha=16)


def _probe_until_built(manager: Any, req: Any) -> int:
    from vllm.lora.worker_manager import WorkerLoRAManager

    polls = 1
    while not WorkerLoRAManager.add_adapter(manager, probe_for(req)):
        polls += 1
        assert polls < 5000
        threading.Event().wait(0.002)
    return polls


def test_a_probe_builds_in_the_background_and_the_step_takes_that_build(worker_manager: Any, adapter: Path) -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    plugin.register()
    req = _request(adapter)
    reference = WorkerLoRAManager._load_adapter.__wrapped__(worker_manager, req)  # vLLM's own, synchronous
    builder: list[str] = []
    import vllm_lora_ext.integration.loader as loader

    original = loader.load_lora_model

    def spy(manager: Any, lora_request: Any, **kwargs: Any) -> Any:
        builder.append(threading.current_thread().name)
        return original(manager, lora_request, **kwargs)

    loader.load_lora_model = spy  # type: ignore[assignment]
    try:
        assert _probe_until_built(worker_manager, req) >= 1
        built = WorkerLoRAManager._load_adapter(worker_manager, req)
    finally:
        loader.load_lora_model = original  # type: ignore[assignment]
    assert len(builder) == 1 and builder[0].startswith("vllm-lora-ext-build")  # built once, off the caller's thread
    assert built.id == req.lora_int_id
    _same(built, reference)
    assert table(worker_manager).state(str(adapter)) == "absent"  # handed to the engine once


def test_a_failing_build_reaches_the_probe_with_the_loaders_message(worker_manager: Any, tmp_path: Path) -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    plugin.register()
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    req = _request(big, name="big")
    with pytest.raises(AdapterCompatibilityError, match="max_lora_rank"):
        _probe_until_built(worker_manager, req)


class _EngineOnWorker:
    """``add_lora`` handed to a real worker manager from another thread (the engine core's loop)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))
        self.registered: list[Any] = []
        self.probes = 0

    async def add_lora(self, req: Any) -> bool:
        from vllm.lora.worker_manager import WorkerLoRAManager

        if req.lora_path.startswith(PREBUILD_PREFIX):
            self.probes += 1
            return bool(await asyncio.to_thread(WorkerLoRAManager.add_adapter, self.manager, req))
        self.registered.append(await asyncio.to_thread(WorkerLoRAManager._load_adapter, self.manager, req))
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True


def test_concurrent_requests_for_a_new_mix_share_one_background_build(worker_manager: Any, adapter: Path,
                                                                     tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.lora.request import LoRARequest

    plugin.register()
    server.reset_registry()
    other = make_peft_adapter(tiny_llama(), tmp_path / "b", targets=["q_proj"], rank=4, alpha=8)
    engine = _EngineOnWorker(worker_manager)
    models = SimpleNamespace(lora_requests={"a": LoRARequest("a", 1, str(adapter)), "b": LoRARequest("b", 2, str(other))},
                             lora_resolver_lock=defaultdict(asyncio.Lock), engine_client=engine)
    serving = SimpleNamespace(models=models, _is_model_supported=lambda m: not m or m == "base")

    async def two() -> list[Any]:
        reqs = [CompletionRequest(prompt="hi", model="base", adapters=["a", "b"], adapter_weights=[0.5, 0.5])
                for _ in range(2)]
        return [*await asyncio.gather(*(server.route_adapters(serving, r) for r in reqs)), *reqs]

    try:
        out = asyncio.run(two())
    finally:
        server.reset_registry()
    assert out[:2] == [None, None] and out[2].model == out[3].model
    assert table(worker_manager).builds_started == 1  # one background build for both requests
    assert len(engine.registered) == 1 and engine.probes >= 1  # registered once, from the finished build


def test_a_client_cannot_send_a_probe_path(tmp_path: Path) -> None:
    from vllm_lora_ext.errors import AdapterSourceError

    with pytest.raises(AdapterSourceError, match="only the server uses"):
        server.check_client_adapter("x", PREBUILD_PREFIX + str(tmp_path))


def test_offline_prefetch_pins_the_source_and_the_later_load_takes_the_background_build(worker_manager: Any,
                                                                                          adapter: Path) -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_lora_ext.integration.offline import prefetch

    plugin.register()
    sent: list[Any] = []

    class _Engine:  # LLM.llm_engine.add_lora, handed to the worker as the engine core does
        def add_lora(self, req: Any) -> bool:
            sent.append(req)
            return bool(WorkerLoRAManager.add_adapter(worker_manager, req))

    req = _request(adapter, name="pre", lora_id=11)
    prefetch(SimpleNamespace(llm_engine=_Engine()), [req, None])
    assert [r.lora_path for r in sent] == [PREBUILD_PREFIX + req.lora_path] and req.lora_path == str(adapter)
    built = WorkerLoRAManager._load_adapter(worker_manager, req)  # waits for the build in flight
    assert built.id == 11 and table(worker_manager).builds_started == 1
    _same(built, WorkerLoRAManager._load_adapter.__wrapped__(worker_manager, req))


def test_a_failed_background_build_is_a_4xx_naming_the_problem(worker_manager: Any, tmp_path: Path) -> None:
    plugin.register()
    server.reset_registry()
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                             '"target_modules": ["q_proj"]}')
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}        ")
    engine = _EngineOnWorker(worker_manager)
    with pytest.raises(Exception) as caught:
        asyncio.run(server.ensure_built(engine, _request(bad, name="k")))
    answer = server.http_error(server.build_failure(caught.value, name="k", source=str(bad)))
    assert answer.error.code == 400 and "header entry 'x' is malformed" in answer.error.message
    assert engine.registered == []  # nothing reached the engine's adapter cache
    missing = server.http_error(server.build_failure(RuntimeError("Loading lora k failed: No adapter found for /x"),
                                                     name="k", source="/x"))
    assert missing.error.code == 404


class _TextOnlyEngine(_EngineOnWorker):
    """As vLLM's engine core client: a failed ``add_lora`` reaches the server as ``Exception(text)`` only."""

    async def add_lora(self, req: Any) -> bool:
        try:
            return await super().add_lora(req)
        except Exception as err:
            raise Exception(f"Call to add_lora method failed: {err}") from None


@pytest.mark.parametrize("engine_type", [_EngineOnWorker, _TextOnlyEngine], ids=["in-process", "text-only"])
def test_a_failed_background_build_crosses_as_its_type_not_its_text(worker_manager: Any, tmp_path: Path,
                                                                    engine_type: type) -> None:
    from vllm_lora_ext.errors import RECORD_MARK, AdapterNotFoundError

    plugin.register()
    server.reset_registry()
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    for path, code, words, error in ((tmp_path / "gone", 404, "does not exist", AdapterNotFoundError),
                                     (big, 400, "max_lora_rank", AdapterCompatibilityError)):
        with pytest.raises(error) as caught:  # the worker's own type, with its fields
            asyncio.run(server.ensure_built(engine_type(worker_manager), _request(path, name="k")))
        assert RECORD_MARK not in str(caught.value)
        answer = server.http_error(server.build_failure(caught.value, name="k", source=str(path)))
        assert answer.error.code == code and words in answer.error.message, answer.error
        assert "Adapter 'k' could not be loaded" in answer.error.message and RECORD_MARK not in answer.error.message


def test_a_request_on_a_registered_adapter_whose_files_broke_gets_a_400_not_a_500(worker_manager: Any,
                                                                                   tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.lora.request import LoRARequest

    plugin.register()
    server.reset_registry()
    folder = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj"], rank=4, alpha=8)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}        ")
    engine = _EngineOnWorker(worker_manager)
    models = SimpleNamespace(lora_requests={"a": LoRARequest("a", 3, str(folder))},
                             lora_resolver_lock=defaultdict(asyncio.Lock), engine_client=engine)
    serving = SimpleNamespace(models=models, _is_model_supported=lambda m: not m or m == "base")
    try:
        answer = asyncio.run(server.route_adapters(serving, CompletionRequest(prompt="hi", model="a")))
    finally:
        server.reset_registry()
    assert answer.error.code == 400 and "Adapter 'a' could not be loaded" in answer.error.message
    assert "header entry 'x' is malformed" in answer.error.message and engine.registered == []


def test_at_most_four_waits_probe_fast_and_every_wait_gives_its_place_back() -> None:
    """A client naming many evicted adapters at once starts a wait per adapter: only the first four probe every
    2 ms; the rest every 25 ms. Each wait, fast or not, ends with the count back where it was."""
    from vllm_lora_ext.integration import server

    release = asyncio.Event()
    seen: list[int] = []

    class _Engine:
        async def add_lora(self, probe: Any) -> bool:
            seen.append(server._FAST_WAITS[0])
            return release.is_set()

    async def run() -> None:
        engine = _Engine()
        waits = [asyncio.ensure_future(server.ensure_built(engine, _request(Path(f"/a/{i}"), name=f"a{i}")))
                 for i in range(6)]
        await asyncio.sleep(0.2)
        assert server._FAST_WAITS[0] == 4 and max(seen) == 4
        release.set()
        await asyncio.gather(*waits)

    asyncio.run(run())
    assert server._FAST_WAITS[0] == 0


def test_a_background_build_scanned_after_staging_refuses_a_nan_with_a_4xx_and_frees_it(
        worker_manager: Any, adapter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, a background build leaves its MoE factors' NaN/inf scan until they are staged (``scan_moe=False``,
    then ``staging.refuse_nonfinite``). Here the worker is told it is on a GPU, and the build it runs (in its thread)
    answers as a build of an unscanned MoE block with a NaN would: ``moe_scanned=False``, a NaN in one factor. The
    loader marks the model, the scan refuses it: the probe's answer is a 400 naming the module's factor, the load is
    counted as rejected (not ok), the refused model keeps no tensor, and the same adapter built clean is taken."""
    from dataclasses import replace

    from vllm.lora.worker_manager import WorkerLoRAManager

    import vllm_lora_ext.integration.loader as loader
    import vllm_lora_ext.integration.prebuild as prebuild
    import vllm_lora_ext.integration.staging as staging
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration.patching import UNSCANNED_ATTR

    plugin.register()
    server.reset_registry()
    real_build, real_record = loader.build_adapter, loader._record_load
    jobs: list[Any] = []
    outcomes: list[str] = []

    def build(job: Any, router: Any, **kwargs: Any) -> Any:
        jobs.append(job)
        built = real_build(job, router, **kwargs)
        if "poisoned" in job.name:
            built.dense[next(k for k in built.dense if ".v_proj.lora_B" in k)][3, 1] = float("nan")
        return replace(built, moe_scanned=job.scan_moe)

    monkeypatch.setattr(prebuild, "_on_cuda", lambda device: True)
    monkeypatch.setattr(prebuild, "_use_build_process", lambda: False)
    monkeypatch.setattr(loader, "build_adapter", build)
    monkeypatch.setattr(loader, "_record_load", lambda kind, outcome, *a: (outcomes.append(outcome),
                                                                           real_record(kind, outcome, *a)))
    seen: list[Any] = []
    real_refuse = staging.refuse_nonfinite
    monkeypatch.setattr(staging, "refuse_nonfinite", lambda lora, name: (seen.append(lora), real_refuse(lora, name)))
    engine = _EngineOnWorker(worker_manager)
    with pytest.raises(AdapterFormatError) as caught:
        asyncio.run(server.ensure_built(engine, _request(adapter, name="poisoned")))
    answer = server.http_error(server.build_failure(caught.value, name="poisoned", source=str(adapter)))
    assert answer.error.code == 400, answer.error
    assert "'model.layers.0.self_attn.v_proj.lora_b' holds NaN or infinite values" in answer.error.message
    assert jobs[0].scan_moe is False and outcomes == ["rejected"]
    assert seen[0].loras == {} and not hasattr(seen[0], UNSCANNED_ATTR)  # refused and emptied
    assert engine.registered == [] and table(worker_manager).state(str(adapter)) == "absent"  # its error given once
    req = _request(adapter, name="clean", lora_id=9)
    reference = WorkerLoRAManager._load_adapter.__wrapped__(worker_manager, req)
    _probe_until_built(worker_manager, req)
    built = WorkerLoRAManager._load_adapter(worker_manager, req)
    _same(built, reference)
    assert jobs[-1].scan_moe is False and outcomes[-1] == "ok" and not hasattr(built, UNSCANNED_ATTR)


def test_a_load_left_unscanned_without_the_scan_that_follows_is_refused(worker_manager: Any, adapter: Path) -> None:
    from vllm_lora_ext.integration.loader import load_lora_model

    with pytest.raises(ValueError, match="finish="):
        load_lora_model(worker_manager, _request(adapter), scan_moe=False)
