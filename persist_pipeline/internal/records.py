"""Faster construction of frozen slotted dataclasses on the commit path.

A frozen dataclass's generated ``__init__`` sets each field with
``object.__setattr__(self, name, value)``, which costs a generic attribute lookup per
field. :func:`quick_init` gives such a class an ``__init__`` with the same signature that
sets each slot through the slot's own descriptor instead, or, for a class of many
fields, builds the instance as a plain slotted twin of the class and then gives it its
class: the instance is as immutable as before (assignment still raises
``FrozenInstanceError``), it is only made faster.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of ``cls`` (a frozen, slotted dataclass whose fields all
    take plain defaults, without ``__post_init__``) by one that fills its slots
    directly. Apply it above ``@dataclass``. A field with ``init=False`` (and a plain
    default) is set to its default, as the generated ``__init__`` does.

    Raises:
        TypeError: ``cls`` is not such a dataclass.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if not is_dataclass(cls) or params is None or not params.frozen \
            or "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init needs a frozen, slotted dataclass without "
                        f"__post_init__, got {cls!r}")
    env: dict[str, Any] = {}
    args: list[str] = []
    body: list[str] = []
    for f in fields(cls):
        if f.kw_only or f.default_factory is not MISSING or (not f.init
                                                              and f.default is MISSING):
            raise TypeError(f"quick_init: field {f.name} of {cls.__name__} is not a plain "
                            f"positional field")
        if not f.init:
            env[f"_default_{f.name}"] = f.default
            env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
            body.append(f"    _set_{f.name}(self, _default_{f.name})")
            continue
        if f.default is MISSING:
            args.append(f.name)
        else:
            env[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        body.append(f"    _set_{f.name}(self, {f.name})")
    if len(body) >= TWIN_MIN_FIELDS and cls.__bases__ == (object,):
        return _built_through_twin(cls, args, fields(cls))
    source = f"def __init__(self, {', '.join(args)}):\n" + ("\n".join(body) or "    pass")
    exec(source, env)  # noqa: S102 - built here from the class's own field names
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - replacing a method on purpose
    return cls


#: From this many fields on, a class is built through its twin (see
#: :func:`_built_through_twin`): its fixed cost (a ``__new__`` call and a class
#: assignment) is then less than what the slot setters cost (measured under callgrind:
#: 7 fields, 6.5k instructions through the setters, 3.9k through the twin).
TWIN_MIN_FIELDS = 6


def _built_through_twin(cls: type[T], args: list[str], of_cls: tuple[Field[Any], ...]
                        ) -> type[T]:
    """Make ``cls(...)`` fill a plain slotted twin of ``cls`` (the same slots, no
    ``__setattr__`` of its own, so each field is one specialized slot store) and then
    give the instance its class: the slots lie where ``cls``'s descriptors read them,
    and the instance is a ``cls`` as immutable as one built by the generated
    ``__init__``. ``cls`` gets a ``__new__`` with the generated ``__init__``'s
    signature, ``object``'s ``__init__``, and a ``__reduce__`` that builds copies and
    unpickled instances through it (``object.__new__(cls)`` alone would leave them
    empty)."""
    slots = cls.__dict__["__slots__"]
    twin = type(f"_{cls.__name__}Slots", (), {"__slots__": slots, "__module__": cls.__module__})
    env: dict[str, Any] = {"_new": object.__new__, "_Twin": twin}
    names: list[str] = []
    body: list[str] = []
    for f in of_cls:
        if f.init:
            names.append(f.name)
            body.append(f"    self.{f.name} = {f.name}")
        else:
            env[f"_default_{f.name}"] = f.default
            body.append(f"    self.{f.name} = _default_{f.name}")
        if f.default is not MISSING:
            env[f"_default_{f.name}"] = f.default
    values = "".join(f"self.{n}, " for n in names)
    source = (f"def __new__(cls, {', '.join(args)}):\n    self = _new(_Twin)\n"
              + "\n".join(body) + "\n    self.__class__ = cls\n    return self\n"
              f"def __reduce__(self):\n    return type(self), ({values})\n")
    exec(source, env)  # noqa: S102 - built here from the class's own field names
    for name in ("__new__", "__reduce__"):
        method = env[name]
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        method.__module__ = cls.__module__
    env["__new__"].__doc__ = cls.__init__.__doc__
    setattr(cls, "__new__", env["__new__"])  # noqa: B010 - replacing a method on purpose
    setattr(cls, "__reduce__", env["__reduce__"])  # noqa: B010
    setattr(cls, "__init__", object.__init__)  # noqa: B010
    return cls
