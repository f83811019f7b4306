"""The unpickler of DCP's ``.metadata``: builds only allowlisted types, sets state only on what it
built.

A ``find_class`` allowlist alone restricts which globals a pickle names, not what ``BUILD`` does:
CPython's unpickler ``setattr``s a ``BUILD``'s slot state onto whatever object is on the stack, a
class it looked up included (a ``.metadata`` accepted by the allowlist set
``argparse.Namespace.ckpt_trust_pickles = True`` class-wide, and replaced
``torch.serialization._get_layout.cache``), and enum classes hand back their shared members. Torch's
own ``weights_only`` unpickler (``torch/_weights_only_unpickler.py``) has the rules needed (BUILD
only on allowlisted types, containers filled only when they are containers, no persistent ids)
but reads protocol 2 only: DCP writes ``.metadata`` with ``pickle.dump`` at protocol 4
(``STACK_GLOBAL``, ``FRAME``, ``MEMOIZE``), which it refuses.

``MetadataUnpickler`` is CPython's pure-Python unpickler (``pickle._Unpickler``) with those rules
on every opcode that calls or mutates, tightened to objects rather than types:

- globals (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ``, ``EXT*``): ``find_class``, an exact
  lookup in the allowlist it is given (``safe_unpickle.allowed_globals``);
- ``BUILD``: only on an object this unpickler created (``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``,
  ``INST``, ``OBJ``) whose type is an allowlisted class other than an enum (``Enum(value)``
  returns the shared member); and a NumPy dtype (NumPy hands back its shared builtin dtypes) only
  restating the state it already has;
- ``SETITEM(S)``, ``APPEND(S)``, ``ADDITEMS``: only into a ``dict``, ``list``, ``set`` or an
  ``OrderedDict`` it created;
- ``PERSID``, ``BINPERSID``: refused.

Each refusal is the caller's ``refuse(reason)`` exception, raised before the opcode acts. Being
pure Python, it is slower than the C unpickler: a 0.63 MB ``.metadata`` (3,000 tensors) read in
0.63 s here against 0.07 s (about 1 s per MB). A load reads ``.metadata`` several times:
``safe_unpickle`` reads bytes this unpickler has read whole before (their SHA-256) with the C
unpickler and the same ``find_class``, which runs the same opcodes on the same objects.
"""

from __future__ import annotations

import collections
import enum
import pickle
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["MetadataUnpickler"]

_Opcode = Callable[[Any], None]


def _numpy_dtype() -> type | None:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch
        return None
    return numpy.dtype


class MetadataUnpickler(pickle._Unpickler):
    """``pickle._Unpickler`` building only ``allowed`` (module docstring); ``refuse(reason)``
    returns the exception to raise."""

    dispatch: ClassVar[dict[int, _Opcode]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle._Unpickler's, set by load()
    metastack: list[list[Any]]

    def __init__(
        self, file: Any, allowed: dict[str, Any], refuse: Callable[[str], Exception]
    ) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._refuse = refuse
        self._buildable = {
            value
            for value in allowed.values()
            if isinstance(value, type) and not issubclass(value, enum.Enum)
        }
        self._built: dict[int, Any] = {}  # id -> object (kept alive: ids stay unique)

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise self._refuse(f"the global {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse("a persistent id")

    def _record(self) -> None:
        created = self.stack[-1]
        if type(created) in self._buildable:
            self._built[id(created)] = created

    def _own(self, target: Any) -> bool:
        return self._built.get(id(target)) is target

    def _check_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        numpy_dtype = _numpy_dtype()
        if numpy_dtype is not None and isinstance(target, numpy_dtype):
            if state != target.__reduce__()[2]:
                raise self._refuse(f"a BUILD changing the shared NumPy dtype {target}")
            return
        if not self._own(target):
            raise self._refuse(f"a BUILD setting state on {_described(target)}, not created by it")

    def _check_container(self, target: Any, kinds: tuple[type, ...]) -> None:
        if type(target) in kinds or (type(target) is collections.OrderedDict and self._own(target)):
            return
        raise self._refuse(f"filling a {type(target).__qualname__} as a container")


def _described(target: Any) -> str:
    if isinstance(target, type):
        return f"the class {target.__module__}.{target.__qualname__}"
    kind = type(target)
    return f"an object of {kind.__module__}.{kind.__qualname__} ({target!r:.60})"


def _recording(opcode: _Opcode) -> _Opcode:
    def run(self: MetadataUnpickler) -> None:
        opcode(self)
        self._record()

    return run


def _checked(opcode: _Opcode, check: Callable[[MetadataUnpickler], None]) -> _Opcode:
    def run(self: MetadataUnpickler) -> None:
        check(self)
        opcode(self)

    return run


def _target_below_mark(self: MetadataUnpickler) -> Any:
    return self.metastack[-1][-1]


def _into_dict(self: MetadataUnpickler) -> None:  # SETITEM: dict, key, value on the stack
    self._check_container(self.stack[-3], (dict,))


def _into_list(self: MetadataUnpickler) -> None:  # APPEND: list, item
    self._check_container(self.stack[-2], (list,))


def _below_mark(kinds: tuple[type, ...]) -> Callable[[MetadataUnpickler], None]:
    def check(self: MetadataUnpickler) -> None:  # SETITEMS, APPENDS, ADDITEMS: after a MARK
        self._check_container(_target_below_mark(self), kinds)

    return check


_CODES = pickle._Unpickler.dispatch
for _code in (pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ):
    MetadataUnpickler.dispatch[_code[0]] = _recording(_CODES[_code[0]])
for _code, _check in (
    (pickle.BUILD, MetadataUnpickler._check_build),
    (pickle.SETITEM, _into_dict),
    (pickle.APPEND, _into_list),
    (pickle.SETITEMS, _below_mark((dict,))),
    (pickle.APPENDS, _below_mark((list,))),
    (pickle.ADDITEMS, _below_mark((set,))),
):
    MetadataUnpickler.dispatch[_code[0]] = _checked(_CODES[_code[0]], _check)
