"""The HTTP routes, one APIRouter per resource (API.md); `server.create_app` includes them all."""
