"""The one place where admission asks "what does this pod request?".

:func:`parse` turns a pod dict into a :class:`Parsed`: whether the pod asks for slices at all,
which containers get them (name and whether it is an init container), which of them still lack
the ``nvidia.com/gpu`` request (annotation form), and every request error
as a message naming key, value and allowed form. The real work is done by the API's request
parser (:mod:`kvgpu.api.requests`); this module only adapts its answer to what the webhooks
need, so that mutate and validate never depend on its exact shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.api import requests as api_requests
from kvgpu.core import keys

_HAMI_ANNOTATIONS = frozenset(k.key for k in api_requests.HAMI_KEYS if k.where == "annotation")
_OPERATOR_KEYS = frozenset(
    v for v in vars(keys).values() if isinstance(v, str) and v.startswith(f"{keys.GROUP}/")
)


@dataclass(frozen=True, slots=True)
class SlicedContainer:
    name: str
    init: bool = False


@dataclass(frozen=True, slots=True)
class Parsed:
    requests_slices: bool
    containers: tuple[SlicedContainer, ...] = ()
    errors: tuple[str, ...] = ()
    #: (container, cards): annotation-form containers with slices that request no
    #: ``nvidia.com/gpu`` yet (:func:`kvgpu.api.requests.card_resources_to_add`).
    card_resources: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.requests_slices and not self.errors

    def names(self) -> frozenset[str]:
        return frozenset(c.name for c in self.containers)


def parse(pod: Mapping[str, Any]) -> Parsed:
    """Parse ``pod`` (as the API server sends it: name/uid may still be empty at CREATE).

    Pool defaults are not known at admission (the pool depends on the node), so HAMi's are used:
    they do not change which containers get slices nor whether a value is valid.
    """
    if not api_requests.wants_slices(pod):
        return Parsed(requests_slices=False)
    try:
        req = api_requests.parse_pod(pod)
    except api_requests.RequestErrors as e:
        return Parsed(requests_slices=True, errors=tuple(str(x) for x in e.errors))
    except api_requests.RequestError as e:
        return Parsed(requests_slices=True, errors=(str(e),))
    except Exception as e:  # a parser bug must refuse with a message, never crash the webhook
        return Parsed(requests_slices=True, errors=(f"the GPU request could not be read ({e!r})",))
    if req is None:
        return Parsed(requests_slices=False)
    return Parsed(
        requests_slices=True,
        containers=tuple(SlicedContainer(c.container, c.init) for c in req.containers),
        card_resources=tuple(api_requests.card_resources_to_add(pod).items()),
    )


def is_request_annotation(key: str) -> bool:
    """True for pod annotations that are (or claim to be) part of a GPU request: every
    ``kvgpu.io/`` key the operator does not own, and HAMi's request annotations."""
    if key in _HAMI_ANNOTATIONS:
        return True
    return (key.startswith(f"{keys.GROUP}/") and key not in _OPERATOR_KEYS
            and not keys.is_allocation_annotation(key))
