"""Serve a model with the plugin's adapters and mixes on Ray Serve LLM: N replicas behind Ray's OpenAI router.

    ray start --head                      # or let this script start a local cluster
    python examples/ray_serve_llm.py --model Qwen/Qwen3-8B --config loras.yaml --replicas 2

``loras.yaml`` is the plugin's deployment config (names to sources, ``hf:`` included, optional weights)::

    adapters:
      style:  {source: 'hf:acme/style-lora@v2'}
      domain: {source: '/data/loras/domain', weight: 0.3}

Clients then use the ``openai`` client against ``http://127.0.0.1:8000/v1`` with:

- ``model="<model id>:style"``: one adapter of the config;
- ``model="<model id>:style=0.7+domain=0.3"``: a weighted mix (``style+domain`` takes the config's weights);
- ``model="<model id>"`` with ``extra_body={"adapters": ["style", "domain"], "adapter_weights": [0.7, 0.3]}``;
- ``model="<model id>:hf:acme/other-lora"``: only for prefixes the operator admits in
  ``VLLM_LORA_EXT_CLIENT_SOURCES`` (``--client-sources hf:acme/``); by default clients name configured adapters only.

What makes it work: ``server_cls=LoraExtLLMServer`` (``vllm_lora_ext.integration.ray``) and the config passed to
every replica through ``runtime_env``; ``ResidencyRequestRouter`` with a ``lora_config`` sends each adapter id
to the replica that holds it (``--no-residency`` for Serve's default routing). ``--smoke`` sends one request of each kind, prints the answers and exits;
tests/gpu/test_ray.py runs this setup on 2 GPUs against a single ``vllm serve`` engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeOptions:
    """How the replicas run: ``residency`` routes each adapter id to the replica holding it (issue 40).

    ``max_ongoing_requests``: requests a replica takes before Serve passes it over (default: the engine's
    ``max_num_seqs``, else 256). Ray Serve LLM's own default is 1e9, under which no replica is ever full, so a hot
    adapter would stay on the replica holding it however busy; with a cap the next replica takes the overflow.
    """

    replicas: int = 1
    client_sources: str = ""
    max_lora_rank: int = 16
    max_cpu_loras: int = 16
    engine_kwargs: dict = field(default_factory=dict)
    residency: bool = True
    max_ongoing_requests: int | None = None


RESIDENCY_ROUTER = "vllm_lora_ext.integration.ray_routing:ResidencyRequestRouter"


def build_app(model: str, model_id: str, config: str, options: ServeOptions = ServeOptions()) -> object:
    """The Ray Serve application: Ray's OpenAI router in front of ``options.replicas`` ``LoraExtLLMServer`` replicas.

    With ``options.residency`` (the default) each replica reports the adapter ids it holds through Ray's
    multiplexed loader (``lora_config``, as many ids as its CPU cache keeps) and ``ResidencyRequestRouter`` sends
    each id to the replica holding it, a new mix to the one holding its components, and the config's adapters are
    built by their first request on the replica it lands on (``VLLM_LORA_EXT_BUILD_AT_START=0``); without, every
    replica builds every config adapter at start and Serve's default router spreads the plugin's ids over
    replicas (each builds what it receives).
    """
    import ray
    from ray.serve.llm import LLMConfig, build_openai_app

    from vllm_lora_ext.integration.ray import LoraExtLLMServer

    env_vars = {"VLLM_LORA_EXT_CONFIG": os.path.abspath(config)}
    if options.client_sources:
        env_vars["VLLM_LORA_EXT_CLIENT_SOURCES"] = options.client_sources
    # vLLM's engine process in each replica calls ray.init() itself; it joins this cluster only if it can find
    # it: a cluster from `ray start` can be found, one started by ray.init() in a script needs RAY_ADDRESS.
    env_vars["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    # replicas started by a separate `ray start` do not see this shell: pass the Hub's and the plugin's settings
    # (paths made absolute: a replica's working directory is not this one; each replica keeps its own metrics folder)
    paths = ("HF_HOME", "HF_HUB_CACHE", "VLLM_LORA_EXT_BUILD_DIR")
    for name in sorted(os.environ):
        if name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE") or (
                name.startswith("VLLM_LORA_EXT_") and name not in env_vars and name != "VLLM_LORA_EXT_METRICS_DIR"):
            env_vars[name] = os.path.abspath(os.environ[name]) if name in paths else os.environ[name]
    if "VLLM_LORA_EXT_ALLOWED_ROOTS" in env_vars:  # a list of folders (os.pathsep), each made absolute
        env_vars["VLLM_LORA_EXT_ALLOWED_ROOTS"] = os.pathsep.join(
            os.path.abspath(os.path.expanduser(p)) for p in env_vars["VLLM_LORA_EXT_ALLOWED_ROOTS"].split(os.pathsep)
            if p.strip())
    deployment: dict = {"num_replicas": options.replicas}
    residency: dict = {}
    if options.residency:
        deployment["request_router_config"] = {"request_router_class": RESIDENCY_ROUTER}
        deployment["max_ongoing_requests"] = options.max_ongoing_requests or int(
            options.engine_kwargs.get("max_num_seqs", 256))
        residency["lora_config"] = {"max_num_adapters_per_replica": options.max_cpu_loras}
        # each replica checks the config's adapters at start and builds one when a request for it is routed there,
        # not every adapter on every replica (vllm_lora_ext.integration.startup)
        env_vars["VLLM_LORA_EXT_BUILD_AT_START"] = "0"
    config_obj = LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model},
        server_cls=LoraExtLLMServer,
        deployment_config=deployment,
        engine_kwargs={"enable_lora": True, "max_lora_rank": options.max_lora_rank, "max_loras": 4,
                       "max_cpu_loras": options.max_cpu_loras, **options.engine_kwargs},
        runtime_env={"env_vars": env_vars},
        **residency,
    )
    return build_openai_app({"llm_configs": [config_obj]})


def smoke(base: str, model_id: str, names: list[str]) -> None:
    """One request of each kind through the router; prints status and text."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    a, b = names[0], names[-1]
    asks = [(f"{model_id}:{a}", {}), (f"{model_id}:{a}=0.7+{b}=0.3", {}),
            (model_id, {"adapters": [a, b], "adapter_weights": [0.7, 0.3]})]
    for model, body in asks:
        r = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0.0, extra_body=body)
        print(f"{model!r} {body or ''}: {r.choices[0].text!r} (served as {r.model})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF repo id or local folder of the base model")
    ap.add_argument("--model-id", default="base", help="the id clients put before ':' in model (default: base)")
    ap.add_argument("--config", required=True, help="the plugin's deployment config (YAML)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--client-sources", default="", help="source prefixes clients may name, e.g. hf:acme/")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--no-residency", action="store_true",
                    help="Serve's default routing: replicas do not report the plugin's ids (each builds what it gets)")
    ap.add_argument("--smoke", action="store_true", help="send one request of each kind, then exit")
    args = ap.parse_args()

    from vllm_lora_ext.deployment import read_deployment_config
    from vllm_lora_ext.errors import DeploymentConfigError

    try:  # before Ray is imported (seconds): a bad config answers at once
        names = list(read_deployment_config(args.config).adapters)
    except DeploymentConfigError as err:
        sys.exit(f"error: --config {args.config}: {str(err).replace(' Check VLLM_LORA_EXT_CONFIG.', '')}")
    try:
        import ray
        from ray import serve
        import ray.serve.llm  # noqa: F401  (Ray Serve LLM, what build_app uses)
    except ImportError as err:
        sys.exit(f"error: this example needs Ray Serve LLM, which is not installed ({err.msg}). Install it with "
                 f"pip install 'vllm-lora-ext[ray]' (Ray Serve and pyarrow), with a vLLM its Ray Serve LLM imports "
                 f"(README: 'Ray: residency routing' lists the pairs tested), then run it again.")

    ray.init()  # RAY_ADDRESS, else a cluster from `ray start` on this host, else a new local one
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    options = ServeOptions(replicas=args.replicas, client_sources=args.client_sources,
                           max_lora_rank=args.max_lora_rank, residency=not args.no_residency)
    serve.run(build_app(args.model, args.model_id, args.config, options), blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    print(f"serving {args.model} as {args.model_id!r} with adapters {names} at {base}/v1")
    if args.smoke:
        smoke(base, args.model_id, names)
        serve.shutdown()
        return
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
