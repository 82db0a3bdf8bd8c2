"""The configuration as DEL and GC read it: each invalid field dropped to its default and
reported, so that a typo never keeps a pod from being torn down (docs/configuration.md "What
DEL does with an invalid field").

ADD, CHECK and STATUS read the configuration strictly (``common.parse``). Teardown cannot
refuse that way: the runtime calls DEL after a failed ADD with the same configuration, and
retries a failed DEL forever, so one bad value in a pushed conflist would keep every pod of
the node Terminating with its addresses held. :func:`parse_for_teardown` applies one rule to
every field of every section:

* a structural problem (code 7: a section that is not an object, a required field missing,
  an unusable ``ipam.type``) still fails the call: the configuration names nothing then;
* a field marked ``IDENTIFIES`` (GC's ``cni.dev/valid-attachments``) is the call's own
  input and is never dropped: a list GC cannot read cannot say what is stale;
* any other value that cannot be honoured (code 2), and the fields of a broken rule over
  several fields (``common.RuleBroken``), are dropped: the model holds the defaults, and
  :attr:`Teardown.dropped` lists what was dropped, for the caller to log;
* a value teardown derives from a dropped field is unknown, never the default's: the host
  veth's name from ``veth_prefix``, the node from ``nodename``/``nodename_file``, the store
  from its location fields (``DatastoreSettings.location_fields``). :meth:`Teardown.need`
  raises :class:`Unknown` and the caller skips that part (there is nothing of that shape to
  remove) and still does the rest. A release from the default store would be a release from
  a store the configuration does not name.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Generic, TypeVar

from cni_config.values import CommonValues, DatastoreValues
from cni_protocol.errors import CniError, Code
from cni_protocol.redact import shown_value

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pydantic import BaseModel
    from pydantic_core import ErrorDetails

    M = TypeVar("M", bound=BaseModel)

#: What a Teardown holds: a model, or the values an earlier validation made
#: (``cni_config.known``); pydantic is imported only by :func:`parse_for_teardown`.
C = TypeVar("C")

#: The verbs that read the configuration with :func:`parse_for_teardown`.
TEARDOWN_VERBS = frozenset({"DEL", "GC"})

#: Enough rounds for field errors, then the rules over the fields left (a section's rule is
#: checked only once its fields are valid), at every nesting level.
_ROUNDS = 8


class Dropped:
    """One field whose value could not be honoured: the configuration holds its default.

    (It and ``Teardown`` are plain classes, not dataclasses: tabby-ipam imports
    nothing else that needs ``dataclasses``, ~10 ms with the ``inspect`` it imports.)"""

    __slots__ = ("path", "problem", "value")

    def __init__(self, path: str, value: object, problem: str) -> None:
        self.path = path
        self.value = value
        self.problem = problem

    def _key(self) -> tuple[str, object, str]:
        return (self.path, self.value, self.problem)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dropped) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.path, self.problem))

    def __repr__(self) -> str:
        value = shown_value(self.path, self.value)
        return f"Dropped(path={self.path!r}, value={value}, problem={self.problem!r})"

    def __str__(self) -> str:
        return f"{self.path}={shown_value(self.path, self.value)} ({self.problem})"


class Unknown(Exception):
    """A value teardown needs derives from an invalid field: there is nothing of that shape
    to remove."""


class Teardown(Generic[C]):
    """A configuration read for teardown: the model, with each dropped field at its default."""

    __slots__ = ("conf", "dropped")

    def __init__(self, conf: C, dropped: tuple[Dropped, ...] = ()) -> None:
        self.conf = conf
        self.dropped = dropped

    def __repr__(self) -> str:
        return f"Teardown(conf={self.conf!r}, dropped={self.dropped!r})"

    def need(self, *paths: str) -> None:
        """Raise :class:`Unknown` naming the first of ``paths`` that was dropped."""
        for d in self.dropped:
            if d.path in paths:
                raise Unknown(f"invalid {d}")

    def warn(self, logger: logging.Logger, verb: str) -> None:
        """One warning per dropped field."""
        for d in self.dropped:
            logger.warning("%s ignores invalid %s: its default is used", verb, d)

    def store(self, settings: DatastoreValues, prefix: str = "ipam.") -> DatastoreValues:
        """``settings`` (the section at ``prefix``), unless a field that says which store it is
        was dropped: then :class:`Unknown` (no store of that shape)."""
        self.need(*(prefix + f for f in settings.location_fields()))
        return settings

    def node_name(self, conf: CommonValues) -> str:
        """``conf.node_name()``, unless it derives from a dropped field or the node-name file
        holds no node name: then :class:`Unknown`."""
        self.need(*conf.node_name_fields())
        try:
            return conf.node_name()
        except CniError as e:
            raise Unknown(str(e)) from None


def parse_for_teardown(model: type[M], config: Mapping[str, object]) -> Teardown[M]:
    """``config`` validated with ``model``, each field that cannot be honoured dropped (see the
    module's rule). A structural problem is the CniError a strict parse raises (code 7)."""
    from pydantic import ValidationError

    try:
        return Teardown(model.model_validate(config))
    except ValidationError as e:
        problems = e.errors(include_url=False)
    raw = copy.deepcopy(dict(config))  # only a configuration with problems
    dropped: list[Dropped] = []
    for _ in range(_ROUNDS):
        plans = [_plan(model, p) for p in problems]
        fatal = next((err for err in plans if isinstance(err, CniError)), None)
        if fatal is not None:
            raise fatal
        progress = False
        for problem, plan in zip(problems, plans, strict=True):
            assert not isinstance(plan, CniError)
            for path in plan:
                found, value = _pop(raw, path)
                if found:
                    dotted = ".".join(path)
                    dropped.append(Dropped(dotted, value, _message(problem)))
                    progress = True
        if not progress:
            break
        try:
            return Teardown(model.model_validate(raw), tuple(dropped))
        except ValidationError as e:
            problems = e.errors(include_url=False)
    raise CniError(  # pragma: no cover - a default that breaks its own model
        Code.INVALID_CONFIG,
        "invalid network configuration",
        "; ".join(str(d) for d in dropped) or "its defaults do not validate",
    )


def _plan(model: type[BaseModel], problem: ErrorDetails) -> list[tuple[str, ...]] | CniError:
    """The fields (paths of input keys) to drop for one of pydantic's problems, or the
    CniError when the problem cannot be dropped."""
    from pydantic import BaseModel

    from cni_config.common import IDENTIFIES, RuleBroken, problem_error

    error = problem_error(problem)
    if error.code != Code.UNSUPPORTED_FIELD:
        return error  # structural (code 7)
    section: type[BaseModel] | None = model
    keys: list[str] = []
    for part in problem["loc"]:
        if section is None or not isinstance(part, str):
            break
        name = _field_name(section, part)
        if name is None:
            break
        info = section.model_fields[name]
        if IDENTIFIES in info.metadata:
            return error
        keys.append(part)
        annotation = info.annotation
        section = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    if section is None and keys:
        return [tuple(keys)]
    # A rule over several fields of the section at ``keys`` (the model itself when empty).
    ctx = problem.get("ctx") or {}
    broken = ctx.get("error")
    if isinstance(broken, RuleBroken):
        return [(*keys, field) for field in broken.fields]
    return error


def _message(problem: ErrorDetails) -> str:
    from cni_config.common import problem_message

    return problem_message(problem)


def _field_name(model: type[BaseModel], key: str) -> str | None:
    """The attribute of ``model`` that input key ``key`` fills (by alias or by name)."""
    for name, info in model.model_fields.items():
        if key in (info.alias, name):
            return name
    return None


def _pop(raw: dict[str, object], path: tuple[str, ...]) -> tuple[bool, object]:
    """Remove ``path`` from the nested input; (whether it was there, its value)."""
    node: object = raw
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict) or path[-1] not in node:
        return False, None
    return True, node.pop(path[-1])
