"""response_format checks: the schema when the request arrives, the model's JSON when it is done."""

from __future__ import annotations

import orjson

from flashstack.gateway.core import ChatRequest, ErrorKind, GatewayError, ResponseFormat, invalid_request

# A model's output that breaks the requested format is not the caller's fault, but it is not a
# transient upstream failure either: 422 tells SDKs not to retry and the caller what happened.
OUTPUT_STATUS = 422


def check_request(req: ChatRequest) -> None:
    """Reject a json_schema response_format whose schema is not a valid JSON Schema."""
    rf = req.response_format
    if rf is None or rf.type != "json_schema":
        return
    import jsonschema  # on first use: most gateways never see a json_schema response_format

    try:
        jsonschema.validators.validator_for(rf.schema).check_schema(rf.schema)
    except jsonschema.SchemaError as e:
        raise invalid_request(
            f"response_format.json_schema.schema is not a valid JSON Schema: {e.message}",
            "response_format.json_schema.schema",
        ) from None


def check_output(rf: ResponseFormat | None, text: str) -> None:
    """Raise a GatewayError the client sees when `text` breaks the requested format."""
    if rf is None or rf.type == "text":
        return
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise _violation(f"the model's output is not valid JSON: {text[:200]!r}") from None
    if rf.type == "json_object":
        if not isinstance(value, dict):
            raise _violation("the model's output is JSON but not an object")
        return
    import jsonschema
    validator = jsonschema.validators.validator_for(rf.schema)(rf.schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise _violation(f"the model's output does not match the response_format schema at {where}: {error.message}")


def _violation(message: str) -> GatewayError:
    return GatewayError(
        ErrorKind.INVALID_REQUEST, message, status=OUTPUT_STATUS, code="response_format_violation"
    )
