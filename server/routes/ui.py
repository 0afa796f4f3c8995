"""The built-in chat page: GET / and /ui/ answer server/ui/index.html, /ui/<file> its scripts and styles.

Static files only (no build step, no CDN: the vendored libraries live in server/ui/vendor/). The page is a
client of the public API like any other; it holds no server state. `--no-ui` leaves these routes out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parents[1] / "ui"

# NOTE(ui): the page's own scripts only ('self'): no inline script, no other origin, no plugins. The
# page never inserts the model's text as HTML (server/ui/markdown.js escapes it and DOMPurify cleans the
# rendered Markdown); this policy is the second wall should that ever fail.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
                 "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"}

router = APIRouter(include_in_schema=False)


@router.api_route("/", methods=["GET", "HEAD"])
@router.api_route("/ui", methods=["GET", "HEAD"])
@router.api_route("/ui/", methods=["GET", "HEAD"])
async def page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)


@router.get("/favicon.ico")
async def favicon() -> Response:
    """No icon (browsers ask for one whatever the page says): 204 instead of a 404 in the page's console."""
    return Response(status_code=204)


def install_ui(app: FastAPI) -> None:
    """Add the page's routes and its static files under /ui/ to `app`."""
    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")


def ui_paths() -> frozenset[str]:
    """Every path the page answers (the auth middleware leaves them open: the page asks for the key itself)."""
    files = {f"/ui/{p.relative_to(UI_DIR).as_posix()}" for p in UI_DIR.rglob("*") if p.is_file()}
    return frozenset({"/", "/ui", "/favicon.ico", *files})
