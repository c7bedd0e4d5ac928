"""A FAKE of WebShop's text environment, for tests and demos where the real ``web_agent_site`` is absent.

This is not WebShop. It is our own small shop with the *same surface* as ``WebAgentTextEnv`` in
``observation_mode="text"`` — which is all :class:`sandbox_adapters.webshop.WebShopSandbox` touches — so the
adapter's contract (snapshot/restore of ``server.user_sessions[session]`` + browser url/page + env bookkeeping) is
exercised in CI without the real code:

* ``FakeWebAgentTextEnv(observation_mode="text", file_path=..., server=None, **kwargs)`` with ``reset(session)``,
  ``step(action) -> (obs, reward, done, info)``, ``get_available_actions() -> {"has_search_bar", "clickables"}``,
  ``observation``, ``instruction_text``, ``session``, ``prev_obs``, ``prev_actions``, ``text_to_clickable``;
* ``server.user_sessions[session]`` (goal, keywords, page, asin, asins, options, actions, done, reward) and
  ``server.goals``; ``browser.current_url``, ``browser.page_source``, ``browser.session_id``;
* pages: search -> results (``search[...]``) -> item (``click[<asin>]``) -> options (``click[<value>]``) ->
  ``click[buy now]``, plus ``back to search``, ``next >``, ``< prev`` and ``description``/``features`` sub pages.

It reads the catalogue that ``sandbox_adapters.webshop.data`` writes. What differs from the real engine, on
purpose: search ranks by shared words (not BM25 over a Lucene index), pages are minimal HTML, and the purchase
reward is our simplified score — (matched goal attributes + matched goal options + price within budget) /
(attributes + options + 1), halved when the product answers another query — not WebShop's ``get_reward``.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections import defaultdict
from typing import Any

from sandbox_adapters.webshop.data import FILES

__all__ = ["FakeWebAgentTextEnv", "FakeSimServer", "FakeSimBrowser"]

_PAGE_SIZE = 10
_BASE_URL = "http://fake-webshop.invalid"
_SUB_PAGES = ("description", "features")
_ELEMENT = re.compile(r'<(button) class="btn">([^<]*)</button>|<(a) class="product-link">([^<]*)</a>'
                      r'|<(input) type="radio" name="([^"]*)" value="([^"]*)"')
_TEXT = re.compile(r">([^<>]+)<")
_ACTION = re.compile(r"^\s*(search|click)\[(.+)\]\s*$", re.DOTALL)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


class FakeSimServer:
    """Holds the catalogue, the goals and every session's state (``user_sessions``), and renders pages."""

    def __init__(self, file_path: str, human_goals: bool = True, **_: Any) -> None:
        data_dir = os.path.dirname(os.path.abspath(file_path))
        with open(file_path) as f:
            self.products = {p["asin"]: p for p in json.load(f)}
        with open(os.path.join(data_dir, FILES["human_instructions"])) as f:
            instructions = json.load(f)
        self.goals = []
        for asin in sorted(instructions):  # one goal per instruction, in a fixed order
            for ins in instructions[asin]:
                price = self._price(self.products[asin])
                self.goals.append({
                    "asin": asin,
                    "query": self.products[asin]["query"],
                    "instruction_text": f"{ins['instruction']}, and price lower than "
                                        f"{10 * math.ceil(price / 10) + 10:.2f} dollars",
                    "attributes": ins["instruction_attributes"],
                    "goal_options": ins["instruction_options"],
                    "price_upper": 10 * math.ceil(price / 10) + 10,
                })
        self.user_sessions: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _price(product: dict[str, Any]) -> float:
        return float(product["pricing"].lstrip("$"))

    # --- pages ----------------------------------------------------------------------------------------------
    def _page(self, session: dict[str, Any], body: list[str]) -> str:
        instruction = html.escape(session["goal"]["instruction_text"])
        return ("<html><body><div id=\"instruction-text\"><h4>Instruction:</h4><p>" + instruction + "</p></div>"
                + "".join(body) + "</body></html>")

    def _start_page(self, session: dict[str, Any]) -> str:
        return self._page(session, ['<input id="search_input" type="text"/>', '<button class="btn">Search</button>'])

    def _results_page(self, session: dict[str, Any]) -> str:
        query = _words(" ".join(session["keywords"]))
        scored = []
        for asin, p in self.products.items():
            text = " ".join([p["name"], p["full_description"], *p["small_description"], p["query"]])
            score = len(query & _words(text))
            if score:
                scored.append((-score, asin))
        hits = [asin for _, asin in sorted(scored)]
        page = session["page"]
        shown = hits[(page - 1) * _PAGE_SIZE: page * _PAGE_SIZE]
        body = ['<button class="btn">Back to Search</button>',
                f"<p>Page {page} (Total results: {len(hits)})</p>"]
        if page > 1:
            body.append('<button class="btn">&lt; Prev</button>')
        if page * _PAGE_SIZE < len(hits):
            body.append('<button class="btn">Next &gt;</button>')
        for asin in shown:
            p = self.products[asin]
            body += [f'<a class="product-link">{asin}</a>', f"<p>{html.escape(p['name'])}</p>",
                     f"<p>{p['pricing']}</p>"]
        return self._page(session, body)

    def _item_page(self, session: dict[str, Any]) -> str:
        p = self.products[session["asin"]]
        body = ['<button class="btn">Back to Search</button>', '<button class="btn">&lt; Prev</button>']
        for name, values in sorted(p["customization_options"].items()):
            body.append(f"<p>{name}</p>")
            for v in values:
                body.append(f'<input type="radio" name="{name}" value="{html.escape(v["value"])}"/>'
                            f"<label>{html.escape(v['value'])}</label>")
        chosen = ", ".join(f"{k}: {v}" for k, v in sorted(session["options"].items())) or "none"
        body += [f"<p>{html.escape(p['name'])}</p>", f"<p>Price: {p['pricing']}</p>",
                 f"<p>Selected options: {html.escape(chosen)}</p>",
                 '<button class="btn">Description</button>', '<button class="btn">Features</button>',
                 '<button class="btn">Buy Now</button>']
        return self._page(session, body)

    def _sub_page(self, session: dict[str, Any], which: str) -> str:
        p = self.products[session["asin"]]
        lines = [p["full_description"]] if which == "description" else p["small_description"]
        body = ['<button class="btn">Back to Search</button>', '<button class="btn">&lt; Prev</button>']
        return self._page(session, body + [f"<p>{html.escape(t)}</p>" for t in lines])

    def _reward(self, session: dict[str, Any]) -> float:
        goal, p = session["goal"], self.products[session["asin"]]
        text = " ".join([p["name"], p["full_description"], *p["small_description"]]).lower()
        attrs = sum(a in text for a in goal["attributes"])
        options = sum(v in goal["goal_options"] for v in session["options"].values())
        price_ok = self._price(p) <= goal["price_upper"]
        score = (attrs + options + price_ok) / (len(goal["attributes"]) + len(goal["goal_options"]) + 1)
        return score if p["query"] == goal["query"] else score / 2

    # --- requests -------------------------------------------------------------------------------------------
    def receive(self, session_id: str, current_url: str | None, session_int: int | None = None,
                **kwargs: Any) -> tuple[str, str, dict[str, Any]]:
        """One request: start a session (no kwargs), search (``keywords``) or click (``clickable_name``)."""
        status = {"reward": 0.0, "done": False}
        if session_id not in self.user_sessions:
            self.user_sessions[session_id] = {"goal": self.goals[(session_int or 0) % len(self.goals)],
                                              "done": False}
        session = self.user_sessions[session_id]
        name = kwargs.get("clickable_name")
        if "keywords" in kwargs:
            session.update(keywords=kwargs["keywords"], page=kwargs.get("page", 1), asin=None, options={})
            session["actions"]["search"] += 1
            return self._results_page(session), f"{_BASE_URL}/search_results/{session_id}/{session['page']}", status
        if not kwargs or name == "back to search":
            session.update(keywords=None, page=None, asin=None, asins=set(), options={},
                           actions=defaultdict(int))
            return self._start_page(session), f"{_BASE_URL}/{session_id}", status
        page_kind = (current_url or "").split("/")[3] if current_url and current_url.count("/") > 3 else ""
        if name == "buy now":
            reward = self._reward(session)
            session.update(done=True, reward=reward)
            status = {"reward": reward, "done": True}
            body = ["<p>Thank you for shopping with us!</p>", f"<p>Your score (min 0.0, max 1.0)</p><p>{reward}</p>"]
            return self._page(session, body), f"{_BASE_URL}/done/{session_id}", status
        if name in ("next >", "< prev") and page_kind == "search_results":
            return self.receive(session_id, current_url, keywords=session["keywords"],
                                page=session["page"] + (1 if name == "next >" else -1))
        if name == "< prev" and page_kind == "item_page":
            return self.receive(session_id, current_url, keywords=session["keywords"], page=session["page"])
        if name in _SUB_PAGES:
            session["actions"][name] += 1
            return self._sub_page(session, name), f"{_BASE_URL}/item_sub_page/{session_id}/{name}", status
        element = kwargs["text_to_clickable"][name]
        if element["kind"] == "a":
            session["asin"] = name.upper()
            session["asins"].add(session["asin"])
            session["actions"]["asin"] += 1
        elif element["kind"] == "input":
            session["options"][element["name"]] = name
            session["actions"]["options"] += 1
        url = f"{_BASE_URL}/item_page/{session_id}/{session['asin']}/{json.dumps(session['options'], sort_keys=True)}"
        return self._item_page(session), url, status


class FakeSimBrowser:
    """The page the session is on: ``current_url`` and ``page_source``."""

    def __init__(self, server: FakeSimServer) -> None:
        self.server = server
        self.current_url: str | None = None
        self.page_source: str | None = None
        self.session_id: str | None = None

    def get(self, url: str, session_id: str, session_int: int | None = None) -> None:
        self.session_id = session_id
        self.page_source, _, _ = self.server.receive(session_id, self.current_url, session_int=session_int)
        self.current_url = url

    def click(self, name: str, text_to_clickable: dict[str, Any]) -> dict[str, Any]:
        self.page_source, self.current_url, status = self.server.receive(
            self.session_id, self.current_url, clickable_name=name, text_to_clickable=text_to_clickable)
        return status

    def search(self, keywords: str) -> dict[str, Any]:
        self.page_source, self.current_url, status = self.server.receive(
            self.session_id, self.current_url, keywords=keywords.split(" "))
        return status


class FakeWebAgentTextEnv:
    """Same surface as WebShop's ``WebAgentTextEnv`` (text observation mode); see the module docstring."""

    def __init__(self, observation_mode: str = "text", file_path: str | None = None,
                 server: FakeSimServer | None = None, **kwargs: Any) -> None:
        if observation_mode != "text":
            raise ValueError("FakeWebAgentTextEnv only renders observation_mode='text'")
        if server is None and file_path is None:
            raise ValueError("FakeWebAgentTextEnv needs a server or the file_path of a catalogue")
        self.observation_mode = observation_mode
        self.server = server if server is not None else FakeSimServer(file_path, **kwargs)
        self.browser = FakeSimBrowser(self.server)
        self.session_prefix = kwargs.get("session_prefix")
        self.session: str | None = None
        self.instruction_text: str | None = None
        self.text_to_clickable: dict[str, Any] | None = None
        self.prev_obs: list[str] = []
        self.prev_actions: list[str] = []

    @property
    def observation(self) -> str:
        texts = [html.unescape(t).strip() for t in _TEXT.findall(self.browser.page_source or "")]
        return " [SEP] ".join(t for t in texts if t)

    def get_available_actions(self) -> dict[str, Any]:
        page = self.browser.page_source or ""
        self.text_to_clickable = {}
        for m in _ELEMENT.finditer(page):
            if m.group(1):
                self.text_to_clickable[html.unescape(m.group(2)).lower()] = {"kind": "button"}
            elif m.group(3):
                self.text_to_clickable[m.group(4).lower()] = {"kind": "a"}
            else:
                self.text_to_clickable[html.unescape(m.group(7)).lower()] = {"kind": "input", "name": m.group(6)}
        return {"has_search_bar": 'id="search_input"' in page, "clickables": list(self.text_to_clickable)}

    def reset(self, session: int | str | None = None, instruction_text: str | None = None) -> tuple[str, None]:
        session_int = session if isinstance(session, int) else None
        self.session = (self.session_prefix or "") + str(session if session is not None else 0)
        self.browser.get(f"{_BASE_URL}/{self.session}", session_id=self.session, session_int=session_int)
        self.text_to_clickable = None
        self.instruction_text = instruction_text or self.server.user_sessions[self.session]["goal"][
            "instruction_text"]
        obs = self.observation
        self.prev_obs, self.prev_actions = [obs], []
        return obs, None

    def step(self, action: str) -> tuple[str, float, bool, None]:
        available = self.get_available_actions()
        m = _ACTION.match(action)
        arg = m.group(2).strip().lower() if m else ""
        status = {"reward": 0.0, "done": False}
        if m and m.group(1) == "search" and available["has_search_bar"] and arg:
            status = self.browser.search(arg)
        elif m and m.group(1) == "click" and arg in self.text_to_clickable and arg != "search":
            status = self.browser.click(arg, self.text_to_clickable)
        obs = self.observation
        self.prev_actions.append(action)
        self.prev_obs.append(obs)
        return obs, status["reward"], status["done"], None
