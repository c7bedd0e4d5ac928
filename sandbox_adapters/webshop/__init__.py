"""WebShop: the adapter over the real ``web_agent_site`` (``sandbox``), the synthetic catalogue generator
(``data``) and the clearly labelled fake engine with the same surface (``fake``)."""

from sandbox_adapters.webshop.sandbox import WebShopSandbox, WebShopUnavailable, parse_webshop_action

__all__ = ["WebShopSandbox", "WebShopUnavailable", "parse_webshop_action"]
