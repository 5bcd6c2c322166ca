"""The HTTP routes, one APIRouter per resource (docs/API.md); `server.create_app` includes them all."""
