"""``draftwise serve --replicas N``: N engine replicas as one Ray Serve deployment behind one route.

Each replica is the single-process server's own pieces — an ``Engine`` (continuous batching, every method)
and the OpenAI-compatible FastAPI app — in a Ray actor. Ray Serve does the rest, with nothing home-made:

- **routing**: Serve's HTTP proxy sends each request to a replica with room (power-of-two choices over
  ``max_ongoing_requests``, which is the replica's cache rows + its engine queue);
- **back-pressure**: past ``max_queued_requests`` waiting at the proxy, a request is refused with 503;
  a replica whose own engine queue is full refuses with the single server's 503 as well;
- **health checks and restarts**: the controller calls ``check_health`` (the engine thread is alive) every
  few seconds; a replica that dies or fails it is replaced. Its in-flight requests end with an error
  response (5xx), never silently: a request the proxy accepted completes or gets an error;
- **placement**: each replica asks for ``threads`` CPUs, so Ray spreads replicas over the nodes of a cluster.

Started by ``draftwise serve --replicas N`` (a local Ray instance, or ``--ray-address`` for a running
cluster), or as a Serve application with ``serve run draftwise.serve.ray_serve:build_app target=... replicas=2``
or a ``serve deploy`` config (README). Ray is an optional extra: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from ..cpus import usable_cores

APP_NAME = "draftwise"
DEPLOYMENT = "draftwise"


def spec_from_args(args) -> dict:
    """What a replica needs to build its engine, as plain data (shipped to every replica)."""
    from ..errors import InvalidParameterError
    from .engine import engine_config

    cfg = engine_config(args)
    cfg.validate()
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise InvalidParameterError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    threads = args.threads or max(1, usable_cores() // args.replicas)
    from ..api import ModelSpec

    model = ModelSpec.from_args(args)
    return {
        "model": dataclasses.asdict(model), "target": model.target, "threads": threads,
        "engine": dataclasses.asdict(cfg), "name": args.served_model_name or args.target,
        "api_key": args.api_key, "replicas": args.replicas, "max_queued_requests": args.max_queued_requests,
    }


class DraftwiseReplica:
    """One replica: loads the models, builds the engine and its app (started by the app's lifespan)."""

    def __init__(self, spec: dict):
        import torch

        from ..api import ModelSpec, build_decoder
        from ..memory import freeze_heap
        from .app import create_app
        from .engine import Engine, EngineConfig

        torch.set_num_threads(spec["threads"])
        cfg = EngineConfig(**spec["engine"])
        dw = build_decoder(ModelSpec(**spec["model"]), method=cfg.method, progress=False)
        self.engine = Engine(dw, cfg)
        self._app = create_app(self.engine, spec["name"], spec["api_key"])
        freeze_heap()  # a replica's process: what start-up made is never walked by later collections

    def __serve_build_asgi_app__(self):
        return self._app

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread has stopped is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the draftwise engine thread is not running")


def deployment(spec: dict):
    """The Serve application: ``spec['replicas']`` replicas of ``DraftwiseReplica`` behind ``/``."""
    from ray import serve

    eng = spec["engine"]
    per_replica = eng["max_batch"] + eng["max_queue"]  # what one engine takes before its own 503
    queued = spec["max_queued_requests"]
    ingress = serve.ingress()(DraftwiseReplica)
    dep = serve.deployment(
        ingress, name=DEPLOYMENT, num_replicas=spec["replicas"], max_ongoing_requests=per_replica,
        max_queued_requests=-1 if queued is None else queued,
        health_check_period_s=2.0, health_check_timeout_s=60.0, graceful_shutdown_timeout_s=30.0,
        ray_actor_options={"num_cpus": spec["threads"]})
    return dep.bind(spec)


def prepare_models(spec: dict) -> None:
    """Download and convert the models once, in this process, before replicas start: N replicas must not
    convert the same file at once. A converted copy of a GGUF is kept (the default, unless
    ``DRAFTWISE_KEEP_CONVERTED=0`` or the disk lacks room) and each replica maps it, so the weight pages are
    shared between replicas on one machine instead of re-packed into each replica's own memory."""
    from ..api import uses_draft_model
    from ..models import default_draft_weights, load_model

    m = spec["model"]
    names = [(m["target"], m["dtype"])]
    if uses_draft_model(spec["engine"]["method"]) and m["draft"]:
        names.append((m["draft"], m["draft_dtype"] or default_draft_weights(m["dtype"], m["backend"])))
    for name, dtype in names:
        load_model(name, dtype, m["backend"], progress=True)  # a kept copy: see the docstring


def cmd_serve_ray(args) -> int:
    """``draftwise serve --replicas N``: start (or join) Ray, run the application, serve until Ctrl-C."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("draftwise: error: --replicas needs Ray Serve: pip install 'draftwise[ray]'", file=sys.stderr)
        return 2
    from ..errors import DraftwiseError

    spec = spec_from_args(args)
    prepare_models(spec)
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning",
             **({} if args.ray_address else {"num_cpus": usable_cores()}))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        t0 = time.perf_counter()
        serve.run(deployment(spec), name=APP_NAME, route_prefix="/")
    except Exception as e:  # a replica failed to start (bad options surface here), port in use, ...
        serve.shutdown()
        ray.shutdown()
        raise DraftwiseError(f"Ray Serve could not start the deployment: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
    print(f"draftwise: serving {spec['name']!r} (method {spec['engine']['method']}) on "
          f"http://{args.host}:{args.port}/v1 with {spec['replicas']} Ray Serve replicas × {spec['threads']} "
          f"threads (ready in {time.perf_counter() - t0:.0f} s); Ctrl-C stops", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def replica_actors() -> list:
    """Handles of the deployment's live replica actors, from Ray's registry of named actors (no dashboard
    needed); for tests and operators: ``ray.kill`` one to see it replaced."""
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#")]


def running_replicas() -> int:
    """Replicas of the deployment in state RUNNING, from ``serve.status()``."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT].replica_states.get("RUNNING", 0)
