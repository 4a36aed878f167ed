"""An empty ``adapters`` list (``"adapters": []``, as client libraries send unset list fields) names no mix: the
request is routed by its ``model`` (README, Weighted mixes, rule 1), not served the deployment default. Before r42,
``server._route`` took ``[]`` for a mix and served a request naming adapter ``domain`` (or the mix
``style=0.2+domain=0.8``) the default ``style`` at 0.7, with a 200: another adapter's weights. Found by an attacker
helper in r42.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lease_harness import fresh  # noqa: F401 (plugin on, fresh registry)
from lease_harness import complete, harness, status

pytestmark = pytest.mark.vllm


def _served(h):
    return h.engine.runs[-1].lora_name if h.engine.runs and h.engine.runs[-1] is not None else None


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_named_adapter_with_an_empty_adapters_list_is_served_that_adapter_not_the_default(tmp_path: Path,
                                                                                            stream: bool) -> None:
    h = harness(tmp_path, default=True)  # deployment: style (0.7), domain (0.3), default: style
    async def run():
        answer = await complete(h, model="domain", adapters=[], stream=stream)
        if stream:
            assert hasattr(answer, "__aiter__"), answer
            return [chunk async for chunk in answer]
        assert status(answer) == 200, answer
        return answer

    asyncio.run(run())
    served = _served(h)
    assert served == "domain", f"asked for 'domain', was served {served!r}"


def test_a_model_syntax_mix_with_an_empty_adapters_list_is_served_that_mix(tmp_path: Path) -> None:
    h = harness(tmp_path, default=True)
    answer = asyncio.run(complete(h, model="style=0.2+domain=0.8", adapters=[]))
    assert status(answer) == 200, answer
    assert answer.model.startswith("mix-style=0.2+domain=0.8-"), answer.model


def test_a_model_syntax_mix_with_an_empty_adapters_list_and_no_default_is_not_a_404(tmp_path: Path) -> None:
    h = harness(tmp_path, default=False)
    answer = asyncio.run(complete(h, model="style=0.2+domain=0.8", adapters=[]))
    assert status(answer) == 200, answer.error.message


def test_empty_adapters_and_empty_weights_on_a_named_adapter_is_that_adapter(tmp_path: Path) -> None:
    h = harness(tmp_path, default=False)
    answer = asyncio.run(complete(h, model="domain", adapters=[], adapter_weights=[]))
    assert status(answer) == 200, answer.error.message
    assert _served(h) == "domain"
