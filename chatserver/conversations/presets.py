"""Presets: a persona (system prompt text), the tools it allows (its whitelist) and optionally a
default model.

Built-in presets are `presets/NAME.txt`, read-only; the file is exactly the persona text. Their tool
lists and models live in the sidecar `presets/presets.json` (`{"NAME": {"tools": [...], "model"?:
"id"}}`; keys starting with `_` are comments), so a .txt never carries anything but the prompt.
Custom presets are one document per person in the store (`{"schema_version": 1, "presets":
[...]}`: `DATA_DIR/presets.json` with the file store, a key with Redis), changed in one step.
Tool names are checked against the registry's names on every write; names a
server does not register (yet) are left out on reading, so the shipped `default` can list the
attachment tools before they exist.

This module knows nothing of HTTP (preset_routes.py maps its errors) or of conversations.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from chatserver.config import PACKAGE
from chatserver.store.files import OwnerStore, read_small_file
from chatserver.tools import registry as tools
from chatserver.turns import sampling

log = logging.getLogger("chat.presets")

BUILTIN_DIR = PACKAGE / "presets"
SIDECAR = "presets.json"
CUSTOM_FILE = "presets.json"
SCHEMA_VERSION = 1
NAME_PATTERN = r"^[A-Za-z0-9 _-]{1,64}$"
TEXT_MAX_CHARS = 50_000
MODEL_MAX_CHARS = 200
_NAME = re.compile(NAME_PATTERN)


class PresetError(Exception):
    """A preset request that cannot be done; `status` is the HTTP answer the routes give."""

    status = 400


class InvalidPreset(PresetError):
    status = 422


class BuiltinPreset(PresetError):
    status = 400


class PresetNotFound(PresetError):
    status = 404


class PresetExists(PresetError):
    status = 409


class DamagedPresets(PresetError):
    status = 409


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    text: str
    tools: tuple[str, ...]
    model: str | None
    builtin: bool
    # Generation parameters a conversation started from it takes (`turns.sampling.KEYS`).
    params: dict = field(default_factory=dict)

    def out(self) -> dict:
        """The `GET /api/presets` entry."""
        entry = {"name": self.name, "text": self.text, "tools": list(self.tools), "builtin": self.builtin}
        if self.model:
            entry["model"] = self.model
        if self.params:
            entry["params"] = dict(self.params)
        return entry


def presets_for(store: OwnerStore) -> Presets:
    """This person's presets (the built-in ones and their own), checked against the registered tools:
    the one way every route and turn reads them."""
    return Presets(store, tools.registry.names(), accepts=tools.registry.accepts)


class Presets:
    """The built-in presets plus one person's custom ones (kept by their owner-scoped store, so
    nobody sees or changes another's), checked against known tool names."""

    def __init__(self, store: OwnerStore, tool_names: Iterable[str], builtin_dir: Path = BUILTIN_DIR, *,
                 accepts: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.tool_names = tuple(tool_names)
        self.builtin_dir = builtin_dir
        # Beyond the registered names: an MCP server's `server__tool` and `server__*`, listed or not yet.
        self.accepts = accepts

    # Reading

    def builtin(self) -> list[Preset]:
        sidecar = _read_sidecar(self.builtin_dir / SIDECAR)
        out = []
        for path in _builtin_files(self.builtin_dir):
            extra = sidecar.get(path.stem, {})
            out.append(Preset(path.stem, read_small_file(path).decode("utf-8").strip(),
                              self._known(extra.get("tools", [])), extra.get("model") or None, True,
                              _params(extra.get("params"))))
        return out

    async def custom(self) -> list[Preset]:
        return [Preset(p["name"], p["text"], self._known(p["tools"]), p.get("model"), False, _params(p.get("params")))
                for p in _parse(await self.store.read_presets())]

    async def entries(self) -> list[Preset]:
        """Built-in presets first (by name), then custom ones (by name)."""
        builtin = self.builtin()
        taken = {p.name.casefold() for p in builtin}
        return builtin + sorted((p for p in await self.custom() if p.name.casefold() not in taken),
                                key=lambda p: p.name.casefold())

    async def get(self, name: str) -> Preset:
        for preset in await self.entries():
            if preset.name == name:
                return preset
        raise PresetNotFound(f"no preset named {name!r}")

    # Writing

    async def create(self, name: str, text: str, tools: Iterable[str], model: str | None = None,
                     params: dict | None = None) -> Preset:
        preset = self._valid(name, text, tools, model, params)
        if self._builtin_named(name):
            raise BuiltinPreset(f"{name!r} is a built-in preset; built-in presets cannot be changed")

        def add(stored: list[dict]) -> list[dict]:
            if any(p["name"].casefold() == name.casefold() for p in stored):
                raise PresetExists(f"a preset named {name!r} already exists")
            return stored + [_stored(preset)]

        await self._change(add)
        return preset

    async def update(self, name: str, new_name: str, text: str, tools: Iterable[str],
                     model: str | None = None, params: dict | None = None) -> Preset:
        """Replace a custom preset (and rename it when `new_name` differs)."""
        preset = self._valid(new_name, text, tools, model, params)
        if self._builtin_named(name) or self._builtin_named(new_name):
            raise BuiltinPreset("built-in presets cannot be changed; save a copy under a new name")

        def replace(stored: list[dict]) -> list[dict]:
            index = next((i for i, p in enumerate(stored) if p["name"] == name), None)
            if index is None:
                raise PresetNotFound(f"no custom preset named {name!r}")
            if any(i != index and p["name"].casefold() == new_name.casefold() for i, p in enumerate(stored)):
                raise PresetExists(f"a preset named {new_name!r} already exists")
            return [_stored(preset) if i == index else p for i, p in enumerate(stored)]

        await self._change(replace)
        return preset

    async def delete(self, name: str) -> None:
        if self._builtin_named(name):
            raise BuiltinPreset(f"{name!r} is a built-in preset; built-in presets cannot be deleted")

        def remove(stored: list[dict]) -> list[dict]:
            kept = [p for p in stored if p["name"] != name]
            if len(kept) == len(stored):
                raise PresetNotFound(f"no custom preset named {name!r}")
            return kept

        await self._change(remove)

    async def _change(self, change: Callable[[list[dict]], list[dict]]) -> None:
        def document(raw: bytes | None) -> bytes:
            payload = {"schema_version": SCHEMA_VERSION, "presets": change(_parse(raw))}
            return orjson.dumps(payload, option=orjson.OPT_INDENT_2)

        await self.store.update_presets(document)

    # Internals

    def _known(self, names: Iterable[str]) -> tuple[str, ...]:
        return tuple(n for n in dict.fromkeys(names) if self._is_known(n))

    def _is_known(self, name: str) -> bool:
        return name in self.tool_names or (self.accepts is not None and self.accepts(name))

    def _builtin_named(self, name: str) -> bool:
        return any(p.stem.casefold() == name.casefold() for p in _builtin_files(self.builtin_dir))

    def _valid(self, name: str, text: str, tools: Iterable[str], model: str | None,
               params: dict | None = None) -> Preset:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name != name.strip():
            raise InvalidPreset("a preset name is 1-64 letters, digits, spaces, '_' or '-', "
                                "not starting or ending with a space")
        if not text.strip():
            raise InvalidPreset("the preset text is empty")
        if len(text) > TEXT_MAX_CHARS:
            raise InvalidPreset(f"the preset text is over {TEXT_MAX_CHARS} characters")
        names = tuple(dict.fromkeys(tools))
        unknown = [n for n in names if not self._is_known(n)]
        if unknown:
            raise InvalidPreset(f"no such tool: {', '.join(unknown)} (known: {', '.join(self.tool_names) or 'none'})")
        model = model.strip() if model else None
        if model and len(model) > MODEL_MAX_CHARS:
            raise InvalidPreset(f"the model id is over {MODEL_MAX_CHARS} characters")
        return Preset(name, text.strip(), names, model or None, False, _params(params))



def _parse(raw: bytes | None) -> list[dict]:
    """The custom presets of a stored document; DamagedPresets (nothing changes) when it is unreadable."""
    if raw is None:
        return []
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        log.error("damaged custom presets: %s", exc)
        raise DamagedPresets(f"the stored {CUSTOM_FILE} is damaged ({exc}); it was left untouched") from None
    presets = data.get("presets") if isinstance(data, dict) else None
    if not isinstance(presets, list):
        log.error("damaged custom presets: no presets list")
        raise DamagedPresets(f"the stored {CUSTOM_FILE} is damaged (no presets list); it was left untouched")
    return [p for p in presets if isinstance(p, dict) and isinstance(p.get("name"), str)
            and isinstance(p.get("text"), str) and isinstance(p.get("tools"), list)]


def _stored(preset: Preset) -> dict:
    entry = {"name": preset.name, "text": preset.text, "tools": list(preset.tools)}
    if preset.model:
        entry["model"] = preset.model
    if preset.params:
        entry["params"] = dict(preset.params)
    return entry


def _params(value: object) -> dict:
    """A preset's generation parameters: the known keys that are set (the route checked their values)."""
    return {k: v for k, v in value.items() if k in sampling.KEYS and v is not None} if isinstance(value, dict) else {}


_LISTED: dict[Path, tuple[int, list[Path]]] = {}


def _builtin_files(directory: Path) -> list[Path]:
    """The built-in presets' files, by name; listed again only when the directory changed (every
    turn asks for its preset, and listing a directory is a few system calls and a glob)."""
    stamp = os.stat(directory).st_mtime_ns
    known = _LISTED.get(directory)
    if known is None or known[0] != stamp:
        known = _LISTED[directory] = (stamp, sorted(directory.glob("*.txt")))
    return known[1]


def _read_sidecar(path: Path) -> dict[str, dict]:
    try:
        data = orjson.loads(read_small_file(path))
    except FileNotFoundError:
        return {}
    return {k: v for k, v in data.items() if not k.startswith("_") and isinstance(v, dict)}
