"""``@record``: plain value classes without the ``dataclasses`` machinery at import (the start gate pays for it).

The subset of ``@dataclass`` pvegpu uses, generating the same methods: ``__init__`` (defaults, ``field(default_factory=...)``),
``__repr__`` (``Name(a=1, b='x')``), ``__eq__`` (same class, fields in order), ``__hash__`` (frozen: of the fields; mutable:
unhashable), ``frozen=True`` (assignment raises ``FrozenInstanceError``, an ``AttributeError``), ``__match_args__``.
``dataclasses`` and ``inspect`` (~15 ms together) are never imported here, and nothing is compiled at import or at a
class's first use: each method is a generic one over the class's field table (``__eq__``/``__hash__`` through one C
``attrgetter``); a class instantiated often (``HOT_INITS`` times in a run) gets an ``__init__`` compiled from source
text then, as ``dataclasses`` writes it (a compile costs ~30-250 us: 3.5 ms of a reset's 38, most before its first
signal, when every class compiled its methods at first use). ``fields``, ``replace`` and ``asdict`` are the record
equivalents of the ``dataclasses`` functions; a
``dataclasses`` function given a record still works (``__dataclass_fields__`` is built the first time it is asked for).

Converting a module is one line: ``from pvegpu.record import record`` for ``from dataclasses import dataclass``
(and ``field`` from here too), then ``@record`` for ``@dataclass``. mypy types constructors through
``typing.dataclass_transform`` (under ``TYPE_CHECKING`` only: ``typing`` is not imported at run time).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar, dataclass_transform, overload

    _T = TypeVar("_T")
    _C = TypeVar("_C", bound=type)

__all__ = ["Field", "FrozenInstanceError", "asdict", "field", "fields", "is_record", "record", "replace"]

_FIELDS = "__record_fields__"
_MISSING: Any = object()


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record (as ``dataclasses.FrozenInstanceError``)."""


class Field:
    """One field of a record: its name, its annotation (as written), and its default or default factory."""

    __slots__ = ("default", "default_factory", "name", "type")

    def __init__(self, default: Any = _MISSING, default_factory: Any = _MISSING) -> None:
        self.name = ""
        self.type: Any = None
        self.default = default
        self.default_factory = default_factory

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, type={self.type!r})"


if TYPE_CHECKING:
    @overload
    def field(*, default: _T) -> _T: ...
    @overload
    def field(*, default_factory: Callable[[], _T]) -> _T: ...
    def field(*, default: Any = ..., default_factory: Any = ...) -> Any: ...
else:
    def field(*, default=_MISSING, default_factory=_MISSING):
        """A field's default (``field(default_factory=list)`` for a fresh mutable one per instance)."""
        if default is not _MISSING and default_factory is not _MISSING:
            raise ValueError("cannot give both default and default_factory")
        return Field(default, default_factory)


def _own_fields(cls: type) -> list[Field]:
    out: list[Field] = []
    for name, ann in cls.__dict__.get("__annotations__", {}).items():
        text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
        if text.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, _MISSING)
        f = value if isinstance(value, Field) else Field(value)
        f.name, f.type = name, ann
        if isinstance(value, Field):  # the class attribute is the default (as a dataclass leaves it), or nothing
            if f.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        out.append(f)
    return out


def _compile(src: str, env: dict[str, Any], name: str) -> Any:
    ns: dict[str, Any] = {}
    exec(src, env, ns)  # noqa: S102 - source built here from field names (identifiers), never from input
    return ns[name]


def _set_qualname(cls: type, fn: Any) -> Any:
    fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    return fn


HOT_INITS = 64  # instances of one class in a run after which its __init__ is compiled (a generic one costs ~1-2 us more)


def _generic_init(cls: type, flds: tuple[Field, ...], frozen: bool, src: str, env: dict[str, Any]) -> Any:
    """``__init__`` over the field table: positional then keyword arguments, defaults and factories, the errors a
    function with that signature raises (TypeError); after ``HOT_INITS`` calls the compiled one takes its place."""
    names = tuple(f.name for f in flds)
    index = {n: i for i, n in enumerate(names)}
    put = object.__setattr__ if frozen else setattr
    calls = [0]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the method's own name
        calls[0] += 1
        if calls[0] == HOT_INITS and cls.__dict__.get("__init__") is __init__:
            setattr(cls, "__init__", _set_qualname(cls, _compile(src, env, "__init__")))  # noqa: B010
        if len(args) > len(names):
            raise TypeError(f"{cls.__qualname__}.__init__() takes {len(names) + 1} positional arguments but {len(args) + 1} were given")
        for name in kwargs:
            at = index.get(name)
            if at is None:
                raise TypeError(f"{cls.__qualname__}.__init__() got an unexpected keyword argument {name!r}")
            if at < len(args):
                raise TypeError(f"{cls.__qualname__}.__init__() got multiple values for argument {name!r}")
        for name, value in zip(names, args, strict=False):
            put(self, name, value)
        for f in flds[len(args):]:
            name = f.name
            if name in kwargs:
                value = kwargs[name]
            elif f.default is not _MISSING:
                value = f.default
            elif f.default_factory is not _MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"{cls.__qualname__}.__init__() missing 1 required positional argument: {name!r}")
            put(self, name, value)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _generic_methods(cls: type, names: tuple[str, ...]) -> dict[str, Any]:
    """``__repr__``, ``__eq__`` and ``__hash__`` over the fields, as the dataclass writes them (a tuple of the fields)."""
    from _operator import attrgetter  # the C module: no operator.py

    values: Callable[[Any], tuple[Any, ...]]
    if len(names) > 1:
        values = attrgetter(*names)  # one C call: the tuple of the fields
    elif names:
        one = attrgetter(names[0])
        values = lambda obj: (one(obj),)  # noqa: E731
    else:
        values = lambda obj: ()  # noqa: E731

    def __repr__(self: Any) -> str:  # noqa: N807
        return f"{self.__class__.__qualname__}(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, values(self), strict=True)) + ")"

    def __eq__(self: Any, other: Any) -> Any:  # noqa: N807
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    def __hash__(self: Any) -> int:  # noqa: N807
        return hash(values(self))

    made = {"__repr__": __repr__, "__eq__": __eq__, "__hash__": __hash__}
    for name, fn in made.items():
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
    return made


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


class _LazyDataclassFields:
    """``__dataclass_fields__`` for the ``dataclasses`` functions (tests, benches), built on first use only."""

    def __get__(self, obj: Any, owner: type) -> Any:
        import dataclasses

        made = {}
        for f in fields(owner):
            d = dataclasses.field(default=f.default) if f.default_factory is _MISSING else dataclasses.field(default_factory=f.default_factory)
            d.name, d.type = f.name, f.type
            d._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
            made[f.name] = d
        return made


def _process(cls: Any, frozen: bool) -> Any:
    all_fields: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        for f in base.__dict__.get(_FIELDS, ()):
            all_fields[f.name] = f
    for f in _own_fields(cls):
        all_fields[f.name] = f
    flds = tuple(all_fields.values())
    seen_default = False
    for f in flds:
        has = f.default is not _MISSING or f.default_factory is not _MISSING
        if seen_default and not has:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")
        seen_default = seen_default or has
    env: dict[str, Any] = {"__builtins__": __builtins__, "_MISSING": _MISSING, "_osa": object.__setattr__}
    args, body = [], []
    for i, f in enumerate(flds):
        if f.default_factory is not _MISSING:
            env[f"_f{i}"] = f.default_factory
            args.append(f"{f.name}=_MISSING")
            value = f"_f{i}() if {f.name} is _MISSING else {f.name}"
        else:
            if f.default is not _MISSING:
                env[f"_d{i}"] = f.default
                args.append(f"{f.name}=_d{i}")
            else:
                args.append(f.name)
            value = f.name
        body.append(f"_osa(self, {f.name!r}, {value})" if frozen else f"self.{f.name} = {value}")
    names = tuple(f.name for f in flds)
    src = f"def __init__(self, {', '.join(args)}):\n    " + ("\n    ".join(body) or "pass") + "\n"  # compiled once hot
    made = _generic_methods(cls, names)
    if "__init__" not in cls.__dict__:
        cls.__init__ = _generic_init(cls, flds, frozen, src, env)
    for name in ("__repr__", "__eq__"):
        if name not in cls.__dict__:
            setattr(cls, name, made[name])
    if "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
        # frozen: hashed by the fields; mutable and compared by value: unhashable, as a dataclass
        cls.__hash__ = made["__hash__"] if frozen else None
    if frozen:
        cls.__setattr__ = _frozen_setattr
        cls.__delattr__ = _frozen_delattr
    setattr(cls, "__match_args__", tuple(names))  # noqa: B010 - mypy refuses the attribute form
    setattr(cls, _FIELDS, flds)
    cls.__dataclass_fields__ = _LazyDataclassFields()
    cls.__dataclass_params__ = None  # dataclasses.is_dataclass looks only for __dataclass_fields__
    return cls


if TYPE_CHECKING:
    @overload
    def record(cls: _C, /) -> _C: ...
    @overload
    def record(*, frozen: bool = False) -> Callable[[_C], _C]: ...
    @dataclass_transform(field_specifiers=(field, Field))
    def record(cls: Any = None, /, *, frozen: bool = False) -> Any: ...
else:
    def record(cls=None, /, *, frozen=False):
        """``@record`` or ``@record(frozen=True)``: the class with generated ``__init__``/``__repr__``/``__eq__``/``__hash__``."""
        if cls is None:
            return lambda c: _process(c, frozen)
        return _process(cls, frozen)


def is_record(obj: Any) -> bool:
    """A record or dataclass class or instance (the modules not yet converted meet dataclasses too)."""
    return hasattr(obj if isinstance(obj, type) else type(obj), "__dataclass_fields__")


def fields(obj: Any) -> tuple[Any, ...]:
    """The fields of a record (or dataclass) class or instance, in order."""
    try:
        return tuple(getattr(obj if isinstance(obj, type) else type(obj), _FIELDS))
    except AttributeError:
        pass
    import dataclasses

    return dataclasses.fields(obj)


def replace(obj: _T, /, **changes: Any) -> _T:
    """A new record (or dataclass) like ``obj`` with ``changes`` (every other field passed on as it is)."""
    if not hasattr(type(obj), _FIELDS):
        import dataclasses

        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    for f in fields(obj):
        if f.name not in changes:
            changes[f.name] = getattr(obj, f.name)
    return obj.__class__(**changes)  # type: ignore[no-any-return]


def asdict(obj: Any) -> Any:
    """A record (recursively: records, lists, tuples, dicts) as plain dicts, as ``dataclasses.asdict``."""
    if is_record(obj) and not isinstance(obj, type):
        return {f.name: asdict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[asdict(v) for v in obj])
    if isinstance(obj, list | tuple):
        return type(obj)(asdict(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((asdict(k), asdict(v)) for k, v in obj.items())
    return obj
