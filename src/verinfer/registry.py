"""Named choices: one small typed registry for every "pick one by name" table of verinfer (noise
backends, kernel strategies, determinism policies, acceptance rules, providers, references,
detectors).

    NOISE = Registry[NoiseBackend]("noise backend")
    NOISE.add("keyed", KeyedBackend())          # or, on a function or class:  @RULES.register("kl")
    NOISE.get("keyed")                          # the entry; an unknown name raises UnknownNameError:
    NOISE.get("mystery")                        #   "unknown noise backend 'mystery'
                                                #     -> choose one of vllm-cpu, keyed, ..."
    NOISE.names()                               # ("vllm-cpu", "keyed", ...), registration order:
                                                #   the choices a CLI option offers

A Registry is a read-only Mapping (iteration, `in`, `len`, `registry[name]`, `dict(registry)`), so
code that treated the old hand-written dicts as dicts keeps working; `registry[name]` and
`registry.get(name)` raise the same UnknownNameError, `registry.get(name, default)` returns default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from verinfer.errors import UnknownNameError

T = TypeVar("T")
_MISSING = object()


class Registry(Mapping[str, T], Generic[T]):
    """name -> entry, in registration order. `kind` names what the entries are in errors."""

    def __init__(self, kind: str, entries: Mapping[str, T] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        for name, obj in (entries or {}).items():
            self.add(name, obj)

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name` (each name once)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = obj
        return obj

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: register the function or class under `name` (default: its `name` attribute,
        else its __name__)."""

        def deco(obj: T) -> T:
            key = name or getattr(obj, "name", None) or obj.__name__  # type: ignore[attr-defined]
            return self.add(key, obj)

        return deco

    def get(self, name: str, default=_MISSING) -> T:  # type: ignore[override]
        """The entry called `name`; unknown: UnknownNameError naming the choices (or `default`)."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            if default is not _MISSING:
                return default
            raise UnknownNameError(f"unknown {self.kind} {name!r}", fix=f"choose one of {', '.join(self)}") from None

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"
