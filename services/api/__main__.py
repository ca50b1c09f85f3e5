"""``python -m services.api``: serve the HTTP front door until SIGTERM."""

from services.api.server import serve

if __name__ == "__main__":
    serve()
