"""The contract of the REST API under /api/gpumigrate: one JSON Schema (draft 2020-12) of every JSON
request and response body, ``api.schema.json`` beside this file, one definition each under ``$defs``.

:data:`ROUTES` says which route takes and answers which definition. The handlers check every request
body with :func:`validate` (a :class:`ContractError` is a 400 that names the field and says what it
may be); tests/test_contract.py checks the server's live answers; the JupyterLab panel's types
(labextension/src/contract.ts) are generated from the same file with ``npm run gen:types``.
"""

from __future__ import annotations

import copy
import functools
import json
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource

SCHEMA_FILE = "api.schema.json"

#: The deepest a body may nest (objects and lists in one another). The API's bodies nest 5 deep at
#: most; anything much deeper is refused before it is looked at further.
MAX_DEPTH = 32


class ContractError(ValueError):
    """A body that the API's schema does not allow; the message names the field and what it may be."""

    http_status = 400

    def __init__(self, message: str, definition: str = "", path: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        #: the schema definition the body was checked against (``Kernel``, ``MigrateRequest``...)
        self.definition = definition
        #: where in the body: keys and list positions
        self.path = path


@dataclass(frozen=True)
class Route:
    """One method of one route under /api/gpumigrate, and the definitions of its JSON bodies."""

    method: str
    #: the path under /api/gpumigrate, with {placeholders}
    path: str
    #: the definition of its request body; None when it takes none, or not JSON
    request: str | None
    #: status of success -> the definition of its answer (None: no body, or not JSON). Every error
    #: status answers an ``ErrorBody``.
    responses: dict[int, str | None] = field(default_factory=dict)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/kernels", None, {200: "KernelList"}),
    Route("GET", "/kernels/{kernel_id}", None, {200: "Kernel"}),
    Route("POST", "/kernels/{kernel_id}/suspend", "SuspendRequest", {202: "Operation"}),
    Route("POST", "/kernels/{kernel_id}/resume", "ResumeRequest", {202: "Operation"}),
    Route("POST", "/kernels/{kernel_id}/migrate", "MigrateRequest", {202: "Operation"}),
    Route("POST", "/kernels/{kernel_id}/transplant", "TransplantRequest", {202: "Operation", 200: "TransplantSurvey"}),
    Route("POST", "/kernels/{kernel_id}/back", "BackRequest", {202: "Operation"}),
    Route("GET", "/operations", None, {200: "OperationList"}),
    Route("GET", "/operations/{op_id}", None, {200: "Operation"}),  # ?after=N: once past version N
    Route("GET", "/gpus", None, {200: "GpuList"}),
    Route("GET", "/refused", None, {200: "RefusedList"}),
    Route("POST", "/gpus/{index}/drain", "DrainRequest", {202: "Operation"}),
    # For peer servers only, with "Authorization: gpumigrate-peer <token>" (handlers/peer.py).
    Route("POST", "/peer/check", "PeerCheckRequest", {200: "PeerCheckResponse"}),
    Route("POST", "/peer/transplants/check", "PeerTransplantCheckRequest", {200: "PeerCheckResponse"}),
    Route("POST", "/peer/images/{kernel_id}", "PeerImagesRequest", {201: "PeerKernelRef"}),
    Route("GET", "/peer/images/{kernel_id}", None, {200: "PeerImageListing"}),
    Route("POST", "/peer/images/{kernel_id}/complete", "PeerCompleteRequest", {200: "PeerKernelRef"}),
    Route("POST", "/peer/images/{kernel_id}/prefetch", "PeerPrefetchRequest", {200: "PeerPrefetched"}),
    Route("PUT", "/peer/images/{kernel_id}/{name}", None, {201: "PeerImageStored"}),  # the file's bytes
    Route("GET", "/peer/images/{kernel_id}/{name}", None, {200: None}),  # the file's bytes
    Route("GET", "/peer/kernels/{kernel_id}", None, {200: "PeerGuest"}),
    Route("DELETE", "/peer/kernels/{kernel_id}", None, {204: None}),
    Route("POST", "/peer/kernels/{kernel_id}/restore", "PeerRestoreRequest", {200: "PeerRestored"}),
    Route("POST", "/peer/kernels/{kernel_id}/dump", "PeerDumpRequest", {200: "PeerDumped"}),
    Route("POST", "/peer/kernels/{kernel_id}/resume", "PeerResumeRequest", {200: "PeerRestored"}),
    Route("POST", "/peer/kernels/{kernel_id}/signal", "PeerSignalRequest", {200: "PeerSignalled"}),
    Route("POST", "/peer/kernels/{kernel_id}/transplant", "PeerTransplantRequest", {200: "PeerTransplanted"}),
    Route("POST", "/peer/kernels/{kernel_id}/switch", "PeerSwitchRequest", {200: "PeerSwitched"}),
    Route("GET", "/peer/kernels/{kernel_id}/channels", None, {101: None}),  # a WebSocket: the relay
)


@functools.cache
def document() -> dict[str, Any]:
    """The whole schema document (do not change it: it is shared)."""
    return json.loads(files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def names() -> list[str]:
    """The definitions that :func:`validate` and :func:`schema` take."""
    return sorted(document()["$defs"])


def schema(name: str) -> dict[str, Any]:
    """Definition ``name`` of the schema (``Kernel``, ``Operation``, ``MigrateRequest``...), a copy of
    it as it is written there: its ``$ref`` point into the document (``#/$defs/...``)."""
    try:
        return copy.deepcopy(document()["$defs"][name])
    except KeyError:
        raise ValueError(f"The API schema has no definition {name!r}; it has {', '.join(names())}.") from None


def _open(node: Any) -> Any:
    """A copy of a schema node whose objects allow fields they do not describe."""
    if isinstance(node, dict):
        return {k: _open(v) for k, v in node.items() if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_open(v) for v in node]
    return node


def _key(value: Any) -> str:
    """``value`` as a text that two JSON values share exactly when JSON Schema calls them equal (1 and 1.0
    are, true and 1 are not)."""
    def plain(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return json.dumps(plain(value), sort_keys=True)


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """uniqueItems in one pass: jsonschema's own compares every pair of a list that mixes types (a body of
    8,000 such items held the server's event loop 19 s)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[str] = set()
    for item in instance:
        key = _key(item)
        if key in seen:
            yield ValidationError(f"{item!r} is there more than once")
            return
        seen.add(key)


_Validator = validators.extend(Draft202012Validator, {"uniqueItems": _unique_items})


@functools.cache
def _validator(name: str, strict: bool = True) -> Draft202012Validator:
    schema(name)  # a clear error for an unknown name
    doc = document() if strict else _open(document())
    registry: Registry = Registry().with_resource(doc["$id"], Resource.from_contents(doc))
    return _Validator({"$ref": f"{doc['$id']}#/$defs/{name}"}, registry=registry,
                      format_checker=Draft202012Validator.FORMAT_CHECKER)


def validate(name: str, data: Any, strict: bool = True) -> None:
    """Check ``data`` against definition ``name``; raise :class:`ContractError` (HTTP 400) with one
    sentence that names the first field at fault and says what it may be.

    ``strict=False`` lets objects carry fields the schema does not describe: for a client reading a
    server of another (newer) version, which may answer with more than this one knows."""
    depth = _depth(data)
    if depth > MAX_DEPTH:
        raise ContractError(f"The body nests objects and lists more than {MAX_DEPTH} levels deep; none of this API's "
                            "bodies nests more than a few.", name)
    try:
        errors = list(_validator(name, strict).iter_errors(data))
    except RecursionError:  # belt and braces: _depth keeps bodies far from Python's limit
        raise ContractError("The body nests too deeply to be checked.", name) from None
    if errors:
        error = min(errors, key=_rank)
        raise ContractError(_sentence(error), name, tuple(error.absolute_path))


def is_valid(name: str, data: Any) -> bool:
    """Whether ``data`` matches definition ``name`` (:func:`validate` says why not)."""
    try:
        validate(name, data)
    except ContractError:
        return False
    return True


# -- the sentences ------------------------------------------------------------------------------------

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 2, 60, 60, 4, 4

_COMBINATORS = ("anyOf", "oneOf", "allOf", "not")


def _depth(data: Any) -> int:
    """How deep lists and objects nest in ``data`` (without recursion: the body may be hostile)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children: Iterator[Any] = iter(value.values())
        elif isinstance(value, list):
            children = iter(value)
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _rank(error: ValidationError) -> tuple[int, int]:
    """Which error to tell first: a body that is not an object, unknown fields, a field's value, a
    missing field, then a rule across fields."""
    if error.validator == "type" and not error.absolute_path:
        order = 0
    elif error.validator == "additionalProperties":
        order = 1
    elif error.validator in _COMBINATORS:
        order = 4
    elif error.validator == "required":
        order = 3
    else:
        order = 2
    return order, len(error.absolute_path)


def _where(path: Any) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _label(path: Any, start: bool = True) -> str:
    if path:
        return f"'{_where(path)}'"
    return "The body" if start else "the body"


def _kind(schema: Any) -> str:
    """What a (sub)schema allows, in words."""
    if not isinstance(schema, dict):
        return "anything" if schema is True else "nothing"
    if "$ref" in schema:
        return _kind(_resolve(schema["$ref"]))
    if "enum" in schema:
        return "one of " + ", ".join("null" if v is None else str(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    if ("anyOf" in schema or "oneOf" in schema) and "type" not in schema:  # else a rule across its fields
        return " or ".join(dict.fromkeys(_kind(s) for s in schema.get("anyOf") or schema["oneOf"]))
    types = schema.get("type")
    if types is None and "pattern" in schema:
        types = "string"
    kinds = [_type_words(t, schema) for t in ([types] if isinstance(types, str) else types or [])]
    return " or ".join(kinds) or "anything"


def _type_words(kind: str, schema: dict[str, Any]) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if kind in ("integer", "number"):
        words = "a whole number" if kind == "integer" else "a number"
        if low is not None and high is not None:
            return f"{words} from {low} to {high}"
        if low is not None:
            return f"{words} >= {low}"
        return f"{words} <= {high}" if high is not None else words
    if kind == "string":
        words = "a non-empty string" if schema.get("minLength", 0) >= 1 else "a string"
        if "format" in schema:
            words += f" in {schema['format']} format"
        return f"{words} matching {schema['pattern']}" if "pattern" in schema else words
    if kind == "array":
        least, most = schema.get("minItems"), schema.get("maxItems")
        if least is not None and least == most:
            return f"a list of {least} items"
        if least:
            return f"a list of at least {least} item{'s' if least > 1 else ''}"
        return "a list"
    return {"object": "a JSON object", "boolean": "true or false", "null": "null"}.get(kind, kind)


def _resolve(ref: str) -> Any:
    node: Any = document()
    for part in ref.split("#", 1)[1].strip("/").split("/"):
        node = node[part]
    return node


def _about(schema: Any, lead: str = " ") -> str:
    described = schema.get("description") if isinstance(schema, dict) else None
    return f"{lead}{described.rstrip('.')}" if described else ""


def _sentence(error: ValidationError) -> str:
    path, value, sub = error.absolute_path, error.instance, error.schema
    got = _short.repr(value)
    if error.validator == "additionalProperties" and isinstance(value, dict):
        known = sorted(sub.get("properties", {}))
        extra = sorted(k for k in value if k not in known)
        where = f" in {_label(path)}" if path else ""
        return f"Unknown field(s) {', '.join(extra)}{where}; allowed fields: {', '.join(known) or 'none'}."
    if error.validator == "required" and isinstance(value, dict):
        missing = [k for k in error.validator_value if k not in value]
        name = missing[0] if missing else "?"
        about = _about(sub.get("properties", {}).get(name), ": ")
        return f"{_label(path)} needs the field '{name}'{about}."
    if error.validator in _COMBINATORS and "x-message" in sub:
        return str(sub["x-message"])
    if "propertyNames" in error.relative_schema_path:
        return f"The field names of {_label(path, start=False)} must each be {_kind(sub)} (got {got})."
    about = _about(sub, ": ") if path else ""
    if error.validator == "uniqueItems" and isinstance(value, list):
        seen: set[str] = set()
        twice = next((item for item in value if _key(item) in seen or seen.add(_key(item))), None)
        return f"{_label(path)} names {json.dumps(twice)} more than once (got {got}){about}."
    if error.validator in ("enum", "const"):
        return f"{_label(path)} is {_kind(sub)} (got {got}){about}."
    return f"{_label(path)} must be {_kind(sub)} (got {got}){about}."
