"""Mixes and the adapters they are made of: a client cannot unload a mix the server made; unloading (or reloading in
place) an adapter retires the mixes made with it, also a mix that was waiting for a slot or loading meanwhile, which
is then never published. Found by attacker and reviewer helpers in r42. Uses ``test_hostile_names.py``'s API server
(vLLM's real ``OpenAIServingModels`` and ``BaseServing`` over a recording engine client)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.constants import MIX_PREFIX
from vllm_lora_ext.integration import leases, server

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tests' harnesses
from test_hostile_names import Api, api, plugin_on  # noqa: E402,F401 (fixtures: the API server, the plugin on)

pytestmark = pytest.mark.vllm


async def _unload(api: Api, name: str) -> Any:
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    return await api.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))


def test_a_client_cannot_unload_a_mix_other_clients_name(api: Api, tmp_path: Path) -> None:
    """A mix's name is in every response's ``model``; a client that unloads it must not break it for every other
    client (with labels cut short, its name cannot be rebuilt: they got a 404 blaming eviction). Found in r42."""
    names = ["customer-support-tone-v3", "legal-domain-2026-q4", "german-formal-register", "safety-v2"]

    async def scenario() -> None:
        for i, n in enumerate(names):
            assert isinstance(await api.load(n, str(make_dense_adapter(tmp_path / n, seed=10 + i))), str)
        error, lora = await api.ask("+".join(f"{n}=0.3" for n in names))
        assert error is None
        for name in (lora.lora_name, "mix-never-made"):
            answer = await _unload(api, name)
            assert getattr(answer, "error", None) is not None and answer.error.code == 400, answer
            assert "a client may not unload it" in answer.error.message and "Unload that adapter" in answer.error.message
        error, again = await api.ask(lora.lora_name)  # another client, naming the mix as the server told it
        assert error is None and again.lora_int_id == lora.lora_int_id

    asyncio.run(scenario())


def test_unloading_an_adapter_retires_the_mixes_made_with_it(api: Api, tmp_path: Path) -> None:
    """An adapter withdrawn by an unload is withdrawn from its mixes too: the mix's name answers 404 and the engine
    is asked to drop it; a mix of other adapters stays. Found in r42."""
    x = make_dense_adapter(tmp_path / "x", seed=5)

    async def scenario() -> None:
        assert isinstance(await api.load("mine", str(x)), str)
        error, mixed = await api.ask("mine=0.5+style=0.5")
        assert error is None
        error, other = await api.ask("style=0.5+domain=0.5")
        assert error is None
        assert isinstance(await _unload(api, "mine"), str)
        for name in ("mine", mixed.lora_name):
            error, _ = await api.ask(name)
            assert error is not None and error.error.code == 404, (name, error)
        assert mixed.lora_int_id in api.engine.removed and mixed.lora_name not in api.models.lora_requests
        error, kept = await api.ask(other.lora_name)
        assert error is None and kept.lora_int_id == other.lora_int_id

    asyncio.run(scenario())



def test_an_inplace_reload_of_a_component_retires_the_mixes_made_with_it(api: Api, tmp_path: Path) -> None:
    """A ``load_inplace`` of an adapter whose files a deploy replaced: the mixes made with it were built from its
    old weights, and are made anew when next asked for (before r42 they kept serving the old weights under the same
    name and id). Found by an attacker helper in r42."""
    import os

    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    x = make_dense_adapter(tmp_path / "x", seed=5)

    async def scenario() -> None:
        assert isinstance(await api.load("mine", str(x)), str)
        error, before = await api.ask("mine=0.5+style=0.5")
        assert error is None
        fresh = make_dense_adapter(tmp_path / "x-new", seed=6)  # a deploy replaces the files
        for f in os.listdir(fresh):
            os.replace(fresh / f, Path(x) / f)
        answer = await api.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="mine", lora_path=str(x),
                                                                           load_inplace=True))
        assert isinstance(answer, str), answer
        added = len(api.engine.added)
        error, after = await api.ask("mine=0.5+style=0.5")
        assert error is None
        assert len(api.engine.added) > added, f"mix {after.lora_name!r} is served as built before the reload"

    asyncio.run(scenario())




def _mixes(api: Api) -> list[str]:
    return [n for n, r in api.models.lora_requests.items() if r.lora_path.startswith(MIX_PREFIX)]


def test_a_retired_mix_that_requests_hold_serves_them_and_is_gone_by_name(api: Api, tmp_path: Path) -> None:
    x = make_dense_adapter(tmp_path / "x", seed=5)

    async def scenario() -> None:
        assert isinstance(await api.load("mine", str(x)), str)
        with leases.request_scope():
            error, held = await api.ask("mine=0.5+style=0.5")
            assert error is None
            reg = server.live_registry()
            assert reg is not None and reg.by_id(held.lora_int_id).in_use()
            assert isinstance(await _unload(api, "mine"), str)
            assert held.lora_name not in api.models.lora_requests and reg.by_id(held.lora_int_id) is None
            assert held.lora_int_id not in api.engine.removed  # the request holding it finishes on it
            error, _ = await api.ask(held.lora_name)
            assert error is not None and error.error.code == 404

    asyncio.run(scenario())


def test_a_mix_whose_adapter_is_unloaded_while_it_loads_is_not_published(api: Api, tmp_path: Path) -> None:
    x = make_dense_adapter(tmp_path / "x", seed=5)
    gate, entered = asyncio.Event(), asyncio.Event()
    real_add = api.engine.add_lora

    async def add_lora(req: Any) -> bool:
        if req.lora_path.startswith(MIX_PREFIX):
            entered.set()
            await gate.wait()
        return await real_add(req)

    api.engine.add_lora = add_lora  # type: ignore[method-assign]

    async def scenario() -> None:
        assert isinstance(await api.load("mine", str(x)), str)
        asking = asyncio.create_task(api.ask("mine=0.5+style=0.5"))
        await entered.wait()  # the mix's add_lora is in flight
        assert isinstance(await _unload(api, "mine"), str)  # its mixes are retired now
        gate.set()
        error, _ = await asking
        assert error is not None and error.error.code == 404 and "unloaded or reloaded" in error.error.message
        assert not _mixes(api), f"adapter 'mine' was unloaded, yet its mix {_mixes(api)} is registered by name"

    asyncio.run(scenario())


def test_a_mix_waiting_for_a_slot_when_its_adapter_is_unloaded_is_not_published(
        api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request resolved 'mine''s source before the unload; its mix registers after the retire ran."""
    x = make_dense_adapter(tmp_path / "x", seed=5)
    gate, entered = asyncio.Event(), asyncio.Event()
    real_register = server.register_when_free

    async def slow_register(*a: Any, **k: Any) -> Any:
        entered.set()
        await gate.wait()
        return await real_register(*a, **k)

    async def scenario() -> None:
        assert isinstance(await api.load("mine", str(x)), str)
        monkeypatch.setattr(server, "register_when_free", slow_register)
        asking = asyncio.create_task(api.ask("mine=0.5+style=0.5"))
        await entered.wait()
        assert isinstance(await _unload(api, "mine"), str)
        gate.set()
        error, _ = await asking
        assert error is not None and error.error.code == 404
        assert not _mixes(api), f"adapter 'mine' was unloaded, yet its mix {_mixes(api)} is registered by name"

    asyncio.run(scenario())
