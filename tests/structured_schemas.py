"""JSON schemas of varied shape for the structured-output tests: nested objects, arrays with
item bounds, enums, anyOf, $ref/$defs, string patterns and formats, integer and number ranges,
required and optional fields. Strings and arrays are bounded so a small model's greedy output
ends well inside max_tokens; (title, schema) pairs."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 16}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


def arr(items: dict, low: int = 1, high: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


_HAND_WRITTEN = [
    ("a person", obj({"name": NAME, "age": AGE})),
    ("a city", obj({"city": NAME, "country": NAME, "population": {
        "type": "integer", "minimum": 0, "maximum": 40000000}})),
    ("a boolean flag", obj({"enabled": {"type": "boolean"}})),
    ("a color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a list of fruits", obj({"fruits": arr(SHORT, 1, 4)})),
    ("a book", obj({"title": NAME, "author": NAME, "year": {"type": "integer",
                                                             "minimum": 1400,
                                                             "maximum": 2030}})),
    ("a point", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    ("a user with an optional email", obj({"username": NAME, "email": {
        "type": "string", "format": "email"}}, required=["username"])),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("a product code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    ("an address", obj({"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "city": NAME})),
    ("nested: a company with a CEO", obj({"company": NAME, "ceo": obj({"name": NAME,
                                                                      "age": AGE})})),
    ("a team", obj({"team": NAME, "members": arr(obj({"name": NAME}), 1, 3)})),
    ("a matrix", obj({"rows": arr(arr({"type": "integer", "minimum": 0, "maximum": 9},
                                      2, 2), 2, 2)})),
    ("an id as string or number", obj({"id": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 99999},
        {"type": "string", "maxLength": 10}]}})),
    ("a shape", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {
        "type": "number", "minimum": 0, "maximum": 100}}),
        obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0,
                                                    "maximum": 100}})]}),
    ("a tree node with $defs", {"$defs": {"leaf": obj({"value": {"type": "integer"}})},
                                **obj({"root": {"$ref": "#/$defs/leaf"},
                                       "children": arr({"$ref": "#/$defs/leaf"}, 0, 2)})}),
    ("a line from two points", {"$defs": {"point": obj({"x": {"type": "integer"},
                                                       "y": {"type": "integer"}})},
                                **obj({"start": {"$ref": "#/$defs/point"},
                                       "end": {"$ref": "#/$defs/point"}})}),
    ("a rating", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                      "comment": SHORT})),
    ("a weekday", obj({"day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}})),
    ("a nullable nickname", obj({"name": NAME, "nickname": {"anyOf": [SHORT,
                                                                     {"type": "null"}]}})),
    ("tags", obj({"tags": arr(SHORT, 0, 3)})),
    ("a price", obj({"amount": {"type": "number", "minimum": 0, "maximum": 10000},
                     "currency": {"enum": ["USD", "EUR", "JPY"]}})),
    ("a version", obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}})),
    ("a uuid", obj({"id": {"type": "string", "format": "uuid"}})),
    ("a time of day", obj({"time": {"type": "string", "format": "time"}})),
    ("a timestamp", obj({"at": {"type": "string", "format": "date-time"}})),
    ("a movie", obj({"title": NAME, "genres": arr({"enum": ["drama", "comedy", "action"]}, 1,
                                                  2), "minutes": {"type": "integer",
                                                                   "minimum": 1,
                                                                   "maximum": 300}})),
    ("just a string", {"type": "string", "maxLength": 20}),
    ("just an integer", {"type": "integer", "minimum": -10, "maximum": 10}),
    ("an array of numbers", arr({"type": "number", "minimum": 0, "maximum": 1}, 1, 3)),
    ("an enum at top level", {"enum": ["yes", "no", "unknown"]}),
    ("optional fields only", obj({"a": SHORT, "b": {"type": "integer"}}, required=[])),
    ("a recipe", obj({"dish": NAME, "ingredients": arr(obj({"item": SHORT, "grams": {
        "type": "integer", "minimum": 1, "maximum": 1000}}), 1, 3)})),
    ("a deep nest", obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})})),
    ("a mixed list", obj({"items": arr({"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
                                       1, 3)})),
    ("an event", obj({"name": NAME, "date": {"type": "string", "format": "date"},
                      "attendees": {"type": "integer", "minimum": 0, "maximum": 1000}})),
    ("a percentage", obj({"percent": {"type": "number", "minimum": 0, "maximum": 100}})),
]


def _generated() -> list[tuple[str, dict]]:
    """Combinations to reach a few dozen more shapes: objects of n typed fields, some
    optional, some nested one level."""
    kinds = [SHORT, AGE, {"type": "boolean"}, {"type": "number", "minimum": 0, "maximum": 50},
             {"enum": ["low", "mid", "high"]}, arr({"type": "integer", "minimum": 0,
                                                    "maximum": 99}, 1, 2)]
    schemas = []
    for count in range(1, 5):
        for offset in range(3):
            props = {f"field_{i}": kinds[(i + offset * 2) % len(kinds)] for i in range(count)}
            required = [name for i, name in enumerate(props) if (i + offset) % 2 == 0]
            schema = obj(props, required=required)
            if offset == 2:
                schema = obj({"outer": schema})
            schemas.append((f"a record of {count} fields, variant {offset}", schema))
    return schemas


SCHEMAS = _HAND_WRITTEN + _generated()


def validate(instance, schema: dict) -> None:
    """jsonschema with the 2020-12 format checker (date-time and time via rfc3339-validator)."""
    import jsonschema
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(instance)
