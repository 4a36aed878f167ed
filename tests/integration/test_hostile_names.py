"""Hostile names through vLLM's real API objects (issue 35: a hijacked mix, base names, evicted mix names, weights).

The API side is vLLM's own: ``OpenAIServingModels`` (``--lora-modules``, ``/v1/load_lora_adapter``) and
``BaseServing`` (``_check_model``, ``_maybe_get_adapters``), patched by ``register()``. The engine client is the
outer boundary: a stand-in that records ``add_lora`` / ``remove_lora``. Each hostile case asserts the status and the
message (the name, the reserved part, the fix), that nothing leaked (no adapter registered, no ``add_lora``, no mix
registry entry, no per-name lock), and that the server then serves the real mix, built from the real adapters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from factories import make_dense_adapter, make_peft_adapter, tiny_llama
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.integration import server
from vllm_lora_ext.mixing import MixSpec

pytestmark = pytest.mark.vllm
BASE = "base-model"
DIGEST = "0123456789abcdef01234567"


class _EngineClient:
    """vLLM's engine client seen from the API server: records the adapters it is asked to add and remove."""

    model_config = SimpleNamespace(max_model_len=256)
    renderer = None
    input_processor = None

    def __init__(self) -> None:
        self.added: list[Any] = []
        self.probes: list[Any] = []
        self.removed: list[int] = []
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))

    async def add_lora(self, req: Any) -> bool:
        (self.probes if req.lora_path.startswith(PREBUILD_PREFIX) else self.added).append(req)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


class Api:
    """One API server: vLLM's OpenAIServingModels and BaseServing over the recording engine client."""

    def __init__(self, tmp_path: Path, base: str = BASE) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath, LoRAModulePath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.serve.engine.serving import BaseServing

        self.sources = {"style": str(make_dense_adapter(tmp_path / "style", seed=1)),
                        "domain": str(make_dense_adapter(tmp_path / "domain", seed=2))}
        self.engine = _EngineClient()
        self.models = OpenAIServingModels(self.engine, [BaseModelPath(name=base, model_path="/m")],
                                          lora_modules=[LoRAModulePath(n, p) for n, p in self.sources.items()])
        self.serving = BaseServing(self.models, self.engine.model_config)
        self.base = base

    def start(self) -> None:
        asyncio.run(self.models.init_static_loras())

    async def load(self, name: str, path: str) -> Any:
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        return await self.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=path))

    async def ask(self, model: str, **fields: Any) -> tuple[Any, Any]:
        """Route one completion as vLLM does: ``(error or None, the LoRARequest it would be served with)``."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = CompletionRequest(model=model, prompt="hi", **fields)
        error = await self.serving._check_model(request)
        return error, (None if error is not None else self.serving._maybe_get_adapters(request))

    def snapshot(self) -> tuple[dict[str, Any], int, int, set[str]]:
        return (dict(self.models.lora_requests), len(self.engine.added), len(server.registry()),
                set(self.models.lora_resolver_lock))

    async def serves_the_real_mix(self) -> None:
        """A normal mix request after the hostile one is served the mix of the real adapters."""
        error, lora = await self.ask("style=0.7+domain=0.3")
        assert error is None, error
        spec = MixSpec.from_path(lora.lora_path)
        assert [(c.name, c.source, c.weight) for c in spec.components] == [
            ("style", self.sources["style"], 0.7), ("domain", self.sources["domain"], 0.3)]
        error, plain = await self.ask("style")
        assert error is None and plain.lora_path == self.sources["style"]


@pytest.fixture(autouse=True)
def plugin_on() -> Any:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    server.reset_registry()
    yield
    server.reset_registry()


@pytest.fixture
def api(tmp_path: Path) -> Api:
    a = Api(tmp_path)
    a.start()
    return a


# ------------------------------------------------------------------------------ the load route cannot squat a mix (14)

SQUATS: list[tuple[str, list[str]]] = [
    ("style=0.7+domain=0.3", ["contains '+' and '='", "e.g. 'style-0.7_domain-0.3'"]),
    ("style+domain", ["contains '+'", "e.g. 'style_domain'"]),
    ("domain=0.3+style=0.7", ["contains '+' and '='"]),
    ("style=0.7", ["contains '='", "e.g. 'style-0.7'"]),
    ("style=1", ["contains '='"]),
    ("style+", ["contains '+'"]),
    ("+style", ["contains '+'"]),
    ("=", ["contains '='"]),
    ("style =0.7+domain", ["contains '+' and '='"]),
    ("acme/llama+sft", ["contains '+'"]),
    ("mix-style=0.7+domain=0.3-" + DIGEST, ["starts with 'mix-' and contains '+' and '='"]),
    ("mix-style", ["starts with 'mix-'", "e.g. 'style'"]),
    ("mix-", ["starts with 'mix-'"]),
    ("mix-mix-x", ["starts with 'mix-'", "e.g. 'x'"]),
    # the mix syntax in 'model' trims each name: "style\u00a0=0.5+domain=0.5" was served the operator's 'style' (r43)
    (" style", ["starts or ends with whitespace", "e.g. 'style'"]),
    ("style\u00a0", ["starts or ends with whitespace", "e.g. 'style'"]),
    ("style\u3000", ["starts or ends with whitespace"]),
    ("\u2003style", ["starts or ends with whitespace"]),
]


@pytest.mark.parametrize(("name", "fragments"), SQUATS, ids=[f"squat{i}" for i in range(len(SQUATS))])
def test_a_load_whose_name_spells_a_mix_is_refused_and_the_real_mix_still_serves(api: Api, name: str,
                                                                                fragments: list[str]) -> None:
    async def scenario() -> None:
        before = api.snapshot()
        result = await api.load(name, api.sources["style"])
        assert not isinstance(result, str), result  # never "Success"
        assert result.error.code == 400, result
        message = result.error.message
        assert f"Adapter name {name!r}" in message and "Choose a name" in message, message
        for fragment in fragments:
            assert fragment in message, message
        assert api.snapshot() == before and name not in api.models.lora_requests
        assert not api.engine.probes[2:]  # nothing was built for it (the two start-up adapters only)
        await api.serves_the_real_mix()
        error, lora = await api.ask(name)  # the name itself is a request for a mix (or an error), never the squat
        assert error is not None or lora.lora_path.startswith("mix:") or lora.lora_name in api.sources, lora

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ["style=0.7+domain=0.3", "a+b", "mix-a"])
def test_lora_modules_that_spell_a_mix_stop_the_server_at_start_up(tmp_path: Path, name: str) -> None:
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    a = Api(tmp_path)
    a.models.static_lora_modules = [*a.models.static_lora_modules, LoRAModulePath(name, a.sources["domain"])]
    with pytest.raises(ValueError, match="Choose a name") as info:
        a.start()
    assert repr(name) in str(info.value)
    assert name not in a.models.lora_requests and [r.lora_name for r in a.engine.added] == ["style", "domain"]


# ------------------------------------------------------------------------------ served names holding '+' or '=' (4)

@pytest.mark.parametrize("base", ["acme/llama+sft", "llama-ckpt=step5000", "style=0.7+domain=0.3", "a+b=c"])
def test_a_served_model_name_holding_the_mix_characters_is_the_base_model(tmp_path: Path, base: str) -> None:
    a = Api(tmp_path, base=base)
    a.start()

    async def scenario() -> None:
        before = a.snapshot()
        error, lora = await a.ask(base)
        assert error is None and lora is None  # the base model, as without the plugin
        assert a.snapshot() == before
        if base != "style=0.7+domain=0.3":  # else that model is the base model, by the rule
            await a.serves_the_real_mix()
        error, mix = await a.ask(base, adapters=["style", "domain"], adapter_weights=[0.7, 0.3])
        assert error is None and mix.lora_path.startswith("mix:")

    asyncio.run(scenario())


def test_skipping_model_name_validation_still_reads_mixes_as_mixes(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SKIP_MODEL_NAME_VALIDATION", "1")

    async def scenario() -> None:
        await api.serves_the_real_mix()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ an evicted mix name (8)

def test_an_evicted_mix_name_reused_from_a_response_serves_that_mix_again(api: Api,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "1")

    async def scenario() -> None:
        error, first = await api.ask("style=0.5+domain=0.5")
        assert error is None
        server.claim_lease(first).release()  # its generation ran and ended
        error, second = await api.ask("style=0.25+domain=0.75")  # evicts the first
        assert error is None and first.lora_name not in api.models.lora_requests
        server.claim_lease(second).release()
        error, again = await api.ask(first.lora_name)  # the name a client read from the first response
        assert error is None, error
        assert again.lora_name == first.lora_name and again.lora_path == first.lora_path
        assert again.lora_int_id != first.lora_int_id  # registered again under a fresh id
        await api.serves_the_real_mix()

    asyncio.run(scenario())


def _evicted_names() -> list[str]:
    return [
        "mix-style=0.5+domain=0.5-" + DIGEST,  # the label of a real mix, another digest
        "mix-style=0.5-" + DIGEST,
        "mix-style=0.5+nope=0.5-" + DIGEST,
        "mix-style=abc+domain=0.5-" + DIGEST,
        "mix-style=1e400+domain=1-" + DIGEST,
        "mix-=0.5-" + DIGEST,
        "mix-" + "style=0.5+" * 8 + "...-" + DIGEST,  # a label cut short
        "mix-" + "s" * 77 + "...-" + DIGEST,  # cut short before its first '=': never looked up elsewhere
        "mix-style",
    ]


@pytest.mark.parametrize("name", _evicted_names(), ids=[f"evicted{i}" for i in range(len(_evicted_names()))])
def test_a_mix_name_the_server_cannot_make_again_is_a_404_naming_the_fix_not_a_weight_error(api: Api,
                                                                                            name: str) -> None:
    async def scenario() -> None:
        before = api.snapshot()
        error, _ = await api.ask(name)
        assert error is not None and error.error.code == 404, error
        message = error.error.message
        assert "is not registered on this server" in message and "Ask for the mix by its adapters" in message
        assert "Weight" not in message and "not a number" not in message, message
        assert api.snapshot() == before
        await api.serves_the_real_mix()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ one canonical weight (6)

@pytest.mark.parametrize("fields", [
    {"model": "style=0.5+domain=-0"},
    {"model": "style=0.5+domain=-0.0"},
    {"model": "style=0.5+domain=0e0"},
    {"model": "style=0.5+domain=-0e-3"},
    {"model": "style=0.5+domain=0.000"},
    {"model": BASE, "adapters": ["style", "domain"], "adapter_weights": [0.5, -0.0]},
], ids=["minus0", "minus0.0", "0e0", "minus0e-3", "0.000", "body-minus0"])
def test_minus_zero_and_zero_are_one_mix(api: Api, fields: dict[str, Any]) -> None:
    async def scenario() -> None:
        error, zero = await api.ask("style=0.5+domain=0")
        assert error is None and zero.lora_name.startswith("mix-style=0.5+domain=0-")
        model = fields.pop("model")
        error, other = await api.ask(model, **fields)
        assert error is None and other is not None
        assert (other.lora_name, other.lora_int_id, other.lora_path) == (zero.lora_name, zero.lora_int_id,
                                                                         zero.lora_path)
        assert len(server.registry()) == 1 and [r.lora_name for r in api.engine.added][2:] == [zero.lora_name]

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ errors quote the number given (10)

QUOTES: list[tuple[dict[str, Any], str]] = [
    ({"adapters": ["style"], "adapter_weights": [10**30]}, "Weight 1000000000000000000000000000000 of adapter 'style'"),
    ({"adapters": ["style"], "adapter_weights": [-(10**30)]}, "Weight -1000000000000000000000000000000 of"),
    ({"adapters": ["style"], "adapter_weights": [500]}, "Weight 500 of adapter 'style' is outside [-100, 100]"),
    ({"adapters": ["style"], "adapter_weights": [101]}, "Weight 101 of adapter 'style'"),
    ({"adapters": ["style"], "adapter_weights": [150.25]}, "Weight 150.25 of adapter 'style'"),
    ({"adapters": ["style", "domain"], "adapter_weights": [0.5, 1e30]}, "Weight 1e+30 of adapter 'domain'"),
    ({"model": "style=500+domain"}, "Weight 500 of adapter 'style'"),
    ({"model": "style=1e30+domain"}, "Weight 1e30 of adapter 'style'"),
    ({"model": "style=-1_000+domain"}, "Weight '-1_000' of adapter 'style' is not a number"),  # never -1000
    ({"model": "style=" + "9" * 60 + "+domain"}, "Weight " + "9" * 37 + "... of adapter 'style'"),
]


@pytest.mark.parametrize(("fields", "fragment"), QUOTES, ids=[f"quote{i}" for i in range(len(QUOTES))])
def test_a_weight_out_of_range_is_quoted_as_given_never_as_the_value_it_was_clamped_to(
        api: Api, fields: dict[str, Any], fragment: str) -> None:
    async def scenario() -> None:
        before = api.snapshot()
        model = fields.pop("model", BASE)
        error, _ = await api.ask(model, **fields)
        assert error is not None and error.error.code == 400, error
        assert fragment in error.error.message and "200" not in error.error.message, error.error.message
        assert api.snapshot() == before
        await api.serves_the_real_mix()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ offline ids (3)

class _OfflineEngine:
    """The outer boundary of the offline helpers: vLLM's LLMEngine as its add/remove/list_loras calls see it."""

    def __init__(self) -> None:
        self.held: dict[int, str] = {}  # what the workers hold: id -> path
        self.added: list[Any] = []

    def add_lora(self, req: Any) -> bool:
        self.added.append(req)
        self.held[req.lora_int_id] = req.lora_path
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.held.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.held)


@pytest.mark.parametrize("how", ["generate", "add_lora", "after_the_mix_was_made_without_llm"])
def test_an_offline_mix_never_takes_an_id_the_users_own_adapter_holds(tmp_path: Path, how: str) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.errors import MixIdCollisionError
    from vllm_lora_ext.integration import offline
    from vllm_lora_ext.integration.engine_patches import preload_offline

    a, b, mine = (str(make_dense_adapter(tmp_path / n, seed=i)) for i, n in enumerate(("a", "b", "mine")))
    engine = _OfflineEngine()
    llm = SimpleNamespace(llm_engine=engine)
    weights = {a: 0.5, b: 0.25}  # its sources lie in this test's folder: a mix no other test made
    if how == "after_the_mix_was_made_without_llm":
        user_id = offline.lora_request(weights).lora_int_id  # the user then picks that very id for their adapter
    else:
        user_id = offline._REGISTRY.first_id + offline._REGISTRY._next  # the id the next mix would get
    user = LoRARequest("mine", user_id, mine)
    if how == "add_lora":
        engine.add_lora(user)
    else:
        preload_offline(engine, user)  # what LLM.generate(..., lora_request=user) runs first
    req = offline.lora_request(weights, llm=llm)
    assert req.lora_int_id != user_id and req.lora_path.startswith("mix:")
    assert engine.held == {user_id: mine, req.lora_int_id: req.lora_path}  # both served, each its own tensors
    preload_offline(engine, LoRARequest("mine", user_id, mine))  # the user's next generate: unchanged
    assert offline.lora_request(weights, llm=llm).lora_int_id == req.lora_int_id  # the mix keeps its id
    with pytest.raises(MixIdCollisionError, match=f"lora_int_id {req.lora_int_id} already names another adapter"):
        preload_offline(engine, LoRARequest("other", req.lora_int_id, mine))  # an id the mix holds is refused
    assert engine.held == {user_id: mine, req.lora_int_id: req.lora_path}


def test_an_offline_load_failure_raises_the_workers_error_without_its_record(tmp_path: Path) -> None:
    """vLLM hands back a failed engine call as text, with the worker's record in it: the offline caller gets the
    worker's own error, its own message, not the record's JSON."""
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.errors import AdapterFormatError, RECORD_MARK, with_record
    from vllm_lora_ext.integration.engine_patches import preload_offline

    class Engine:  # the boundary: vLLM's engine, whose add_lora failure is text
        def add_lora(self, req: Any) -> bool:
            err = with_record(AdapterFormatError("Adapter 'a' has rank 32 but max_lora_rank is 16.", adapter="a"))
            raise Exception(f"Call to add_lora method failed: {err}")

    adapter = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj"], rank=4, alpha=8)
    with pytest.raises(AdapterFormatError) as info:
        preload_offline(Engine(), LoRARequest("a", 7, str(adapter)))
    assert str(info.value) == "Adapter 'a' has rank 32 but max_lora_rank is 16." and RECORD_MARK not in str(info.value)


@pytest.mark.parametrize("kind", ["worker OOM", "build process killed"])
def test_a_server_fault_on_the_load_route_is_a_500_not_a_400(api: Api, tmp_path: Path, kind: str) -> None:
    """A worker's CUDA out-of-memory or a killed build process is the server's fault: a 500 (before r42, a 400)."""
    from vllm_lora_ext.errors import BuildProcessError, RemoteError, with_record

    fault = (RemoteError("CUDA out of memory. Tried to allocate 2.00 GiB", type_name="torch.OutOfMemoryError")
             if kind == "worker OOM" else BuildProcessError("the build process exited (signal 9) during a build"))

    async def add_lora(req: Any) -> bool:
        raise Exception("Call to add_lora method failed: " + str(with_record(fault)))

    api.engine.add_lora = add_lora  # type: ignore[method-assign]
    answer = asyncio.run(api.load("mine", str(make_dense_adapter(tmp_path / "x", seed=5))))
    assert not isinstance(answer, str) and answer.error.code == 500, answer
    assert "mine" not in api.models.lora_requests


@pytest.mark.parametrize("name", ["base-model", "", "style-again"], ids=["base model name", "empty name", "loaded"])
def test_a_load_vllm_refuses_downloads_and_builds_nothing(api: Api, tmp_path: Path, name: str) -> None:
    """Refusals of a load (a base model's name, which the plugin refuses on vLLM 0.26 too since r45; no name; a
    name loaded already without ``load_inplace``) answer before any download or build (before r42 each refused load
    cost a build on every worker, kept in the prebuild table for nothing). Found by an attacker helper in r42."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    x = make_dense_adapter(tmp_path / "x", seed=5)
    if name == "style-again":
        assert isinstance(asyncio.run(api.load(name, str(x))), str)
    before = len(api.engine.probes)
    answer = asyncio.run(api.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(x))))
    assert not isinstance(answer, str) and answer.error.code == 400, answer
    assert len(api.engine.probes) == before, "the refused load was built on the workers first"


def test_a_relative_path_outside_the_roots_gets_one_answer_whether_it_exists_or_not(
        api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With VLLM_LORA_EXT_ALLOWED_ROOTS set, an ``org/repo``-shaped path outside every root is read as a Hub id
    whether a file is there or not (before r42: 403 for one that exists, the Hub's 404 for one that does not, which
    told a client what exists on the server). Found by an attacker helper in r42."""
    roots = tmp_path / "roots"
    roots.mkdir()
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(roots))
    monkeypatch.chdir("/")  # the server's working folder
    a = asyncio.run(api.load("probe-a", "etc/passwd"))
    b = asyncio.run(api.load("probe-b", "etc/no-such-file-here"))
    assert not isinstance(a, str) and not isinstance(b, str)
    assert a.error.code == b.error.code, (a.error.message[:100], b.error.message[:100])


def test_lora_request_given_one_name_as_a_string_asks_for_that_adapter_not_its_letters(tmp_path: Path) -> None:
    """`lora_request("style", deployment=...)` iterated the string: "Unknown adapter(s) ['s', 't', 'y', 'l', 'e']",
    and a path gave "Adapter(s) ['/'] appear more than once" (r43 newcomer)."""
    from vllm_lora_ext.integration import offline

    a = str(make_dense_adapter(tmp_path / "a", seed=1))
    (tmp_path / "deploy.yaml").write_text(f"adapters:\n  style:\n    source: {a}\n")
    req = offline.lora_request("style", deployment=str(tmp_path / "deploy.yaml"))
    assert req.lora_name == "style" and req.lora_path == offline.lora_request(["style"], deployment=str(
        tmp_path / "deploy.yaml")).lora_path
    assert offline.lora_request(a).lora_name == a  # one source, at weight 1: that adapter itself
