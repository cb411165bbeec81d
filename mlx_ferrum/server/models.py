"""The served models and their LoRA adapters: ``GET /v1/models`` (OpenAI's model list) and
vLLM's ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``.

``/v1/models`` lists the served model names, then each registered adapter as its own
model with ``parent`` set to the base model (vLLM's shape: ``root`` is the adapter's
folder, ``max_model_len`` the context). A request names an adapter in ``model`` to use
it (:meth:`~mlx_ferrum.server.serving.OpenAIServing.check_model`). The load and unload
endpoints take vLLM's ``lora_name`` / ``lora_path`` and answer vLLM's plain-text
``Success: ...`` lines; both need ``--enable-lora``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from ..errors import LoraError, UnknownLoraError
from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import OpenAIServing, ServingError

__all__ = ["model_cards", "load_lora_adapter", "unload_lora_adapter", "models_router"]


def model_cards(serving: OpenAIServing) -> list[p.ModelCard]:
    """``/v1/models``: the served names, then each adapter with ``parent`` set to the base."""
    cards = [p.ModelCard(id=n, root=n, max_model_len=serving.max_model_len) for n in serving.model_names]
    for name in serving.engine.list_loras():
        cards.append(p.ModelCard(id=name, root=serving.engine.runner.lora_path(name), parent=serving.model_names[0],
                                 max_model_len=serving.max_model_len))
    return cards


def load_lora_adapter(serving: OpenAIServing, req: p.LoadLoraAdapterRequest) -> str:
    """Register an adapter at run time (vLLM's ``/v1/load_lora_adapter``); blocking (reads the folder).

    Raises:
        ServingError: 400 when LoRA is off, the name is taken (or is a served model
            name), or the adapter is refused (the message says why).
    """
    if not serving.engine.runner.config.enable_lora:
        raise ServingError(400, "LoRA is off: start the server with --enable-lora", param="lora_name")
    if req.lora_name in serving.model_names or req.lora_name in serving.engine.list_loras():
        raise ServingError(400, f"the LoRA adapter {req.lora_name!r} has already been loaded (or is a served model "
                           "name): unload it first or pick another name", param="lora_name")
    try:
        serving.engine.add_lora(req.lora_name, req.lora_path)
    except LoraError as e:
        raise ServingError(400, str(e), param="lora_path") from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


def unload_lora_adapter(serving: OpenAIServing, req: p.UnloadLoraAdapterRequest) -> str:
    """Unregister an adapter at run time (vLLM's ``/v1/unload_lora_adapter``).

    Raises:
        ServingError: 404 for an unknown adapter, 400 when requests still use it or LoRA is off.
    """
    if not serving.engine.runner.config.enable_lora:
        raise ServingError(400, "LoRA is off: start the server with --enable-lora", param="lora_name")
    try:
        serving.engine.remove_lora(req.lora_name)
    except UnknownLoraError as e:
        raise ServingError(404, str(e), param="lora_name", type="NotFoundError") from None
    except LoraError as e:
        raise ServingError(400, str(e), param="lora_name") from None
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."


def models_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """``GET /v1/models`` and the LoRA load / unload routes over ``serving``."""
    router = ApiRouter(limits, dependencies=dependencies)

    @router.get("/v1/models")
    async def models():
        return p.ModelList(data=model_cards(serving)).model_dump()

    @router.post_json("/v1/load_lora_adapter", p.LoadLoraAdapterRequest, name="load_lora_adapter")
    async def load_lora(request: Request):
        body = await router.body(request, p.LoadLoraAdapterRequest)
        return PlainTextResponse(await run_in_threadpool(load_lora_adapter, serving, body))

    @router.post_json("/v1/unload_lora_adapter", p.UnloadLoraAdapterRequest, name="unload_lora_adapter")
    async def unload_lora(request: Request):
        body = await router.body(request, p.UnloadLoraAdapterRequest)
        return PlainTextResponse(await run_in_threadpool(unload_lora_adapter, serving, body))

    return router
