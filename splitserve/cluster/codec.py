"""msgpack encoding of typed records, checked field by field on the way in.

A record is a dataclass; it travels as a msgpack array of its fields in declaration order
(no names on the wire). Each field is encoded and decoded by its annotation:

    int, float, str, bool, bytes, None     as themselves (an int field refuses True;
                                           a float field takes an int)
    enum.Enum                              its value, checked against the members
    list[X], tuple[X, ...], tuple[X, Y]    an array, every item checked
    X | Y | None                           the first alternative that accepts the value;
                                           alternatives that are records are tagged
                                           ([index, *fields]) so they can be told apart
    a dataclass                            an array of its fields, recursively

Decoding builds the record with its constructor, so a record's own checks
(`__post_init__`) run too; anything wrong raises ProtocolError naming the path to the bad
field. Nothing is unpickled and no type named by the peer is ever looked up.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any

from splitserve.errors import ProtocolError, SplitserveError

Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]  # raises _Invalid

_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


class _Invalid(Exception):
    """A value a decoder refuses. The path to it is only built if it is refused: each
    container it is in adds its part (`.field`, `[i]`, `<Record>`) on the way out."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.where: list[str] = []  # innermost first

    def inside(self, part: str) -> _Invalid:
        self.where.append(part)
        return self


class RecordCodec:
    """Encoder and decoder of one dataclass type, built once from its annotations."""

    def __init__(self, cls: type) -> None:
        assert dataclasses.is_dataclass(cls), cls
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.fields = [(f.name, *codec_for(hints[f.name]))
                       for f in dataclasses.fields(cls) if f.init]

    def encode(self, record: Any) -> list[Any]:
        return [enc(getattr(record, name)) for name, enc, _ in self.fields]

    def decode(self, value: Any, path: str) -> Any:
        """The record in `value`; ProtocolError naming the path (from `path`) if not."""
        try:
            return self.decode_value(value)
        except _Invalid as exc:
            raise ProtocolError(f"{path}{''.join(reversed(exc.where))}: {exc.why}") from None

    def decode_value(self, value: Any) -> Any:
        if type(value) is not list or len(value) != len(self.fields):
            raise _Invalid(f"{self.cls.__name__} takes {len(self.fields)} fields, got "
                           f"{_describe(value)}")
        kwargs = {}
        for (name, _, dec), v in zip(self.fields, value):
            try:
                kwargs[name] = dec(v)
            except _Invalid as exc:
                raise exc.inside(f".{name}") from None
        try:
            return self.cls(**kwargs)
        except SplitserveError as exc:  # the record's own validation
            raise _Invalid(str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise _Invalid(f"bad {self.cls.__name__}: {exc}") from None


_RECORDS: dict[type, RecordCodec] = {}


def record_codec(cls: type) -> RecordCodec:
    if cls not in _RECORDS:
        _RECORDS[cls] = RecordCodec(cls)
    return _RECORDS[cls]


def codec_for(tp: Any) -> tuple[Encoder, Decoder]:
    """(encode, decode) for a value annotated `tp`."""
    origin = typing.get_origin(tp)
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        return _union(typing.get_args(tp))
    if origin is tuple and typing.get_args(tp)[-1] is not Ellipsis:
        return _fixed_tuple(typing.get_args(tp))
    if origin in (list, tuple):
        return _sequence(typing.get_args(tp)[0], origin)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        codec = record_codec(tp)
        return codec.encode, codec.decode_value
    if tp in _SCALARS:
        return _same, _scalar(tp)
    raise TypeError(f"no codec for {tp!r}")


def _same(v: Any) -> Any:
    return v


def _scalar(tp: type) -> Decoder:
    # NOTE: exact types (msgpack makes no subclasses): an int field refuses True, which
    # is an int in Python; a float field takes an int.
    if tp is float:
        def dec_float(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _Invalid(f"expected float, got {_describe(v)}")
        return dec_float

    def dec(v: Any) -> Any:
        if type(v) is not tp:
            raise _Invalid(f"expected {tp.__name__}, got {_describe(v)}")
        return v
    return dec


def _enum(tp: type[enum.Enum]) -> tuple[Encoder, Decoder]:
    def dec(v: Any) -> Any:
        if type(v) is not int and type(v) is not str:
            raise _Invalid(f"expected a {tp.__name__}, got {_describe(v)}")
        try:
            return tp(v)
        except ValueError:
            raise _Invalid(f"{v!r} is not a {tp.__name__}") from None
    return (lambda v: v.value), dec


def _sequence(item: Any, origin: type) -> tuple[Encoder, Decoder]:
    enc_item, dec_item = codec_for(item)
    simple = item in _SCALARS and item is not float  # items are themselves when valid

    def enc(v: Any) -> Any:
        return list(v) if simple else [enc_item(x) for x in v]

    def dec(v: Any) -> Any:
        if type(v) is not list:
            raise _Invalid(f"expected a list, got {_describe(v)}")
        if simple and all(type(x) is item for x in v):
            return v if origin is list else tuple(v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(dec_item(x))
            except _Invalid as exc:
                raise exc.inside(f"[{i}]") from None
        return out if origin is list else tuple(out)
    return enc, dec


def _fixed_tuple(items: tuple[Any, ...]) -> tuple[Encoder, Decoder]:
    parts = [codec_for(item) for item in items]

    def enc(v: Any) -> Any:
        return [e(x) for (e, _), x in zip(parts, v)]

    def dec(v: Any) -> Any:
        if type(v) is not list or len(v) != len(parts):
            raise _Invalid(f"expected {len(parts)} items, got {_describe(v)}")
        out = []
        for i, ((_, d), x) in enumerate(zip(parts, v)):
            try:
                out.append(d(x))
            except _Invalid as exc:
                raise exc.inside(f"[{i}]") from None
        return tuple(out)
    return enc, dec


def _union(options: tuple[Any, ...]) -> tuple[Encoder, Decoder]:
    records: list[type] = [o for o in options
                           if isinstance(o, type) and dataclasses.is_dataclass(o)]
    others = [o for o in options if o not in records]
    if records:  # tagged: [index, *fields]
        assert all(o is type(None) for o in others), "records mix only with None"
        codecs = [record_codec(r) for r in records]

        def enc_tagged(v: Any) -> Any:
            if v is None:
                return None
            i = records.index(type(v))
            return [i, *codecs[i].encode(v)]

        def dec_tagged(v: Any) -> Any:
            if v is None and others:
                return None
            if type(v) is not list or not v or type(v[0]) is not int \
                    or not 0 <= v[0] < len(codecs):
                raise _Invalid(f"expected [record tag, *fields], got {_describe(v)}")
            try:
                return codecs[v[0]].decode_value(v[1:])
            except _Invalid as exc:
                raise exc.inside(f"<{records[v[0]].__name__}>") from None
        return enc_tagged, dec_tagged
    parts = [codec_for(o) for o in options]
    not_none = [part for o, part in zip(options, parts) if o is not type(None)]
    if len(not_none) == 1:  # X | None: errors inside X name their own path
        enc_x, dec_x = not_none[0]
        return ((lambda v: None if v is None else enc_x(v)),
                (lambda v: None if v is None else dec_x(v)))

    def enc(v: Any) -> Any:
        for option, (e, _) in zip(options, parts):
            if _is_instance(v, option):
                return e(v)
        raise TypeError(f"{v!r} is none of {options}")

    def dec(v: Any) -> Any:
        for _, d in parts:
            try:
                return d(v)
            except _Invalid:
                continue
        names = " | ".join(getattr(o, "__name__", str(o)) for o in options)
        raise _Invalid(f"expected {names}, got {_describe(v)}")
    return enc, dec


def _is_instance(v: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    return isinstance(v, origin) if isinstance(origin, type) else True


def _describe(v: Any) -> str:
    if isinstance(v, list):
        return f"a list of {len(v)}"
    return type(v).__name__
