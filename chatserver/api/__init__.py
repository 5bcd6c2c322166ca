"""The HTTP edge: one router per resource (docs/API.md), their dependencies and schemas, the guard
in front of every route, and the SSE response.
"""
