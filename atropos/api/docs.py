"""The ToolServer's ``/docs`` (Swagger UI) served whole from this server: a cluster without internet
access reads its API reference too. The UI's files come from the installed ``swagger-ui-py``
package (Apache-2.0, its license beside the files, served at ``/docs/assets/LICENSE``), read from
its folder without importing it; FastAPI's default page would fetch them from a CDN."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

DOCS = "/docs"
ASSETS = f"{DOCS}/assets"
# name -> media type: the files the page loads, and the license they ship under
_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "favicon-32x32.png": "image/png", "LICENSE": "text/plain"}
PUBLIC = {DOCS, f"{DOCS}/oauth2-redirect", "/openapi.json", *(f"{ASSETS}/{name}" for name in _FILES)}


def _static_dir() -> Path:
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the swagger-ui-py package is missing (a dependency of atropos-sandbox)")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


@cache
def _asset(name: str) -> bytes:
    return (_static_dir() / name).read_bytes()


def serve_docs(app: FastAPI) -> None:
    """``/docs``, its OAuth2 redirect page and its assets on ``app`` (create it with ``docs_url=None``)."""
    if app.docs_url is not None:
        raise ValueError("create the app with docs_url=None: serve_docs serves /docs")

    @app.get(DOCS, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
                                   oauth2_redirect_url=f"{DOCS}/oauth2-redirect",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

    @app.get(f"{DOCS}/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(f"{ASSETS}/{{name}}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = _FILES.get(name)  # only these names: never a path into the package's folder
        if media_type is None:
            raise HTTPException(404, "Not Found")
        return Response(_asset(name), media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})
