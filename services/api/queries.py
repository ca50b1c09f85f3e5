"""Query parameters a ``/v1`` route does not take are refused, never ignored.

A typo (``?tsak=table``) silently ignored would answer another task than the caller asked for; so
every ``/v1`` route answers a parameter it does not document with 400 ``invalid_request`` naming
it and the ones it takes. What a route takes is read from the route itself, the same place its
OpenAPI spec comes from: the parameters FastAPI reads (``Query``) and those the route documents in
``openapi_extra`` (``POST /v1/ocr``'s options, read by the endpoint itself).
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.datastructures import QueryParams

from schemas.errors import ErrorCode
from services.api.errors import ApiError

#: Paths whose routes refuse unknown query parameters.
CHECKED_PREFIX = "/v1/"
#: Unknown names quoted in one message at most (each cut to 64 characters).
NAMES_SHOWN = 10


def query_names(route: APIRoute) -> tuple[str, ...]:
    """The query parameters ``route`` takes, in the order its spec lists them: those FastAPI reads
    (their aliases, dependencies included), then those documented in its ``openapi_extra``."""
    names: list[str] = []
    pending = [route.dependant]
    while pending:
        dep = pending.pop(0)
        names += [field.alias for field in dep.query_params]
        pending += dep.dependencies
    names += [p["name"] for p in (route.openapi_extra or {}).get("parameters", []) if p.get("in") == "query"]
    return tuple(dict.fromkeys(names))


def unknown_query_error(query: QueryParams, known: tuple[str, ...], route: str) -> ApiError | None:
    """The 400 ``invalid_request`` for the parameters of ``query`` not in ``known`` (None when
    there are none), e.g. ``unknown query parameter 'tsak': GET /v1/ocr/{request_id} takes wait``.

    Args:
        query: The request's query parameters.
        known: The names the route takes (:func:`query_names`).
        route: The method and path template, as the message names the route.
    """
    unknown = [name for name in dict.fromkeys(query.keys()) if name not in known]
    if not unknown:
        return None
    shown = ", ".join(repr(name[:64]) for name in unknown[:NAMES_SHOWN])
    if len(unknown) > NAMES_SHOWN:
        shown += f" and {len(unknown) - NAMES_SHOWN} more"
    noun = "parameter" if len(unknown) == 1 else "parameters"
    return ApiError(ErrorCode.INVALID_REQUEST,
                    f"unknown query {noun} {shown}: {route} takes {', '.join(known) if known else 'none'}")


def route_label(route: APIRoute) -> str:
    """``METHOD /path/{template}`` of ``route`` (methods sorted, joined by ``|``)."""
    return f"{'|'.join(sorted(route.methods or ()))} {route.path}"


class KnownQueryRoute(APIRoute):
    """A route that, under :data:`CHECKED_PREFIX`, answers a query parameter it does not take with
    400 ``invalid_request`` (:func:`unknown_query_error`) before its parameters are read or its
    endpoint runs. Set as the app router's ``route_class`` before the routes are added."""

    def get_route_handler(self):
        """FastAPI's handler of this route, behind the check when the path is under ``/v1/``."""
        handler = super().get_route_handler()
        if not self.path.startswith(CHECKED_PREFIX):
            return handler
        known, label = query_names(self), route_label(self)

        async def checked(request):
            if (err := unknown_query_error(request.query_params, known, label)) is not None:
                raise err
            return await handler(request)

        return checked
