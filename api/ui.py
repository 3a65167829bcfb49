"""The job dashboard (`/ui/`): static files, served without a token; every number on the
page comes from the API with the token the user signs in with (kept in the browser tab's
session, sent in the Authorization header, never in a URL)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
# the page loads only its own files and talks only to this origin (the Ray dashboard is a
# link the user opens); uPlot sets element styles from script, hence 'unsafe-inline'
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class _UiFiles(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response


def install(app: FastAPI) -> None:
    app.mount("/ui", _UiFiles(directory=STATIC, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")
