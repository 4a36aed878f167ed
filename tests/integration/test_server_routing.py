"""Server-side adapter routing (body fields, model syntax, deployment default) with vLLM's real request types.

The engine client is the outer boundary: a stand-in that records ``add_lora`` calls.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.integration.server import route_adapters

pytestmark = pytest.mark.vllm
BASE = "base-model"


class _Engine:
    def __init__(self) -> None:
        self.added: list[Any] = []
        self.probes: list[Any] = []

    async def add_lora(self, req: Any) -> bool:
        if req.lora_path.startswith(PREBUILD_PREFIX):  # a build-ahead probe: built at once, nothing registered
            self.probes.append(req)
            return True
        self.added.append(req)
        return True


def _serving(tmp_path: Path, *, default: bool = True) -> Any:
    from vllm.lora.request import LoRARequest

    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"adapters:\n  style: {{source: '{a}', weight: 0.7}}\n  domain: {{source: '{b}', weight: 0.3}}\n"
                   + ("default: style\n" if default else ""))
    models = SimpleNamespace(
        lora_requests={"style": LoRARequest("style", 1, str(a)), "domain": LoRARequest("domain", 2, str(b))},
        lora_resolver_lock=defaultdict(asyncio.Lock), engine_client=_Engine(),
        vllm_lora_ext_deployment=read_deployment_config(cfg))
    return SimpleNamespace(models=models, _is_model_supported=lambda m: not m or m == BASE)


def _request(**fields: Any) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest(prompt="hi", **fields)


def _route(serving: Any, request: Any) -> Any:
    return asyncio.run(route_adapters(serving, request))


def test_body_fields_and_model_syntax_resolve_to_one_shared_composite(tmp_path: Path) -> None:
    s = _serving(tmp_path)
    r1 = _request(model=BASE, adapters=["style", "domain"], adapter_weights=[0.7, 0.3])
    r2 = _request(model="style=0.7+domain=0.3")
    r3 = _request(model="style+domain")  # configured default weights 0.7 / 0.3
    for r in (r1, r2, r3):
        assert _route(s, r) is None
    assert r1.model == r2.model == r3.model and r1.model.startswith("mix-style=0.7+domain=0.3-")
    assert len(s.models.engine_client.added) == 1  # loaded once, shared by all three
    assert s.models.lora_requests[r1.model].lora_path.startswith("mix:")


def test_base_model_request_gets_the_deployment_default_and_named_adapters_pass_through(tmp_path: Path) -> None:
    s = _serving(tmp_path)
    r = _request(model=BASE)
    assert _route(s, r) is None and r.model.startswith("mix-style=0.7-")  # default adapter at its weight 0.7
    named = _request(model="domain")
    assert _route(s, named) is None and named.model == "domain"
    s2 = _serving(tmp_path / "nodefault", default=False)
    plain = _request(model=BASE)
    assert _route(s2, plain) is None and plain.model == BASE and not s2.models.engine_client.added


def test_single_adapter_at_weight_one_is_that_adapter(tmp_path: Path) -> None:
    s = _serving(tmp_path)
    r = _request(model=BASE, adapters=["domain"], adapter_weights=[1.0])
    assert _route(s, r) is None and r.model == "domain" and not s.models.engine_client.added


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"adapters": ["style", "nope"]}, "Unknown adapter(s) ['nope']"),
    ({"adapters": ["style"], "adapter_weights": [0.5, 0.5]}, "1 adapters but 2 adapter_weights"),
    ({"adapters": ["style"], "adapter_weights": ["x"]}, "Weight 'x' of adapter 'style' is not a number"),
    ({"adapters": "style"}, "must be a list of adapter names"),
    ({"model": "style=abc+domain"}, "is not a number"),
    ({"adapter_weights": [1.0]}, "without adapters"),
])
def test_bad_requests_get_a_400_naming_the_problem_and_load_nothing(tmp_path: Path, fields: dict, fragment: str) -> None:
    s = _serving(tmp_path)
    err = _route(s, _request(**{"model": BASE, **fields}))
    assert err is not None and err.error.code == 400 and fragment in err.error.message
    assert not s.models.engine_client.added
