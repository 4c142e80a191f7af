"""Web pages of a run, served by the nodes themselves (no internet, no frameworks).

* :mod:`.assets` — the static files shipped in ``node/web/static`` and the aiohttp glue that
  serves them (:func:`add_page_routes`), a per-IP rate limit for page routes,
  :class:`RecentErrors`, the bounded log of a process's last warnings and errors, and
  :func:`add_status_routes`, a node's ``/status`` and page (the relay's and the roles' status servers).
* :mod:`.runpage` — ``RunPage``, the coordinator's run page: ``GET /`` and the bounded JSON
  snapshot ``GET /api/run`` (``docs/protocol.md`` §10.1). Imported from its module by the
  coordinator only, so node pages do not pull in the ingest store.
"""

from node.web.assets import PageLimiter, RecentErrors, add_page_routes, add_status_routes

__all__ = ["PageLimiter", "RecentErrors", "add_page_routes", "add_status_routes"]
