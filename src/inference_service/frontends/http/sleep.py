"""vLLM's sleep routes, ``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping``, on the
inference and management ports, mapped to a model version's sleep (``serving/sleep.py``). vLLM
serves one model and takes none; here the query parameter ``model`` names it (required when more
than one model is registered) and ``version`` may name a version (default: the default one).
They change state, so they need the management key when token authorization is on."""

from __future__ import annotations

from aiohttp import web

from inference_service.errors import InvalidArgument
from inference_service.serving.core import InferenceCore
from inference_service.serving.model_version import ModelVersion

SLEEP_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})


def _model(core: InferenceCore, request: web.Request) -> ModelVersion:
    """The version the request names; InvalidArgument (400) without ``model`` while several are registered."""
    name = request.query.get("model", "")
    if not name:
        if len(core.models) != 1:
            raise InvalidArgument(f"the query parameter model is required: {len(core.models)} models are "
                                  "registered", reason="MODEL_NAME_REQUIRED")
        name = next(iter(core.models))
    return core.get(name, request.query.get("version", ""))


def _state(model: ModelVersion) -> web.Response:
    return web.json_response({"model": model.name, "version": model.version, "state": model.sleep.state.value,
                              "is_sleeping": model.sleep.asleep})


def add_sleep_routes(app: web.Application, core: InferenceCore) -> None:
    """Mount the routes on ``app``; each answers 200 with the model's state, as
    ``{"model", "version", "state", "is_sleeping"}`` (vLLM's ``/is_sleeping`` has only the last)."""

    async def sleep(request: web.Request) -> web.Response:
        """Stop the workers after their running requests (vLLM's ``level`` is accepted and ignored)."""
        model = _model(core, request)
        await model.sleep.sleep("POST /sleep")
        return _state(model)

    async def wake_up(request: web.Request) -> web.Response:
        """Wake and answer once a worker is ready; 503 MODEL_LOAD_FAILED when none loads."""
        model = _model(core, request)
        await model.sleep.wake_up()
        return _state(model)

    async def is_sleeping(request: web.Request) -> web.Response:
        return _state(_model(core, request))

    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping, allow_head=False)
