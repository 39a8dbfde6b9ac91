"""Small builders for the /v1 schemas, in OpenAPI 3.0's dialect of JSON Schema (what drf-spectacular writes): `nullable`
instead of a "null" type, `enum` of one value instead of `const`."""


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    """The schema, or null (a reference can't carry `nullable` beside it: it is wrapped)."""
    if "$ref" in schema:
        return {"allOf": [schema], "nullable": True}
    return {**schema, "nullable": True}


def obj(properties: dict, required: tuple[str, ...] = (), *, closed: bool = False, description: str = "") -> dict:
    """An object with these properties; `closed`: any other property is refused."""
    schema: dict = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    if description:
        schema["description"] = description
    return schema


def const(value: str, description: str = "") -> dict:
    return {"type": "string", "enum": [value], **({"description": description} if description else {})}


def text(description: str = "", **more) -> dict:
    return {"type": "string", **({"description": description} if description else {}), **more}


def integer(description: str = "", **more) -> dict:
    return {"type": "integer", **({"description": description} if description else {}), **more}


def number(description: str = "", **more) -> dict:
    return {"type": "number", **({"description": description} if description else {}), **more}


def boolean(description: str = "", **more) -> dict:
    return {"type": "boolean", **({"description": description} if description else {}), **more}


def array(items: dict, description: str = "", **more) -> dict:
    return {"type": "array", "items": items, **({"description": description} if description else {}), **more}


UNIX_TIME = integer("Unix time in seconds.")
