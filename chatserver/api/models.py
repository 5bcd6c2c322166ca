"""The model lineup: built-in models from settings, custom ones added in the page."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from chatserver.api.deps import AdminDep, StateDep
from chatserver.api.schemas import TIERS, Lineup, ModelCreate, ModelPatch

router = APIRouter(prefix="/api/models", tags=["models"])


@router.get("", response_model=Lineup)
async def list_models(state: StateDep) -> dict:
    lineup = await state.lineup()
    prices = await state.turns.costs.prices(wait=True)
    return {
        "default": state.settings.default_model,
        "summarizer": state.settings.summarizer_model,
        "tiers": [
            {"tier": tier, "models": [
                {"id": m.id, "label": m.label, "reasoning": m.reasoning, "custom": m.custom,
                 "cache_markers": m.id not in state.turns.plain_text_models, "tool_runtime": m.tool_runtime,
                 "vision": m.vision,
                 "price": prices[m.id][0].as_json() if m.id in prices else None,
                 "price_source": prices[m.id][1] if m.id in prices else None}
                for m in lineup if m.tier == tier
            ]}
            for tier in TIERS
        ],
    }


@router.post("", status_code=201)
async def add_model(body: ModelCreate, state: StateDep, admin: AdminDep) -> dict:
    if any(m.id == body.id for m in await state.lineup()):
        return JSONResponse({"detail": f"{body.id} is already in the lineup"}, status_code=409)
    custom = await state.store.read_custom_models()
    entry = {"id": body.id, "tier": body.tier}
    if body.tool_runtime is not None:
        entry["tool_runtime"] = body.tool_runtime
    if body.vision is not None:
        entry["vision"] = body.vision
    custom.append(entry)
    await state.store.write_custom_models(custom)
    return await _entry(state, body.id)


@router.patch("/{model_id:path}")
async def change_model(model_id: str, body: ModelPatch, state: StateDep, admin: AdminDep) -> dict:
    """A custom model's `vision`; a built-in model's comes from VISION_MODELS and the gateway."""
    if any(m.id == model_id for m in state.settings.lineup()):
        return JSONResponse({"detail": "built-in models are set in .env (VISION_MODELS), not here"}, status_code=400)
    custom = await state.store.read_custom_models()
    entry = next((m for m in custom if m["id"] == model_id), None)
    if entry is None:
        return JSONResponse({"detail": "no such custom model"}, status_code=404)
    if body.vision is not None:
        entry["vision"] = body.vision
        await state.store.write_custom_models(custom)
    return await _entry(state, model_id)


async def _entry(state: StateDep, model_id: str) -> dict:
    """A custom model as POST and PATCH answer it."""
    model = next(m for m in await state.lineup() if m.id == model_id)
    return {"id": model.id, "tier": model.tier, "custom": True, "tool_runtime": model.tool_runtime,
            "vision": model.vision}


@router.delete("/{model_id:path}", status_code=204)
async def remove_model(model_id: str, state: StateDep, admin: AdminDep) -> Response:
    if any(m.id == model_id for m in state.settings.lineup()):
        return JSONResponse({"detail": "built-in models are set in MODELS (.env), not here"}, status_code=400)
    custom = await state.store.read_custom_models()
    if not any(m["id"] == model_id for m in custom):
        return JSONResponse({"detail": "no such custom model"}, status_code=404)
    await state.store.write_custom_models([m for m in custom if m["id"] != model_id])
    return Response(status_code=204)
