"""The entry point, kept at the root so outside checks start the server as they always have:
`uvicorn server:app` serves the app built from the environment's settings, and
`python server.py [user ... | migrate ...]` runs it (or an account or migration command) the way
`make run` does. Everything else lives in the `chatserver` package.
"""

from chatserver.app import create_app, main

app = create_app()

if __name__ == "__main__":
    main()
