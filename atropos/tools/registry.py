"""Tools the model can call: name, description, JSON schema, where they run, and toolsets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel

from atropos.errors import ConfigError
from atropos.sandbox.contract import tools as sandbox_tools

Kind = Literal["sandbox", "external"]

# Every sandbox toolset is on by default (in the order the definitions name them); "web" only with a ToolServer.
DEFAULT_TOOLSETS = tuple(dict.fromkeys(spec.toolset for spec in sandbox_tools.TOOLS.values() if spec.toolset))


class Tool(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]
    kind: Kind
    toolset: str

    def openai_schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    @classmethod
    def default(cls, *, with_web: bool = False) -> ToolRegistry:
        reg = cls()
        for spec in sandbox_tools.TOOLS.values():  # derived from the definitions: none can be missed
            if spec.toolset is not None:
                reg.register(Tool(name=spec.name, description=spec.description, parameters=_schema(spec.args),
                                  kind="sandbox", toolset=spec.toolset))
        if with_web:
            from atropos.tools import web

            for name, args in web.WEB_TOOLS.items():
                reg.register(Tool(name=name, description=(args.__doc__ or "").strip(), parameters=_schema(args),
                                  kind="external", toolset="web"))
        return reg

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ConfigError(f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def names(self) -> list[str]:
        return sorted(self._tools)

    def tools(self) -> list[Tool]:
        return [self._tools[n] for n in self.names()]

    @property
    def toolsets(self) -> set[str]:
        return {t.toolset for t in self._tools.values()}

    def select(self, enabled_toolsets: Iterable[str] | None = None,
               disabled_toolsets: Iterable[str] = ()) -> ToolRegistry:
        """The registry restricted to ``enabled_toolsets`` (all when None) minus ``disabled_toolsets``."""
        enabled = set(self.toolsets if enabled_toolsets is None else enabled_toolsets)
        disabled = set(disabled_toolsets)
        unknown = (enabled | disabled) - self.toolsets
        if unknown:
            raise ConfigError(f"unknown toolset(s) {sorted(unknown)}; known: {sorted(self.toolsets)}")
        return ToolRegistry(t for t in self._tools.values() if t.toolset in enabled - disabled)

    def schemas(self) -> list[dict[str, Any]]:
        return [self._tools[n].openai_schema() for n in self.names()]

