"""The Ray Serve application: an API deployment (FastAPI ingress) and one engine deployment.

    HTTP ─▶ Serve proxy ─▶ api replicas ──(one handle call per chain step)──▶ engine replicas
                           parse, segment, run chains,                        vLLM: batches the
                           jobs, checkpoints, events                           steps of everyone

Chains run in the API replicas, with the project's `ChainRunner`; only model calls cross to the
engine deployment. The engine replica therefore sees the current step of every chain of every
request at once and vLLM batches them; the API replicas stay cheap (no model), scale on their
own, and own what is per request: progress, events, cancellation and checkpoints in the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from connectors.engines.factory import ENGINE_ACTOR_ENV_VARS, EngineSpec, load_tokenizer
from connectors.state.store import StateStore
from operators.config import MethodConfig
from serving.answering import DocumentPreparer, SyncAnswerer
from serving.api import ApiServices, build_api
from serving.config import JobsConfig, LimitsConfig, ServingConfig, UriConfig
from serving.documents import DocumentLoader, RequestReader
from serving.engine import EngineServer, ServeEngineClient
from serving.jobs import JobWorker
from serving.metrics import ServingMetrics
from serving.security import ApiKeys
from serving.uris import DocumentFetcher, UriPolicy

APP_NAME = "memstream"
ENGINE_CONSTRUCTOR_RETRIES = 1


@dataclass(frozen=True)
class ApiSettings:
    """What an API replica is built from: no raw API key, only digests."""

    engine: EngineSpec
    method: MethodConfig
    store_url: str
    limits: LimitsConfig
    uris: UriConfig
    jobs: JobsConfig
    keys: ApiKeys


class ApiServer:
    """One API replica: its services, its job worker, and the FastAPI app over them."""

    async def __init__(self, settings: ApiSettings, engine_handle: Any) -> None:  # type: ignore[misc]
        self.store = StateStore(settings.store_url)
        self.store.migrate()
        tokenizer = await asyncio.to_thread(load_tokenizer, settings.engine)
        replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        metrics = ServingMetrics(replica, self.store.count_jobs_by_status)
        policy = UriPolicy(settings.uris)
        loader = DocumentLoader(
            DocumentFetcher(policy, settings.limits.max_input_bytes), settings.limits.document
        )
        preparer = DocumentPreparer(
            tokenizer, settings.engine.resolved_max_model_len, settings.limits.document.max_tokens
        )
        engine = ServeEngineClient(engine_handle, settings.engine.model)
        self.worker = JobWorker(self.store, loader, preparer, engine, settings.jobs, metrics)
        self.services = ApiServices(
            keys=settings.keys,
            limits=settings.limits,
            reader=RequestReader(settings.limits, policy),
            loader=loader,
            answerer=SyncAnswerer(engine, preparer, settings.method, settings.engine.model),
            engine=engine,
            store=self.store,
            worker=self.worker,
            metrics=metrics,
            model=settings.engine.model,
            method=settings.method.identity(),
            poll_interval_s=settings.jobs.poll_interval_s,
        )
        self.worker.start()

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.services)

    async def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            await worker.stop()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


def build_application(config: ServingConfig, keys: ApiKeys) -> Any:
    """The Serve application for `config`; `keys` are the API keys' digests."""
    from ray import serve

    engine_options = config.engine_deployment.serve_options()
    engine_options["ray_actor_options"]["runtime_env"] = {"env_vars": ENGINE_ACTOR_ENV_VARS}
    engine_deployment = serve.deployment(EngineServer, name="engine").options(
        max_constructor_retry_count=ENGINE_CONSTRUCTOR_RETRIES,
        # One access-log line per model call would drown the API's per-request lines.
        logging_config={"enable_access_log": False},
        **engine_options,
    )
    api_deployment = serve.deployment(serve.ingress()(ApiServer), name="api").options(
        **config.ingress_deployment.serve_options()
    )
    settings = ApiSettings(
        engine=config.engine,
        method=config.method,
        store_url=config.store.url,
        limits=config.limits,
        uris=config.uris,
        jobs=config.jobs,
        keys=keys,
    )
    return api_deployment.bind(settings, engine_deployment.bind(config.engine))


def app_builder(args: dict[str, str]) -> Any:
    """The application for a Serve config file (KubeRay's RayService `serveConfigV2`):
    `import_path: serving.app:app_builder` with `args: {config: /path/to/serving.yaml}`. API
    keys come from the config's `auth.api_keys_env` (a Kubernetes secret in infra/k8s)."""
    from pathlib import Path

    from connectors.engines import models
    from serving.config import load_config
    from serving.security import api_keys_of

    config = load_config(Path(args["config"]) if args.get("config") else None)
    config = dataclasses.replace(config, engine=config.engine.resolved())
    keys = api_keys_of(config)
    models.resolve(config.engine.model)
    return build_application(config, keys)
