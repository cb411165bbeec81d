"""The chat page of ``mlx-ferrum serve``: ``GET /`` and its files under ``/web/``.

The page (``mlx_ferrum/server/web/``: plain HTML, CSS and JavaScript, no build step and
nothing fetched from elsewhere) calls the same server's ``/v1/models`` and streaming
``/v1/chat/completions``, so it needs no route of its own beyond its files. The files are
public even with ``--api-key``: they hold no secret, and the page asks for the key before
it calls the API, which stays guarded.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

#: The folder of the page's files (shipped in the wheel as package data).
WEB_DIR = Path(__file__).resolve().parent / "web"

# The page runs only its own scripts and talks only to this server: even a flaw in the
# Markdown renderer could not run a script that model output smuggled into the page.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_web_ui(app: FastAPI) -> None:
    """Serve the chat page on ``app``: ``GET /`` (index.html) and ``GET /web/<file>``.

    Raises:
        FileNotFoundError: the package was installed without its ``web/`` files.
    """
    index = WEB_DIR / "index.html"
    if not index.is_file():
        raise FileNotFoundError(f"the chat page's files are missing from {WEB_DIR}: reinstall mlx-ferrum, "
                                "or start the server with --no-web-ui")
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    @app.get("/", include_in_schema=False)
    async def chat_page():
        """The page's HTML, with its Content-Security-Policy headers."""
        return FileResponse(index, media_type="text/html", headers=_PAGE_HEADERS)
