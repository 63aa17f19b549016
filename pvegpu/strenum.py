"""``StrEnum`` without the ``enum`` module at import (the start gate and the scan's front door pay for it).

Importing ``enum`` costs 2-5 ms (it brings ``functools``, ``collections``, ``types``, ``operator``); the gate and
the scan's early fork need only str-valued word lists (``Place``, ``SignalResult``, ``GateState``). This is the
subset of ``enum.StrEnum`` pvegpu uses, with the same behaviour: each member is an instance of its class and a
``str`` equal to its value (``==``, hashing, ``str()``, ``format``, JSON, ``marshal`` through ``child.plain``);
``.name``, ``.value``; ``Cls(value)`` gives the member (a member gives itself), anything else ``ValueError``;
iteration and ``len`` in definition order; ``repr`` as ``<Cls.NAME: 'value'>``; members are singletons (``is``),
also through ``copy`` and ``pickle``; a member or the member list cannot be reassigned, a class with members
cannot be subclassed. Members are the class body's public names bound to a ``str``.

Converting a module is one line: ``from .strenum import StrEnum`` at run time, ``from enum import StrEnum`` under
``TYPE_CHECKING`` (so mypy types the members as enum members). ``tests/test_lxcconf_grammar.py`` runs the same cases
against ``enum.StrEnum``. Members of different classes with the same value are equal (they are equal strs): compare
members with ``is``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

__all__ = ["StrEnum"]


class _Kind(type):
    """The metaclass: turns the class body's public str attributes into members."""

    def __new__(mcs, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> _Kind:
        for base in bases:
            if getattr(base, "_members_", None):
                raise TypeError(f"{name}: cannot extend {base.__name__}: it has members")
        words = {k: v for k, v in ns.items() if not k.startswith("_") and type(v) is str}
        body = {k: v for k, v in ns.items() if k not in words}
        cls = super().__new__(mcs, name, bases, body)
        members: dict[str, Any] = {}
        by_value: dict[str, Any] = {}
        for key, value in words.items():
            if value in by_value:  # an alias, as enum makes one: the same member under a second name
                members[key] = by_value[value]
                continue
            member: Any = str.__new__(cls, value)  # type: ignore[arg-type]
            member._name_ = key
            members[key] = by_value[value] = member
        type.__setattr__(cls, "_members_", members)
        type.__setattr__(cls, "_by_value_", by_value)
        for key, member in members.items():
            type.__setattr__(cls, key, member)
        return cls

    def __call__(cls, value: object) -> Any:
        by_value = cls.__dict__.get("_by_value_")
        if not by_value:
            raise TypeError(f"{cls.__name__} has no members")
        if type(value) is cls:
            return value
        member = by_value.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return member

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls.__dict__.get("_by_value_", {}).values())

    def __len__(cls) -> int:
        return len(cls.__dict__.get("_by_value_", {}))

    def __contains__(cls, value: object) -> bool:
        return type(value) is cls or (isinstance(value, str) and value in cls.__dict__.get("_by_value_", {}))

    def __setattr__(cls, key: str, value: object) -> None:
        if key in cls.__dict__.get("_members_", {}) or key in ("_members_", "_by_value_"):
            raise AttributeError(f"cannot reassign member {key!r}")
        super().__setattr__(key, value)

    def __delattr__(cls, key: str) -> None:
        if key in cls.__dict__.get("_members_", {}):
            raise AttributeError(f"cannot delete member {key!r}")
        super().__delattr__(key)


class StrEnum(str, metaclass=_Kind):
    """A str enum: subclass it and bind the members' values (str) to public names in the class body."""

    _name_: str

    @property
    def name(self) -> str:
        return self._name_

    @property
    def value(self) -> str:
        return str.__str__(self)

    __str__ = str.__str__  # ``str(member)`` and ``format`` give the value, as enum.StrEnum's do

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name_}: {str.__str__(self)!r}>"

    def __reduce_ex__(self, protocol: object) -> tuple[Any, tuple[str]]:
        return type(self), (str.__str__(self),)  # copy and pickle give the member back

    def __copy__(self) -> StrEnum:
        return self

    def __deepcopy__(self, memo: object) -> StrEnum:
        return self

    def __setattr__(self, key: str, value: object) -> None:
        if key == "_name_" and "_name_" not in self.__dict__:
            object.__setattr__(self, key, value)
            return
        raise AttributeError(f"{type(self).__name__} members are read-only")

    __hash__ = str.__hash__
