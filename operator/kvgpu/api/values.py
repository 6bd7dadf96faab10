"""Request errors (:class:`RequestError`, :class:`RequestErrors`) and the parsers of one
request value: memory (:func:`parse_memory_mib`), whole numbers, booleans, policies, lists of
types and UUIDs. Each error names the key, the value and the allowed form. Pure, no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvgpu.api.models import (
    MAX_CARD_MEMORY_MIB,
    UUID_PATTERN,
    PolicyName,
)
from kvgpu.api.request_keys import (
    FORM_BOOL,
    FORM_MEMORY,
    FORM_POLICY,
    FORM_TYPES,
    FORM_UUIDS,
)
from kvgpu.core.requests import Policy

_UUID = re.compile(UUID_PATTERN)
_INT = re.compile(r"^[0-9]{1,12}$")
# Kubernetes' quantity grammar in plain ASCII (no spaces, underscores or non-ASCII digits, which
# Python's number parsing would otherwise let through): digits, an optional fraction, then an
# exponent or one suffix.
_MEMORY_SHAPE = re.compile(r"\A[+-]?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|[munkMGTPE])?\Z")
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})
_VALUE_SHOWN = 80
#: Said wherever a milli-suffixed memory value may be the cause: the annotation form sees
#: ``3000m`` itself, a container limit reaches admission as the API server's canonical ``3``.
MILLI_HINT = "m is milli, not MiB: 3000m is 3"


# --------------------------------------------------------------------------- errors


class RequestError(ValueError):
    """An invalid GPU request. ``str(err)`` is the message for the user.

    Message form: ``<key>[ of container "<c>"]: "<value>" <problem>; <allowed form>``.
    """

    def __init__(self, key: str, value: Any, problem: str, allowed: str, container: str | None = None):
        self.key = key
        self.value = value
        self.problem = problem
        self.allowed = allowed
        self.container = container
        where = f' of container "{container}"' if container else ""
        super().__init__(f"{key}{where}: {show(value)} {problem}; {allowed}")


class RequestErrors(RequestError):
    """All errors of one pod; ``errors`` lists them, ``str()`` puts one per line."""

    def __init__(self, errors: Sequence[RequestError]):
        if not errors:
            raise ValueError("RequestErrors needs at least one error")
        first = errors[0]
        super().__init__(first.key, first.value, first.problem, first.allowed, first.container)
        self.errors = tuple(errors)
        self.args = ("\n".join(str(e) for e in self.errors),)

    def __str__(self) -> str:
        return str(self.args[0])


def show(value: Any) -> str:
    """A value quoted for a message: JSON string form, shortened past 80 characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > _VALUE_SHOWN:
        text = text[: _VALUE_SHOWN - 1] + "…"
    return json.dumps(text, ensure_ascii=False)


class _Errors:
    def __init__(self) -> None:
        self.items: list[RequestError] = []

    def add(self, key: str, value: Any, problem: str, allowed: str, container: str | None = None) -> None:
        self.items.append(RequestError(key, value, problem, allowed, container))


# --------------------------------------------------------------------------- value parsers


def _text(v: Any) -> str | None:
    """Annotation and quantity values are strings; YAML integers are tolerated."""
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return None


def parse_memory_mib(key: str, raw: Any, container: str | None = None) -> int:
    """Memory per card in MiB from ``3000``, ``3k`` (both MiB counts), ``3Gi`` or ``3000Mi`` (bytes).

    Returns 0..1048576 (0 = the whole card). Raises :class:`RequestError`.
    """
    text = _text(raw)
    if text is None or text == "" or not _MEMORY_SHAPE.match(text):
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container)
    if text[-1] in "munµ":
        raise RequestError(key, raw, f"uses the suffix {text[-1]}, a fraction of a unit ({MILLI_HINT})",
                           FORM_MEMORY, container)
    try:
        q = parse_quantity(text)
    except (ValueError, ArithmeticError, TypeError):
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container) from None
    if not isinstance(q, Decimal) or not q.is_finite():
        raise RequestError(key, raw, "is not a memory quantity", FORM_MEMORY, container)
    binary = text.endswith("i")
    mib = q / (1 << 20) if binary else q
    if mib < 0:
        raise RequestError(key, raw, "is negative", FORM_MEMORY, container)
    if mib > MAX_CARD_MEMORY_MIB:
        how = "bytes" if binary else "MiB (plain and decimal-suffixed numbers count MiB)"
        raise RequestError(
            key,
            raw,
            f"is more than {MAX_CARD_MEMORY_MIB} MiB (1 TiB) per card, counted in {how}",
            FORM_MEMORY,
            container,
        )
    if mib != mib.to_integral_value():
        raise RequestError(key, raw, "is not a whole number of MiB", FORM_MEMORY, container)
    return int(mib)


def _annotation_int(key: str, raw: Any, lo: int, hi: int, allowed: str) -> int:
    text = _text(raw)
    if text is None or not _INT.match(text):
        raise RequestError(key, raw, "is not a whole number", allowed)
    n = int(text)
    if not lo <= n <= hi:
        raise RequestError(key, raw, "is out of range", allowed)
    return n


def _resource_int(key: str, raw: Any, lo: int, hi: int, allowed: str, container: str) -> int:
    """A container resource value (a Kubernetes quantity) that must be a whole number."""
    text = _text(raw)
    q: Any = None
    if text:
        try:
            q = parse_quantity(text)
        except (ValueError, ArithmeticError, TypeError):
            q = None
    if not isinstance(q, Decimal) or not q.is_finite() or q != q.to_integral_value():
        raise RequestError(key, raw, "is not a whole number", allowed, container)
    if not lo <= q <= hi:
        raise RequestError(key, raw, "is out of range", allowed, container)
    return int(q)


def _bool(key: str, raw: Any) -> bool:
    text = _text(raw) if not isinstance(raw, bool) else ("true" if raw else "false")
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise RequestError(key, raw, "is not a boolean", FORM_BOOL)


def _policy(key: str, raw: Any) -> Policy:
    text = _text(raw)
    if text is not None and text.lower() in (p.value for p in PolicyName):
        return Policy(text.lower())
    raise RequestError(key, raw, "is not a policy kvgpu knows", FORM_POLICY)


def _list(raw: Any) -> tuple[str, ...] | None:
    text = _text(raw)
    if text is None:
        return None
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _types(key: str, raw: Any) -> tuple[str, ...]:
    items = _list(raw)
    if items is None:
        raise RequestError(key, raw, "is not a comma list", FORM_TYPES)
    for it in items:
        if len(it) > 128:
            raise RequestError(key, raw, "has an item longer than 128 characters", FORM_TYPES)
    return items


def _uuids(key: str, raw: Any) -> tuple[str, ...]:
    items = _list(raw)
    if items is None:
        raise RequestError(key, raw, "is not a comma list", FORM_UUIDS)
    for it in items:
        if not _UUID.match(it):
            raise RequestError(key, raw, f"has {show(it)}, which is not a card UUID", FORM_UUIDS)
    return items
