"""System-prompt presets, one `.txt` file each under `presets/`."""

from __future__ import annotations

from fastapi import APIRouter

from config import ROOT
from schemas import Preset

PRESETS = ROOT / "presets"
PROMPTS = ROOT / "prompts"

router = APIRouter(prefix="/api/presets", tags=["presets"])


def read_presets() -> list[dict]:
    return [{"name": p.stem, "text": p.read_text(encoding="utf-8").strip()} for p in sorted(PRESETS.glob("*.txt"))]


@router.get("", response_model=list[Preset])
async def presets() -> list[dict]:
    return read_presets()
