"""One line instead of a traceback when the Prefect server wants an auth string this client lacks (or has
wrong): `prefect server start` with PREFECT_SERVER_API_AUTH_STRING answers every other request with 401.

Checked once before a run or sweep starts (`python -m flows.train`, any launcher), with the same header
Prefect's client sends; `is_auth_error` recognises a 401 that happens later anyway."""
from __future__ import annotations

import base64


def auth_message(url: str, auth_string_set: bool) -> str:
    why = ("the PREFECT_API_AUTH_STRING set here is not the server's" if auth_string_set
           else "PREFECT_API_AUTH_STRING is not set here")
    return (f"loraflow: the Prefect server at {url} refused the request (401 Unauthorized): it wants "
            f"PREFECT_API_AUTH_STRING, the server's PREFECT_SERVER_API_AUTH_STRING; {why}")


def auth_problem() -> str | None:
    """The one-line message if PREFECT_API_URL's server refuses this client's credentials, else None
    (no server configured, Prefect Cloud's API key, an unreachable server: Prefect reports those itself)."""
    import httpx
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    url, auth = PREFECT_API_URL.value(), PREFECT_API_AUTH_STRING.value()
    if not url or (PREFECT_API_KEY.value() and not auth):
        return None
    auth = auth.get_secret_value() if hasattr(auth, "get_secret_value") else auth
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        # verify: plain http needs no certificate store (loading one is most of a start-up request's 20 ms)
        status = httpx.get(url.rstrip("/") + "/admin/version", headers=headers, timeout=10,
                           verify=not url.startswith("http://")).status_code
    except httpx.HTTPError:
        return None
    return auth_message(url, bool(auth)) if status == 401 else None


def is_auth_error(error: BaseException) -> bool:
    """A 401 from the API (httpx's or Prefect's status error), also as the cause of another error."""
    seen = 0
    while error is not None and seen < 10:
        response = getattr(error, "response", None)
        if getattr(response, "status_code", None) == 401:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def stop_on_auth_failure(error: BaseException | None = None) -> None:
    """Exit 2 with the one line when the server refuses this client (checked now, or seen in `error`)."""
    import sys

    if error is not None and not is_auth_error(error):
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    message = auth_problem() if error is None else auth_message(PREFECT_API_URL.value() or "PREFECT_API_URL",
                                                                bool(PREFECT_API_AUTH_STRING.value()))
    if message:
        print(message, file=sys.stderr)
        sys.exit(2)
