"""The route ``GET {base_url}vram-magic/kernels``, authenticated and authorised like Jupyter's own kernels API
(403 without a token or a logged-in user)."""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .collect import Collector
from .schema import ROUTE


class KernelsHandler(APIHandler):
    auth_resource = "kernels"  # reading it needs what listing the kernels needs

    def initialize(self, collector: Collector) -> None:
        self.collector = collector

    @web.authenticated
    @authorized
    async def get(self) -> None:
        data = await self.collector.collect()
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(data))


def setup_handlers(server_app: Any) -> Collector:
    web_app = server_app.web_app
    collector = Collector(server_app.kernel_manager, server_app.session_manager)
    route = url_path_join(web_app.settings["base_url"], *ROUTE)
    web_app.add_handlers(".*$", [(route, KernelsHandler, {"collector": collector})])
    web_app.settings["vram_magic_collector"] = collector
    server_app.log.info("vram_magic: GET %s (kernels' memory)", route)
    return collector
