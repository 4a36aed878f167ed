"""vLLM's lookup of custom logits processors, which it leaves to the first request's processing (an entry-points scan
over every installed distribution: 31 ms profiled on the H200 host, r32), is done while the engine client's
``InputProcessor`` starts (PATCHES.md: ``InputProcessor.__init__``; ``_compat.warm_logits_processor_lookup``).

vLLM's own code decides what is deferred: on 0.33 its ``_build_logits_processors_params_validator`` (V1 runner: a
``partial`` over the cached lookup; V2 runner: its own builder, loaded at once), on 0.26-0.32 ``SamplingParams.verify``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _input_processor(logits_processors: Any = None, *, v2: bool = False) -> Any:
    """The fields vLLM's ``InputProcessor.__init__`` sets that the lookup reads, made by vLLM's own code."""
    from vllm.v1.engine.input_processor import InputProcessor

    ip = SimpleNamespace(model_config=SimpleNamespace(logits_processors=logits_processors, runner_type="generate"),
                         vllm_config=SimpleNamespace(use_v2_model_runner=v2))
    build = getattr(InputProcessor, "_build_logits_processors_params_validator", None)
    if build is not None:  # 0.33: the validator vLLM would keep
        ip.validate_logits_processors_params = build(ip)
    return ip


def _validate(ip: Any) -> None:
    """What vLLM runs for a request (0.33: the kept validator; 0.26-0.32: SamplingParams.verify's call)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    validator = getattr(ip, "validate_logits_processors_params", None)
    if validator is not None:
        validator(SamplingParams())
    else:
        validate_logits_processors_parameters(ip.model_config.logits_processors, SamplingParams())


def test_the_input_processor_does_the_first_requests_logits_processor_lookup_as_it_starts() -> None:
    from vllm.v1.sample.logits_processor import cached_load_custom_logitsprocs

    from vllm_lora_ext.integration.engine_patches import make_input_processor_init

    ip = _input_processor()
    cached_load_custom_logitsprocs.cache_clear()
    init = make_input_processor_init(lambda self, vllm_config, *a, **k: None)
    init(ip, ip.vllm_config)
    assert cached_load_custom_logitsprocs.cache_info().misses == 1  # the scan, here
    _validate(ip)  # the first request
    info = cached_load_custom_logitsprocs.cache_info()
    assert info.misses == 1 and info.hits == 1  # found in the cache: no scan in the request


def test_a_lookup_that_fails_is_left_to_the_first_request_which_raises_as_before() -> None:
    from vllm.v1.sample.logits_processor import cached_load_custom_logitsprocs

    from vllm_lora_ext.integration._compat import warm_logits_processor_lookup

    ip = _input_processor(["vllm_lora_ext_no_such_module:Processor"])
    cached_load_custom_logitsprocs.cache_clear()
    assert warm_logits_processor_lookup(ip) is False  # no error at start-up
    with pytest.raises(Exception, match="vllm_lora_ext_no_such_module"):
        _validate(ip)


def test_a_runner_that_loads_its_processors_itself_is_left_alone() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.logits_processor import cached_load_custom_logitsprocs

    from vllm_lora_ext.integration._compat import warm_logits_processor_lookup

    if not hasattr(InputProcessor, "_build_logits_processors_params_validator"):
        pytest.skip("this vLLM has one path for every runner (0.26-0.32: SamplingParams.verify)")
    ip = _input_processor(v2=True)
    cached_load_custom_logitsprocs.cache_clear()
    assert warm_logits_processor_lookup(ip) is False
    assert cached_load_custom_logitsprocs.cache_info().misses == 0


def test_the_patch_is_installed_on_vllms_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    assert getattr(InputProcessor.__init__, PATCH_MARK, False)


def test_a_pooling_model_which_never_looks_is_not_warmed() -> None:
    from vllm.v1.sample.logits_processor import cached_load_custom_logitsprocs

    from vllm_lora_ext.integration._compat import warm_logits_processor_lookup

    ip = _input_processor()
    ip.model_config.runner_type = "pooling"
    cached_load_custom_logitsprocs.cache_clear()
    assert warm_logits_processor_lookup(ip) is False
    assert cached_load_custom_logitsprocs.cache_info().misses == 0
