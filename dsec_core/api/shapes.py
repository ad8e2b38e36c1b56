"""The JSON shape of an API message, read once from its type hints: a validating decoder, an
encoder, and the JSON Schema that the OpenAPI document shows, so the three cannot disagree.

Records are frozen dataclasses; a field's type is one of ``str``, ``int``, ``float``, ``bool``,
``None``, ``bytes`` (base64 on the wire), ``Any``, unions of these, ``tuple[X, ...]``/
``list[X]``, ``Mapping[str, X]``, or another record (``$ref`` in the document). A field's
``metadata={"schema": {...}}`` adds JSON Schema constraints (``minimum``, ``exclusiveMinimum``,
``maximum``, ``minLength``, ``maxLength``, ``pattern``, ``minItems``) that the decoder enforces
too.

Each decoder and encoder is built once per type and cached: the exec round trip pays a few
microseconds for validation, not a walk over type hints.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from collections.abc import Mapping as AbcMapping
from collections.abc import Sequence as AbcSequence
from typing import Any, Union

from ..errors import DsecError, InvalidSpec

__all__ = [
    "INT64",
    "decoder",
    "encoder",
    "is_record",
    "json_schema",
    "query_decoder",
    "query_encoder",
]

#: Integers on the wire are 64-bit signed, what readers in other languages (and C) can hold.
INT64 = (-(1 << 63), (1 << 63) - 1)

Decoder = Callable[[Any, str], Any]  # (json value, where) -> value
Decode = Callable[[Any], Any]  # the inner form, without names: see _Mismatch
Encoder = Callable[[Any], Any]

_SCALAR_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
    bytes: "a base64 string",
}
_CONSTRAINTS = (
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
)


def is_record(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is Union or isinstance(tp, types.UnionType)


def _sequence_item(tp: Any) -> Any | None:
    """``X`` of ``tuple[X, ...]``, ``list[X]`` or ``Sequence[X]``; None for other types."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    if origin in (list, AbcSequence) and len(args) == 1:
        return args[0]
    return None


def _mapping_value(tp: Any) -> Any | None:
    """``X`` of ``Mapping[str, X]`` or ``dict[str, X]`` (``Any`` for a bare ``dict``)."""
    if tp is dict:
        return Any
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (dict, AbcMapping) and len(args) == 2 and args[0] is str:
        return args[1]
    return None


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


# --- decoding: JSON values in, typed values out ----------------------------------------------
#
# The inner decoders take only the value and raise ``_Mismatch``; each container adds its key
# to the mismatch's path as it passes up, and ``decoder``'s outer function names the field in
# the ``InvalidSpec``. A good value so costs no path strings at all.


class _Mismatch(Exception):
    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        self.path: list[str] = []  # innermost first

    def at(self, where: str) -> InvalidSpec:
        field = where + "".join(reversed(self.path))
        return InvalidSpec(f"{field}: {self.message}", field=field, **self.context)


#: How a refused value is shown: a few items of it, never the whole (a 64 MiB array would cost
#: seconds and its size again in memory to ``repr``, only to be cut to 80 characters).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 8, 8, 8
_SHOWN.maxstring = _SHOWN.maxlong = _SHOWN.maxother = 80


def _expected(what: str, value: Any) -> _Mismatch:
    shown = _SHOWN.repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return _Mismatch(f"expected {what}, got {shown}")


def _decode_str(v: Any) -> str:
    if type(v) is str:
        if v.isascii():
            return v
        # JSON may carry lone surrogates ("\ud800"), which are no text; the ones that stand
        # for raw bytes in file names (surrogateescape, U+DC80-U+DCFF) round-trip as bytes.
        try:
            v.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise _expected("a string of Unicode text", v) from None
        return v
    raise _expected("a string", v)


def _decode_int(v: Any) -> int:
    if type(v) is int and INT64[0] <= v <= INT64[1]:
        return v
    raise _expected("a 64-bit integer", v)


def _decode_float(v: Any) -> float:
    if type(v) is float or type(v) is int:
        try:
            f = float(v)
        except OverflowError:
            raise _expected("a finite number", v) from None
        if math.isfinite(f):
            return f
    raise _expected("a finite number", v)


def _decode_bool(v: Any) -> bool:
    if type(v) is bool:
        return v
    raise _expected("a boolean", v)


def _decode_none(v: Any) -> None:
    if v is not None:
        raise _expected("null", v)


def _decode_bytes(v: Any) -> bytes:
    if type(v) is str:
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise _expected("a base64 string", v)


def _decode_any(v: Any) -> Any:
    return v


_SCALAR_DECODERS: dict[Any, Decode] = {
    str: _decode_str,
    int: _decode_int,
    float: _decode_float,
    bool: _decode_bool,
    type(None): _decode_none,
    bytes: _decode_bytes,
    Any: _decode_any,
}


#: The JSON types (as ``json.loads`` makes them) each scalar decoder may take.
_TAKES: dict[Any, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (float, int),
    bool: (bool,),
    bytes: (str,),
}


def _constrained(decode: Decode, schema: Mapping[str, Any]) -> Decode:
    """Wrap ``decode`` so it enforces the JSON Schema constraints a field's metadata names."""
    low, high = schema.get("minimum"), schema.get("maximum")
    above = schema.get("exclusiveMinimum")
    min_len, max_len = schema.get("minLength"), schema.get("maxLength")
    pattern = re.compile(schema["pattern"]) if "pattern" in schema else None
    min_items = schema.get("minItems")

    def check(v: Any) -> Any:
        out = decode(v)
        if isinstance(out, (int, float)) and not isinstance(out, bool):
            if low is not None and out < low:
                raise _Mismatch(f"must be at least {low}, got {out}")
            if above is not None and out <= above:
                raise _Mismatch(f"must be more than {above}, got {out}")
            if high is not None and out > high:
                raise _Mismatch(f"must be at most {high}, got {out}")
        elif isinstance(out, str):
            if min_len is not None and len(out) < min_len:
                raise _Mismatch(f"must not be shorter than {min_len}")
            if max_len is not None and len(out) > max_len:
                raise _Mismatch(f"must not be longer than {max_len}")
            if pattern is not None and not pattern.search(out):
                raise _expected(f"a string matching {pattern.pattern}", out)
        elif isinstance(out, (tuple, list)) and min_items is not None and len(out) < min_items:
            raise _Mismatch(f"needs at least {min_items} item(s)")
        return out

    return check


def decoder(tp: Any, strict: bool = True) -> Decoder:
    """A function ``(json_value, where) -> value of type tp``; raises ``InvalidSpec`` naming
    the field (``where`` and the path below it) that does not fit.

    ``strict`` refuses fields a record does not have (requests); responses are read without it,
    so a client keeps working against a newer node that added fields.
    """
    return _outer(_decoder(tp, strict))


@functools.cache
def _outer(decode: Decode) -> Decoder:
    def decode_at(v: Any, where: str) -> Any:
        try:
            return decode(v)
        except _Mismatch as e:
            raise e.at(where) from None

    return decode_at


@functools.cache
def _decoder(tp: Any, strict: bool) -> Decode:
    if tp in _SCALAR_DECODERS:
        return _SCALAR_DECODERS[tp]
    if _is_union(tp):
        return _union_decoder(typing.get_args(tp), strict)
    item = _sequence_item(tp)
    if item is not None:
        return _sequence_decoder(
            _decoder(item, strict), list if typing.get_origin(tp) is list else tuple
        )
    value = _mapping_value(tp)
    if value is not None:
        return _mapping_decoder(_decoder(value, strict), value is Any)
    if is_record(tp):
        return _record_decoder(tp, strict)
    raise TypeError(f"no JSON shape for type {tp!r}")


def _describe(tp: Any) -> str:
    if tp in _SCALAR_NAMES:
        return _SCALAR_NAMES[tp]
    return "an array" if _sequence_item(tp) is not None else "an object"


def _union_decoder(options: tuple[Any, ...], strict: bool) -> Decode:
    decoders = [_decoder(o, strict) for o in options if o is not type(None)]
    nullable = type(None) in options
    names = " or ".join(_describe(o) for o in options)
    if nullable and len(decoders) == 1:
        only = decoders[0]

        def decode_optional(v: Any) -> Any:
            return None if v is None else only(v)

        return decode_optional

    # Options of scalar types only (``memory: int | str``): a value goes first to the first
    # option that takes its JSON type, which is the option that would have taken it (those
    # before it cannot), without a mismatch raised and caught for each of those (what a
    # spec's "512M" cost). Any other value, or one that option refuses, tries them in order.
    first: dict[type, Decode] = {}
    if all(o in _TAKES for o in options if o is not type(None)):
        for o, d in zip((o for o in options if o is not type(None)), decoders, strict=True):
            for kind in _TAKES[o]:
                first.setdefault(kind, d)

    def decode(v: Any) -> Any:
        if v is None and nullable:
            return None
        d = first.get(type(v))
        if d is not None:
            try:
                return d(v)
            except _Mismatch:
                pass
        for d in decoders:
            try:
                return d(v)
            except _Mismatch:
                continue
        raise _expected(names, v)

    return decode


def _sequence_decoder(item: Decode, kind: type) -> Decode:
    def decode(v: Any) -> Any:
        if type(v) is not list:
            raise _expected("an array", v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except _Mismatch as e:
                e.path.append(f"[{i}]")
                raise
        return kind(out)

    return decode


def _mapping_decoder(value: Decode, anything: bool) -> Decode:
    def decode(v: Any) -> Any:
        if type(v) is not dict:
            raise _expected("an object", v)
        if anything:
            return dict(v)
        out = {}
        for k, x in v.items():
            try:
                _decode_str(k)  # a key is text too: no lone surrogates (env names, labels)
                out[k] = value(x)
            except _Mismatch as e:
                e.path.append(f".{k!r}" if not k.isascii() else f".{k}")
                raise
        return out

    return decode


def _record_decoder(cls: type, strict: bool) -> Decode:
    plan = []
    for f, tp in _fields(cls):
        d = _decoder(tp, strict)
        extra = f.metadata.get("schema", {})
        if any(k in extra for k in _CONSTRAINTS):
            d = _constrained(d, extra)
        plan.append((f.name, d, not _has_default(f)))
    names = frozenset(name for name, _, _ in plan)
    what = f"a {cls.__name__} object"

    def decode(v: Any) -> Any:
        if type(v) is not dict:
            raise _expected(what, v)
        if strict and not names.issuperset(v):
            unknown = sorted(set(v) - names)
            raise _Mismatch(f"unknown field(s) {unknown}; known: {sorted(names)}", fields=unknown)
        kw = {}
        for name, d, required in plan:
            if name in v:
                try:
                    kw[name] = d(v[name])
                except _Mismatch as e:
                    e.path.append(f".{name}")
                    raise
            elif required:
                raise _Mismatch(f"missing field {name!r}")
        try:
            return cls(**kw)
        except DsecError:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # a record's own checks
            raise _Mismatch(str(e)) from e

    return decode


# --- encoding: typed values in, JSON values out (None: the value is already JSON) -------------


def _encode_bytes(v: bytes) -> str:
    return base64.b64encode(v).decode()


def _encode_value(v: Any) -> Any:
    """Encode by what ``v`` is at run time: the fallback for unions of structured types."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, bytes):
        return _encode_bytes(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return encoder(type(v))(v)  # type: ignore[misc]
    if isinstance(v, AbcMapping):
        return {k: _encode_value(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_encode_value(x) for x in v]
    raise TypeError(f"cannot encode {type(v).__name__} as JSON")


@functools.cache
def encoder(tp: Any) -> Encoder | None:
    """A function ``value -> JSON value`` for type ``tp``, or None where values already are."""
    if tp in (str, int, float, bool, type(None), Any):
        return None
    if tp is bytes:
        return _encode_bytes
    if _is_union(tp):
        if all(encoder(o) is None for o in typing.get_args(tp)):
            return None
        return _encode_value
    item = _sequence_item(tp)
    if item is not None:
        each = encoder(item)
        return list if each is None else _list_of(each)
    value = _mapping_value(tp)
    if value is not None:
        if value is Any:
            return _encode_value
        each = encoder(value)
        return dict if each is None else _dict_of(each)
    if is_record(tp):
        return _record_encoder(tp)
    raise TypeError(f"no JSON shape for type {tp!r}")


def _list_of(each: Encoder) -> Encoder:
    return lambda v: [each(x) for x in v]


def _dict_of(each: Encoder) -> Encoder:
    return lambda v: {k: each(x) for k, x in v.items()}


def _record_encoder(cls: type) -> Encoder:
    plan = [(f.name, encoder(tp)) for f, tp in _fields(cls)]

    def encode(obj: Any) -> dict[str, Any]:
        out = {}
        for name, enc in plan:
            v = getattr(obj, name)
            out[name] = v if enc is None or v is None else enc(v)
        return out

    return encode


# --- JSON Schema (2020-12, as OpenAPI 3.1 uses it) -------------------------------------------

_SCALAR_SCHEMAS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer", "format": "int64"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    Any: {},
}


def json_schema(tp: Any, defs: dict[str, Any], ref_prefix: str = "#/components/schemas/") -> dict:
    """The JSON Schema of ``tp``; records go into ``defs`` by name and are referenced."""
    if tp in _SCALAR_SCHEMAS:
        return dict(_SCALAR_SCHEMAS[tp])
    if _is_union(tp):
        options = [json_schema(o, defs, ref_prefix) for o in typing.get_args(tp)]
        if all(set(o) == {"type"} for o in options):  # ["string", "null"] reads better
            return {"type": [o["type"] for o in options]}
        return {"anyOf": options}
    item = _sequence_item(tp)
    if item is not None:
        return {"type": "array", "items": json_schema(item, defs, ref_prefix)}
    value = _mapping_value(tp)
    if value is not None:
        return {"type": "object", "additionalProperties": json_schema(value, defs, ref_prefix)}
    if is_record(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder: a record that refers to itself stops here
            defs[name] = _record_schema(tp, defs, ref_prefix)
        return {"$ref": ref_prefix + name}
    raise TypeError(f"no JSON shape for type {tp!r}")


def _record_schema(cls: type, defs: dict[str, Any], ref_prefix: str) -> dict[str, Any]:
    props, required = {}, []
    for f, tp in _fields(cls):
        prop = json_schema(tp, defs, ref_prefix)
        prop.update(f.metadata.get("schema", {}))
        if _has_default(f):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            enc = encoder(tp)
            prop["default"] = default if enc is None or default is None else enc(default)
        else:
            required.append(f.name)
        props[f.name] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(f"{cls.__name__}("):  # not dataclass's generated signature
        schema["description"] = " ".join(doc.split("\n\n")[0].split())
    return schema


# --- query strings: a flat record of scalars, one parameter per field -------------------------

_TRUE, _FALSE = frozenset({"1", "true"}), frozenset({"0", "false"})
_INT_RE = re.compile(r"-?[0-9]{1,19}")


def _query_scalar(tp: Any) -> Any:
    """The scalar type of a query field (``X`` of ``X | None``)."""
    if _is_union(tp):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        if len(options) == 1:
            return options[0]
    if tp in (str, int, float, bool):
        return tp
    raise TypeError(f"query parameters are scalars, not {tp!r}")


def _parse_query_value(tp: Any, text: str) -> Any:
    if tp is str:
        return _decode_str(text)
    if tp is bool:
        low = text.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise _expected("true/false or 1/0", text)
    if tp is int:
        if _INT_RE.fullmatch(text):
            return _decode_int(int(text))
        raise _expected("an integer", text)
    try:
        return _decode_float(float(text))
    except ValueError:
        raise _expected("a number", text) from None


@functools.cache
def query_decoder(cls: type) -> Callable[[Mapping[str, str]], Any]:
    """A function ``query params -> record``; raises ``InvalidSpec`` on unknown or bad ones."""
    plan = []
    for f, tp in _fields(cls):
        check = (
            _constrained(_decode_any, f.metadata["schema"])
            if any(k in f.metadata.get("schema", {}) for k in _CONSTRAINTS)
            else None
        )
        plan.append((f.name, _query_scalar(tp), not _has_default(f), check))
    names = frozenset(name for name, _, _, _ in plan)

    def decode(params: Mapping[str, str]) -> Any:
        if not names.issuperset(params):
            unknown = sorted(set(params) - names)
            raise InvalidSpec(
                f"unknown query parameter(s) {unknown}; known: {sorted(names)}", fields=unknown
            )
        kw = {}
        for name, tp, required, check in plan:
            text = params.get(name)
            if text is None:
                if required:
                    raise InvalidSpec(f"missing query parameter: {name}", field=name)
                continue
            try:
                value = _parse_query_value(tp, text)
                kw[name] = check(value) if check is not None else value
            except _Mismatch as e:
                raise e.at(name) from None
        try:
            return cls(**kw)
        except DsecError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidSpec(f"query: {e}") from e

    return decode


@functools.cache
def query_encoder(cls: type) -> Callable[[Any], list[tuple[str, str]]]:
    """A function ``record -> [(name, text)]``, leaving out fields that are None."""
    names = [f.name for f, tp in _fields(cls)]
    for _, tp in _fields(cls):
        _query_scalar(tp)  # a field that is no scalar fails here, once, not per request

    def encode(obj: Any) -> list[tuple[str, str]]:
        out = []
        for name in names:
            v = getattr(obj, name)
            if v is None:
                continue
            # 1/0, not true/false: nodes before the route table read only "1" as true
            out.append((name, ("1" if v else "0") if v is True or v is False else str(v)))
        return out

    return encode
