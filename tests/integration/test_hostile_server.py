"""Hostile inputs through the server routes and the worker loader, with vLLM's real request types and loader.

Each case asserts the HTTP status (or error type), that the message names the problem, and that
nothing was registered or loaded: no ``add_lora`` call, ``lora_requests`` unchanged. The engine
client is the outer boundary (a stand-in that records ``add_lora``/``remove_lora``); everything
else is real: vLLM's ``CompletionRequest``/``ChatCompletionRequest``/``LoadLoRAAdapterRequest``,
its ``WorkerLoRAManager`` and ``LoRAModel``, and files on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from factories import make_dense_adapter, make_peft_adapter, tiny_llama
from vllm_lora_ext.errors import AdapterCompatibilityError, AdapterFormatError, MixIdCollisionError
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.integration import server
from vllm_lora_ext.registry import MIX_ID_BASE

pytestmark = pytest.mark.vllm
BASE = "base-model"


class _Engine:
    def __init__(self, fail: Exception | None = None) -> None:
        self.added: list[Any] = []
        self.probes: list[Any] = []
        self.removed: list[int] = []
        self.fail = fail
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))

    async def add_lora(self, req: Any) -> bool:
        if req.lora_path.startswith(PREBUILD_PREFIX):  # a build-ahead probe: built at once, nothing registered
            self.probes.append(req)
            return True
        if self.fail is not None:
            raise self.fail
        self.added.append(req)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


@pytest.fixture(autouse=True)
def fresh_registry() -> Any:
    server.reset_registry()
    yield
    server.reset_registry()


def _serving(tmp_path: Path, engine: _Engine | None = None) -> Any:
    from vllm.lora.request import LoRARequest

    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    models = SimpleNamespace(
        lora_requests={"style": LoRARequest("style", 1, str(a)), "domain": LoRARequest("domain", 2, str(b))},
        lora_resolver_lock=defaultdict(asyncio.Lock), engine_client=engine or _Engine())
    return SimpleNamespace(models=models, _is_model_supported=lambda m: not m or m == BASE)


def _completion(**fields: Any) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest(prompt="hi", **fields)


def _chat(**fields: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def _route(serving: Any, request: Any) -> Any:
    return asyncio.run(server.route_adapters(serving, request))


# ------------------------------------------------------------------------------------------------ routing (36)

ROUTES: list[tuple[dict[str, Any], str]] = [
    ({"adapters": "style"}, "must be a list of adapter names"),
    ({"adapters": ["style", 5]}, "must be a list of adapter names"),
    ({"adapters": [["style"]]}, "must be a list of adapter names"),
    ({"adapters": {"style": 1}}, "must be a list of adapter names"),
    ({"adapters": ["style"], "adapter_weights": [True]}, "Weight True of adapter 'style' is not a number"),
    ({"adapters": ["style"], "adapter_weights": [float("nan")]}, "is not finite"),
    ({"adapters": ["style"], "adapter_weights": [float("inf")]}, "is not finite"),
    ({"adapters": ["style"], "adapter_weights": [1e308]}, "outside [-100, 100]"),
    ({"adapters": ["style"], "adapter_weights": [-1e5]}, "outside [-100, 100]"),
    ({"adapters": ["style"], "adapter_weights": ["0.5"]}, "Weight '0.5' of adapter 'style' is not a number"),
    ({"adapters": ["style"], "adapter_weights": [None]}, "is not a number"),
    ({"adapters": ["style"], "adapter_weights": 0.5}, "'adapter_weights' must be a list of numbers"),
    ({"adapters": ["style"], "adapter_weights": [0.5, 0.5]}, "1 adapters but 2 adapter_weights"),
    ({"adapters": ["style", "domain"], "adapter_weights": [0.5]}, "2 adapters but 1 adapter_weights"),
    ({"adapters": ["style", "nope"]}, "Unknown adapter(s) ['nope']"),
    ({"adapters": ["../../etc/passwd"]}, "Unknown adapter(s)"),
    ({"adapters": ["/tmp"]}, "Unknown adapter(s)"),
    ({"adapters": ["hf:acme/evil"]}, "Unknown adapter(s)"),
    ({"adapters": ["style", "style"]}, "appear more than once"),
    ({"adapters": ["style"] * 17}, "more than the 16"),
    ({"adapter_weights": [1.0]}, "without adapters"),
    ({"model": "style=nan+domain"}, "is not finite"),
    ({"model": "style=1e400"}, "is not finite"),
    ({"model": "style=1e300"}, "outside [-100, 100]"),
    ({"model": "style=abc+domain"}, "is not a number"),
    ({"model": "=0.5"}, "empty adapter name"),
    ({"model": "style+"}, "empty adapter name"),
    ({"model": "style+nope"}, "Unknown adapter(s) ['nope']"),
    ({"model": "+".join(["style"] * 17)}, "more than the 16"),
    ({"model": "style=0.5+" * 1000 + "domain"}, "more than 4096"),
    ({"model": "mix:{\"v\":1}+style"}, "Unknown adapter(s)"),
]


@pytest.mark.parametrize("make", [_completion, _chat], ids=["completion", "chat"])
@pytest.mark.parametrize(("fields", "fragment"), ROUTES, ids=[f"route{i}" for i in range(len(ROUTES))])
def test_bad_adapter_choices_get_a_400_and_register_nothing(tmp_path: Path, make: Any, fields: dict[str, Any],
                                                            fragment: str) -> None:
    s = _serving(tmp_path)
    before = dict(s.models.lora_requests)
    err = _route(s, make(**{"model": BASE, **fields}))
    assert err is not None and err.error.code == 400, err
    assert fragment in err.error.message, err.error.message
    assert not s.models.engine_client.added and s.models.lora_requests == before


def test_an_engine_that_refuses_the_composite_gets_a_400_and_the_mix_is_not_registered(tmp_path: Path) -> None:
    s = _serving(tmp_path, _Engine(fail=RuntimeError("Call to add_lora method failed: rank 32 > 16")))
    before = dict(s.models.lora_requests)
    err = _route(s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5]))
    assert err.error.code == 400 and "could not be loaded" in err.error.message and "rank 32 > 16" in err.error.message
    assert s.models.lora_requests == before and len(server.registry()) == 0


def test_an_unexpected_exception_in_the_route_is_a_500_with_a_message_not_a_traceback(tmp_path: Path) -> None:
    s = _serving(tmp_path)

    def boom(model: str) -> bool:
        raise KeyError("surprise")

    s._is_model_supported = boom
    s.models.vllm_lora_ext_deployment = SimpleNamespace(adapters={}, default="style")
    err = _route(s, _completion(model="somebody-else"))
    assert err.error.code == 500 and "KeyError" in err.error.message and "Traceback" not in err.error.message


def test_a_squatted_mix_name_is_refused_not_served(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.mixing import MixComponent, MixSpec

    s = _serving(tmp_path)
    lr = s.models.lora_requests
    spec = MixSpec((MixComponent("style", lr["style"].lora_path, 0.5), MixComponent("domain", lr["domain"].lora_path,
                                                                                      0.5)))
    lr[spec.lora_name] = LoRARequest(spec.lora_name, 99, str(tmp_path / "a"))  # a squatter under the mix's name
    err = _route(s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5]))
    assert err.error.code == 400 and "registered for another adapter" in err.error.message
    assert not s.models.engine_client.added


def test_mix_ids_skip_ids_that_user_adapters_hold(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    s = _serving(tmp_path)
    s.models.lora_requests["mine"] = LoRARequest("mine", MIX_ID_BASE, str(tmp_path / "a"))
    assert _route(s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5])) is None
    assert s.models.engine_client.added[0].lora_int_id == MIX_ID_BASE + 1


def test_ten_thousand_distinct_mixes_keep_the_registry_and_lora_requests_bounded(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "8")
    s = _serving(tmp_path)
    ids: set[int] = set()

    async def many() -> None:
        for i in range(10_000):
            req = _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, i / 10_000])
            assert await server.route_adapters(s, req) is None
            lease = server.claim_lease(s.models.lora_requests[req.model])  # generation starts ...
            assert lease is not None
            ids.add(lease.entry.lora_int_id)
            lease.release()  # ... and ends

    asyncio.run(many())
    assert len(server.registry()) == 8 and len(s.models.lora_requests) == 2 + 8
    assert len(ids) == 10_000 and len(s.models.engine_client.removed) == 10_000 - 8
    assert not server._KEY_LOCKS


def test_a_mix_held_by_a_request_is_never_evicted_and_a_full_registry_answers_503(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "0.3")
    s = _serving(tmp_path)
    first = _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5])
    assert _route(s, first) is None
    lease = server.claim_lease(s.models.lora_requests[first.model])  # in flight
    err = _route(s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.25]))
    assert err.error.code == 503 and "VLLM_LORA_EXT_MAX_MIXES" in err.error.message
    assert first.model in s.models.lora_requests and not s.models.engine_client.removed
    lease.release()
    assert _route(s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.25])) is None
    assert first.model not in s.models.lora_requests and len(s.models.engine_client.removed) == 1


def test_a_waiting_request_is_admitted_when_the_held_mix_is_released(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "5")
    s = _serving(tmp_path)

    async def scenario() -> Any:
        first = _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5])
        assert await server.route_adapters(s, first) is None
        lease = server.claim_lease(s.models.lora_requests[first.model])
        waiter = asyncio.create_task(server.route_adapters(
            s, _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.25])))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        lease.release()
        server.on_lease_released()
        return await asyncio.wait_for(waiter, 2)

    assert asyncio.run(scenario()) is None


# ------------------------------------------------------------------------------------------------ load route (12)


def _load_request(name: str, path: str) -> Any:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return LoadLoRAAdapterRequest(lora_name=name, lora_path=path)


def _pre(name: str, path: str) -> Any:
    return asyncio.run(server.pre_resolve(_load_request(name, path)))


def test_load_route_refuses_what_no_client_may_register(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_dense_adapter(tmp_path / "roots" / "good")
    (tmp_path / "outside").mkdir()
    evil = make_dense_adapter(tmp_path / "outside" / "evil")
    os.symlink(evil, tmp_path / "roots" / "link")
    (tmp_path / "roots" / "empty").mkdir()
    (tmp_path / "roots" / "empty" / "secret-name.safetensors").write_bytes(b"")
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(tmp_path / "roots"))
    cases = [
        ("mix-style=0.5-abc", str(good), 400, "reserved for the server's weighted mixes"),
        ("x", 'mix:{"v":1,"adapters":[["a","/etc",0.5]]}', 400, "which only the server makes"),
        ("x", str(evil), 403, "outside the folders this server may read"),
        ("x", str(tmp_path / "roots" / "link"), 403, "outside the folders this server may read"),
        ("x", str(tmp_path / "roots" / ".." / "outside" / "evil"), 403, "outside the folders"),
        ("x", "/etc/passwd", 403, "outside the folders"),
        ("x", str(tmp_path / "roots" / "missing"), 404, "does not exist"),
        ("x", str(tmp_path / "roots" / "empty"), 404, "has no adapter_model.safetensors"),
        ("x", "hf:acme/x@", 400, "empty revision"),
        ("x", "hf:acme/x:../../y", 400, "'..' in path"),
        ("x", str(tmp_path / "roots" / "m.bin"), 400, "pickle weight file"),
        ("x", "hf://acme/x", 400, "unknown scheme"),
    ]
    for name, path, code, fragment in cases:
        err = _pre(name, path)
        assert getattr(err, "error", None) is not None, (name, path, err)
        assert err.error.code == code and fragment in err.error.message, (path, err.error)
        assert "secret-name" not in err.error.message  # never lists a server folder to a client
    ok = _pre("x", str(good))
    assert ok.lora_path == str(good)


def test_start_up_adapters_are_the_operators_and_skip_the_allowed_roots(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_dense_adapter(tmp_path / "elsewhere")
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(tmp_path / "roots"))
    token = server.STARTUP.set(True)
    try:
        assert _pre("x", str(good)).lora_path == str(good)
    finally:
        server.STARTUP.reset(token)


# ------------------------------------------------------------------------------------------------ worker loader (16)


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return folder


QA, QB = ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")


def _nan(shape: tuple[int, ...], where: float = float("nan")) -> torch.Tensor:
    t = torch.zeros(shape)
    t[0, 0] = where
    return t


WORKER: list[tuple[dict[str, torch.Tensor], dict[str, Any] | None, type[Exception], str]] = [
    ({QA: torch.zeros(4, 64).to(torch.float8_e4m3fn), QB: torch.zeros(64, 4)}, None, AdapterFormatError,
     "is F8_E4M3, not a float type"),
    ({QA: torch.zeros(4, 64, dtype=torch.int32), QB: torch.zeros(64, 4)}, None, AdapterFormatError, "is I32"),
    ({QA: torch.zeros(4, 64), QB: _nan((64, 4))}, None, AdapterFormatError, "holds NaN or infinite"),
    ({QA: _nan((4, 64), float("inf")), QB: torch.zeros(64, 4)}, None, AdapterFormatError, "holds NaN or infinite"),
    ({QA: torch.zeros(8, 64), QB: torch.zeros(64, 4)}, None, AdapterFormatError, "lora_A has rank 8 but lora_B has rank 4"),
    ({QA: torch.zeros(4, 65), QB: torch.zeros(64, 4)}, None, AdapterFormatError, "factors map 65 -> 64"),
    ({QA: torch.zeros(4, 64), QB: torch.zeros(63, 4)}, None, AdapterFormatError, "factors map 64 -> 63"),
    ({QA: torch.zeros(256), QB: torch.zeros(64, 4)}, None, AdapterFormatError, "factors must be 2-D"),
    ({QA: torch.zeros(4, 64), QB: torch.zeros(64, 4, 1)}, None, AdapterFormatError, "factors must be 2-D"),
    ({QA: torch.zeros(4, 64)}, None, AdapterFormatError, "lora_A without lora_B"),
    ({QA: torch.zeros(4, 64), QB: torch.zeros(64, 4)}, {"r": True}, AdapterFormatError, "rank r=True"),
    ({QA: torch.zeros(4, 64), QB: torch.zeros(64, 4)}, {"use_rslora": "false"}, AdapterFormatError,
     "use_rslora='false'"),
    ({QA: torch.zeros(32, 64), QB: torch.zeros(64, 32)}, {"r": 32}, AdapterCompatibilityError,
     "--max-lora-rank 32"),
]


@pytest.mark.parametrize(("tensors", "config", "err", "fragment"), WORKER, ids=[f"worker{i}" for i in range(len(WORKER))])
def test_the_worker_loader_refuses_hostile_adapters_before_vllm_sees_a_tensor(
        worker_manager: Any, tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None,
        err: type[Exception], fragment: str) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model

    folder = _write(tmp_path / "a", tensors, config)
    with pytest.raises(err) as e:
        load_lora_model(worker_manager, LoRARequest("a", 1, str(folder)))
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda b: b[:-4], "truncated"),
    (lambda b: b + b"\0" * 4, "trailing data"),
    (lambda b: b[:8] + b[8:].replace(b'"F32"', b'"F99"', 1), "unknown dtype"),
])
def test_the_worker_loader_refuses_corrupt_files(worker_manager: Any, tmp_path: Path, mutate: Any,
                                                 fragment: str) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model

    folder = _write(tmp_path / "a", {QA: torch.zeros(4, 64), QB: torch.zeros(64, 4)})
    p = folder / "adapter_model.safetensors"
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(AdapterFormatError, match=fragment):
        load_lora_model(worker_manager, LoRARequest("a", 1, str(folder)))


def test_a_mix_whose_composite_overflows_is_refused(worker_manager: Any, tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    big = _write(tmp_path / "big", {QA: torch.full((4, 64), 3e37), QB: torch.ones(64, 4)})  # the weight goes on A
    spec = MixSpec((MixComponent("big", str(big), 100.0),))
    with pytest.raises(AdapterFormatError, match="holds NaN or infinite"):
        load_lora_model(worker_manager, LoRARequest(spec.lora_name, MIX_ID_BASE, spec.lora_path))


def test_a_composite_is_scanned_only_when_its_components_bounds_allow_an_overflow(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import composite
    from vllm_lora_ext.integration.loader import load_lora_model
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    scans: list[int] = []
    real = composite.check_finite
    monkeypatch.setattr(composite, "check_finite", lambda *a, **k: (scans.append(1), real(*a, **k))[1])
    big = _write(tmp_path / "big", {QA: torch.full((4, 64), 1e37), QB: torch.ones(64, 4)})  # the weight goes on A
    small = _write(tmp_path / "small", {QA: torch.full((4, 64), 0.5), QB: torch.ones(64, 4)})

    def load(*parts: tuple[Path, float]) -> Any:
        spec = MixSpec(tuple(MixComponent(p.name, str(p), w) for p, w in parts))
        return load_lora_model(worker_manager, LoRARequest(spec.lora_name, MIX_ID_BASE, spec.lora_path))

    load((small, 3.0), (big, 1.0))  # |c|·max|A| far below the dtype's range: no scan
    assert scans == []
    lora = load((big, 12.0))  # 1.2e38·s (s = 2): the bound allows an overflow, so it is scanned, and found finite
    assert scans == [1]
    a = next(iter(lora.loras.values())).lora_a
    assert bool(torch.isfinite(a).all()) and float(a.abs().max()) > 2e38


# ------------------------------------------------------------------------------------------------ id reuse (3)


class _OfflineEngine:
    """The outer boundary of preload_offline: an engine that records add_lora."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    def add_lora(self, req: Any) -> bool:
        self.added.append(req)
        return True


def test_offline_reuse_of_an_id_for_another_adapter_is_refused(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.engine_patches import preload_offline

    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    engine = _OfflineEngine()
    preload_offline(engine, LoRARequest("a", 7, str(a)))
    preload_offline(engine, LoRARequest("a", 7, str(a)))  # the same adapter again: loaded once
    with pytest.raises(MixIdCollisionError, match="lora_int_id 7 already names another adapter"):
        preload_offline(engine, LoRARequest("b", 7, str(b)))
    assert [r.lora_path for r in engine.added] == [str(a)]


def test_the_worker_reloads_an_id_held_for_another_source_instead_of_serving_it(worker_manager: Any,
                                                                                 tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    import vllm.lora.worker_manager as wm

    held: dict[int, Any] = {}

    class _Slots:  # the outer boundary: vLLM's GPU-side adapter slots
        def get_adapter(self, i: int) -> Any:
            return held.get(i)

        def remove_adapter(self, i: int) -> bool:
            return held.pop(i, None) is not None

        def list_adapters(self) -> dict[int, Any]:
            return dict(held)

        def add_adapter(self, lora: Any) -> bool:
            held[lora.id] = lora
            return True

        def activate_adapter(self, i: int) -> bool:
            return True

    slots = _Slots()
    slots.model = worker_manager._adapter_manager.model
    for attr in ("modules", "packed_modules", "supported_lora_modules", "packed_modules_mapping", "is_pooling_model"):
        setattr(slots, attr, getattr(worker_manager._adapter_manager, attr))
    worker_manager._adapter_manager = slots
    assert getattr(wm.WorkerLoRAManager.add_adapter, PATCH_MARK, False)
    peft = tmp_path / "p"
    folders = [make_peft_adapter(tiny_llama(), peft / str(i), targets=["q_proj"], rank=4, seed=i) for i in (1, 2)]
    wm.WorkerLoRAManager.add_adapter(worker_manager, LoRARequest("a", 5, str(folders[0])))
    first = held[5]
    wm.WorkerLoRAManager.add_adapter(worker_manager, LoRARequest("b", 5, str(folders[1])))
    second = held[5]
    assert second is not first and second.vllm_lora_ext_identity == str(folders[1])
    name = next(iter(first.loras))
    assert not torch.equal(first.loras[name].lora_b, second.loras[name].lora_b)


def test_a_routed_request_keeps_its_exact_mix_even_after_the_mix_leaves_the_registry(tmp_path: Path) -> None:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    from vllm.entrypoints.serve.engine.serving import BaseServing

    s = _serving(tmp_path)
    req = _completion(model=BASE, adapters=["style", "domain"], adapter_weights=[0.5, 0.5])
    assert _route(s, req) is None
    routed = BaseServing._maybe_get_adapters(s, req)
    del s.models.lora_requests[req.model]  # evicted between routing and generation
    again = BaseServing._maybe_get_adapters(s, req)
    assert again is routed and again.lora_path.startswith("mix:") and again.lora_int_id >= MIX_ID_BASE


def test_a_client_cannot_smuggle_a_lora_request_through_the_body(tmp_path: Path) -> None:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    from vllm.entrypoints.serve.engine.serving import BaseServing

    s = _serving(tmp_path)
    req = _completion(model="style", **{server.ROUTED_ATTR: {"lora_name": "x", "lora_int_id": 1,
                                                             "lora_path": "/etc"}})
    assert _route(s, req) is None
    got = BaseServing._maybe_get_adapters(s, req)
    assert got is s.models.lora_requests["style"]  # vLLM's own lookup by name, the body field ignored


def test_a_mix_whose_packed_moe_composite_overflows_in_any_slice_is_refused(worker_manager: Any) -> None:
    """Every tensor of a packed MoE block is scanned, not only the last of its list."""
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.building import BuiltAdapter, MappedAdapter
    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.integration import composite
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    name = "model.layers.0.mlp.experts"
    a = [torch.full((2, 4, 8), 3e37), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)]  # the first slice overflows (w·A)
    b = [torch.ones(2, 8, 4) for _ in range(3)]
    built = BuiltAdapter("moe", config_from_dict({"r": 4}), {}, {name: (a, b, 4)})
    source = "/nonexistent/packed-moe-component"
    composite.clear_component_cache()
    composite._CACHE[(id(worker_manager), source)] = MappedAdapter(built, {})
    try:
        spec = MixSpec((MixComponent("moe", source, 100.0),))
        with pytest.raises(AdapterFormatError, match=r"holds NaN or infinite.*lora_A\[0\]|lora_A\[0\].*NaN"):
            load_lora_model_for(worker_manager, LoRARequest(spec.lora_name, MIX_ID_BASE, spec.lora_path))
    finally:
        composite.clear_component_cache()


def load_lora_model_for(manager: Any, req: Any) -> Any:
    from vllm_lora_ext.integration.loader import load_lora_model

    return load_lora_model(manager, req)
