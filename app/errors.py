"""One error hierarchy for the service. Each error carries its HTTP status; app.main renders
every one of them (and request-validation errors) as RFC 9457 problem+json in one handler."""

from __future__ import annotations

from typing import Any

PROBLEM_JSON = "application/problem+json"


class AppError(Exception):
    """An expected condition with an HTTP meaning. `code` is a stable machine name."""

    status: int = 400
    code: str = "bad_request"
    title: str = "Bad request"

    def __init__(self, detail: str, *, errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://higgs.dev/problems/{self.code.replace('_', '-')}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if instance:
            body["instance"] = instance
        if self.errors is not None:
            body["errors"] = self.errors
        return body


class BadRequestError(AppError):
    status, code, title = 400, "bad_request", "Bad request"


class MalformedBodyError(AppError):
    status, code, title = 400, "malformed_body", "Malformed request body"


class UnauthorizedError(AppError):
    status, code, title = 401, "unauthorized", "Unauthorized"


class NotFoundError(AppError):
    status, code, title = 404, "not_found", "Not found"


class ConflictError(AppError):
    status, code, title = 409, "conflict", "Conflict"


class PayloadTooLargeError(AppError):
    status, code, title = 413, "payload_too_large", "Payload too large"


class RangeNotSatisfiableError(AppError):
    status, code, title = 416, "range_not_satisfiable", "Range not satisfiable"

    def __init__(self, detail: str, *, size: int) -> None:
        super().__init__(detail)
        self.size = size


class ValidationFailedError(AppError):
    """422 with field-level `errors: [{"field": "target.bits", "message": ...}]`."""

    status, code, title = 422, "validation_error", "Request validation failed"

    @classmethod
    def field(cls, field: str, message: str) -> ValidationFailedError:
        return cls(f"{field}: {message}", errors=[{"field": field, "message": message}])


class NotSupportedError(ValidationFailedError):
    code, title = "not_supported", "Not supported yet"


class TooManyRequestsError(AppError):
    """429 with a Retry-After header (whole seconds)."""

    status, code, title = 429, "rate_limited", "Too many requests"

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = max(1, int(retry_after))


class QuotaExceededError(TooManyRequestsError):
    code, title = "quota_exceeded", "Job quota exceeded"


class ServiceUnavailableError(AppError):
    status, code, title = 503, "unavailable", "Service unavailable"

    def __init__(self, detail: str, *, retry_after: int = 5) -> None:
        super().__init__(detail)
        self.retry_after = max(1, int(retry_after))


class DatabaseUnavailableError(ServiceUnavailableError):
    code, title = "database_unavailable", "Database unavailable"
