"""WebShop adapter: conformance and rules through the labelled fake engine; the real engine when a checkout exists.

The real ``web_agent_site`` is not installable from any registry (the PyPI ``webshop`` is broken), so CI runs
the adapter against ``FakeWebAgentTextEnv``. ``TestWebShopRealConformance`` runs the same suite on the real engine
when ``WEBSHOP_ROOT`` points at a princeton-nlp/WebShop checkout whose requirements (pyserini + Java >= 21, spaCy
model, torch, flask, selenium, thefuzz) are installed; ``sandbox_adapters/webshop/sandbox.py`` lists a set-up that
passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox_adapters.base import SandboxCrashed
from sandbox_adapters.registry import make_sandbox
from sandbox_adapters.webshop import WebShopSandbox, WebShopUnavailable, parse_webshop_action
from sandbox_adapters.webshop.data import FILES, generate_catalogue
from sandbox_adapters.webshop.fake import FakeWebAgentTextEnv
from tests.sandboxes.conformance import SandboxConformance

WEBSHOP_ROOT = os.environ.get("WEBSHOP_ROOT")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("webshop_data")
    generate_catalogue(str(out), num=30, seed=0)
    return str(out)


def _solution(goal):
    """search, open the goal's product, pick its options, buy."""
    query = goal["instruction_text"].split(",")[0].removeprefix("i am looking for ")
    return [f"search[{query}]", f"Action: click[{goal['asin']}]",
            *[f"click[{o}]" for o in goal["goal_options"]], "click[buy now]"]


class TestWebShopFakeConformance(SandboxConformance):
    engine = "fake"
    many_restores = 10

    @pytest.fixture(autouse=True)
    def _data(self, data_dir):
        self._data_dir = data_dir

    def config(self):
        return WebShopSandbox.Config(engine=self.engine, data_dir=self._data_dir)

    def make_sandbox(self):
        return WebShopSandbox(self.config())

    def goal(self):
        probe = self.make_sandbox()
        try:
            return probe._env.server.goals[0]
        finally:
            probe.close()

    def task(self):
        return {"goal_index": 0}

    def prefix_actions(self):
        return _solution(self.goal())[:1]

    def probe_actions(self):
        return _solution(self.goal())[1:]

    def other_action(self):
        return "click[back to search]"

    def inject_step_crash(self, sandbox):
        def broken(action):
            raise KeyError("engine bug")

        sandbox._env.step = broken


@pytest.mark.envs
@pytest.mark.skipif(not WEBSHOP_ROOT, reason="WEBSHOP_ROOT is not set: the real WebShop engine (a princeton-nlp/"
                    "WebShop checkout) is not available here or in CI; the fake covers the adapter contract")
class TestWebShopRealConformance(TestWebShopFakeConformance):
    engine = "web_agent_site"

    @pytest.fixture(autouse=True)
    def _data(self, data_dir):
        index = os.path.join(data_dir, FILES["index"])
        if not os.path.isdir(index):
            build = subprocess.run(
                [sys.executable, "-m", "pyserini.index.lucene", "--collection", "JsonCollection", "--input",
                 os.path.join(data_dir, os.path.dirname(FILES["index_docs"])), "--index", index, "--generator",
                 "DefaultLuceneDocumentGenerator", "--threads", "1", "--storePositions", "--storeDocvectors",
                 "--storeRaw"], capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": "dummy"})
            if build.returncode != 0:
                pytest.skip(f"cannot build the Lucene index (pyserini + Java >= 21 needed): {build.stderr[-500:]}")
        self._data_dir = data_dir

    def config(self):
        return WebShopSandbox.Config(engine=self.engine, data_dir=self._data_dir, webshop_root=WEBSHOP_ROOT)

    def inject_step_crash(self, sandbox):
        def broken(action):
            raise KeyError("engine bug")

        sandbox._env.step = broken

    def test_goal_purchase_scores_one(self):
        sandbox = self.open()
        sandbox.reset(self.task())
        results = self.play(sandbox, _solution(self.goal()))
        assert results[-1].done and results[-1].reward == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------------


def test_catalogue_schema_and_determinism(data_dir, tmp_path):
    with open(os.path.join(data_dir, FILES["products"])) as f:
        products = json.load(f)
    assert len(products) == 30 and len({p["asin"] for p in products}) == 30
    for p in products:
        assert len(p["asin"]) == 10 and p["pricing"].startswith("$")
        assert set(p) >= {"asin", "name", "full_description", "small_description", "pricing",
                          "customization_options", "images", "category", "query", "product_category"}
        assert {"color", "size"} <= set(p["customization_options"])
        assert all({"value", "image"} <= set(v) for v in p["customization_options"]["color"])
    with open(os.path.join(data_dir, FILES["human_instructions"])) as f:
        human = json.load(f)
    goal = human[products[0]["asin"]][0]
    assert set(goal) >= {"instruction", "instruction_attributes", "instruction_options"}
    with open(os.path.join(data_dir, FILES["attributes"])) as f:
        assert set(json.load(f)[products[0]["asin"]]) == {"attributes", "instruction", "instruction_attributes"}
    with open(os.path.join(data_dir, FILES["index_docs"])) as f:
        assert [json.loads(line)["id"] for line in f] == [p["asin"] for p in products]
    generate_catalogue(str(tmp_path), num=30, seed=0)
    for role in ("products", "attributes", "human_instructions", "reviews", "index_docs"):
        with open(os.path.join(data_dir, FILES[role])) as a, open(tmp_path / FILES[role]) as b:
            assert a.read() == b.read(), role


def test_fake_has_the_web_agent_text_env_surface(data_dir):
    env = FakeWebAgentTextEnv(observation_mode="text", file_path=os.path.join(data_dir, FILES["products"]))
    obs, _ = env.reset(session=3)
    assert "Instruction:" in obs and env.get_available_actions() == {"has_search_bar": True, "clickables": ["search"]}
    session = env.server.user_sessions[env.session]
    assert session["goal"] is env.server.goals[3] and session["keywords"] is None
    goal = env.server.goals[3]
    rewards = []
    for action in [a.removeprefix("Action: ") for a in _solution(goal)]:
        obs, reward, done, info = env.step(action)
        rewards.append(reward)
    assert done and rewards[-1] == 1.0 and sum(rewards[:-1]) == 0
    assert "/done/" in env.browser.current_url and "Thank you" in env.browser.page_source
    assert session["done"] and session["asin"] == goal["asin"]
    assert len(env.prev_actions) == len(rewards)


def test_action_parsing():
    assert parse_webshop_action("Thought: look.\nAction: search[Red Shoes]") == "search[Red Shoes]"
    assert parse_webshop_action("CLICK[Buy Now]") == "click[Buy Now]"
    assert parse_webshop_action("click[]") is None
    assert parse_webshop_action("I would buy it") is None


def test_wrong_item_or_options_lose_reward(data_dir):
    with WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=data_dir)) as sandbox:
        goal = sandbox._env.server.goals[0]
        other = next(g for g in sandbox._env.server.goals if g["query"] != goal["query"])
        sandbox.reset({"goal_index": 0})
        sandbox.step(f"search[{other['instruction_text'].split(',')[0]}]")
        sandbox.step(f"click[{other['asin']}]")
        wrong = sandbox.step("click[buy now]")
        assert wrong.done and 0.0 < wrong.reward < 0.5 and not wrong.info["won"]
        sandbox.reset({"goal_index": 0})
        solution = _solution(goal)
        for action in solution[:2]:
            sandbox.step(action)
        no_options = sandbox.step("click[buy now]")
        assert no_options.done and no_options.reward == pytest.approx(3 / 5)


def test_snapshot_is_a_deep_copy(data_dir):
    with WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=data_dir)) as sandbox:
        goal = sandbox._env.server.goals[0]
        sandbox.reset({"goal_index": 0})
        for action in _solution(goal)[:2]:
            sandbox.step(action)
        snap = sandbox.snapshot()
        assert snap.kind.value == "native"
        sandbox.step(f"click[{goal['goal_options'][0]}]")
        assert sandbox._env.server.user_sessions[sandbox._env.session]["options"]
        assert snap.payload["session"]["options"] == {}  # the parent's later clicks did not reach the snapshot
        assert snap.payload["session"]["actions"]["options"] == 0
        assert snap.payload["session"]["goal"] is sandbox._env.server.goals[0]  # shared, as in the engine
        sandbox.restore(snap)
        assert sandbox._env.server.user_sessions[sandbox._env.session]["options"] == {}
        assert snap.payload["session_id"] in snap.payload["url"]


def test_sessions_are_private_and_released(data_dir):
    a = WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=data_dir))
    b = WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=data_dir))
    server = a._env.server
    assert server is b._env.server  # one engine server per configuration and process
    a.reset({"goal_index": 1})
    b.reset({"goal_index": 1})
    a.step("search[mug]")
    assert server.user_sessions[b._env.session]["keywords"] is None
    sessions = set(server.user_sessions)
    a.close()
    b.close()
    assert not sessions & set(server.user_sessions)


def test_step_limit_and_errors(data_dir):
    with WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=data_dir, max_steps=2)) as sandbox:
        sandbox.reset({"goal_index": 2})
        first = sandbox.step("no action here")
        assert first.info["invalid_action"] and not first.done
        last = sandbox.step("click[buy now]")  # not available on the search page
        assert last.done and last.reward == 0.0 and last.info["step_limit"] and last.info["invalid_action"]
        with pytest.raises(ValueError, match="goal_index"):
            sandbox.reset({"goal_index": 10_000})
        sandbox.reset({"goal_index": 0})
        sandbox._env.reset = lambda **kw: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(SandboxCrashed):
            sandbox.reset({"goal_index": 0})


def test_configuration_errors_name_the_fix(data_dir, tmp_path, monkeypatch):
    sandbox = make_sandbox("webshop", {"engine": "fake", "data_dir": data_dir})
    assert type(sandbox) is WebShopSandbox
    sandbox.close()
    with pytest.raises(WebShopUnavailable, match="webshop.data"):
        WebShopSandbox(WebShopSandbox.Config(engine="fake", data_dir=str(tmp_path)))
    monkeypatch.delenv("WEBSHOP_ROOT", raising=False)
    with pytest.raises(WebShopUnavailable, match="WEBSHOP_ROOT"):
        WebShopSandbox(WebShopSandbox.Config(data_dir=data_dir))
    with pytest.raises(WebShopUnavailable, match="princeton-nlp/WebShop"):
        WebShopSandbox(WebShopSandbox.Config(data_dir=data_dir, webshop_root=str(tmp_path)))
