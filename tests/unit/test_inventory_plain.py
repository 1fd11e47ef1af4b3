"""The inventory's plain path (ddtree_ops.inventory_plain) against its schema
(ddtree_ops.inventory_schema, pydantic): whatever the plain path takes, the schema takes too and
normalizes to the same values; what it declines, the schema decides."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import EMBEDDED_INVENTORY, load_inventory
from ddtree_ops.inventory_plain import plain_inventory
from ddtree_ops.inventory_schema import validate

# Plain values, key by key, with their edges (1 and 65535, 2**53, the smallest float).
TEXT = st.text(min_size=1, max_size=4)
PLAIN_VALUES = {
    "transport": st.sampled_from(["ssh", "local"]), "user": TEXT, "port": st.integers(1, 65535),
    "identity_file": TEXT, "known_hosts": TEXT, "ssh_config": TEXT, "python": TEXT, "workdir": TEXT,
    "connect_timeout": st.one_of(st.integers(1, 2**53), st.floats(min_value=5e-324, allow_infinity=False)),
    "command_timeout": st.sampled_from([1, 600, 0.5, 2**53, 5e-324, 1e308]),
    "models": st.fixed_dictionaries({"target": st.text(max_size=3), "drafter": st.text(max_size=3)},
                                    optional={"block_size": st.integers(1, 64), "prompts": st.one_of(st.none(), st.text(max_size=3))}),
    "sglang_port": st.sampled_from([1, 30000, 65535]),
}
ENTRY_VALUES = {"hostname": TEXT, "groups": st.lists(st.text(max_size=3), max_size=3)}
# What a file may hold instead, at any one place: values pydantic converts ("22", 5.0 for a
# port, true), refuses (0, 65536, inf, nan, "", "SSH", a list), unknown keys, a missing key.
ODD = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 65536, 2**53 + 1, 10**400, 5.0, 0.0, -0.5, math.inf, math.nan,
                                               "", "22", "5.5", "SSH", " ssh", b"x", ("a",), ["a", 1], [None], {}, {"x": 1}]),
    st.integers(), st.floats(), st.text(max_size=3),
)


_TEXT_EDGES = ["", 1, True, ["a"]]
EDGES = {  # per key: the values just past what is plain
    "transport": ["SSH", "", " ssh", 1], "port": [0, -1, 65536, True, "22", 22.0], "sglang_port": [0, 65536, False, "1"],
    "connect_timeout": [0, 0.0, -1, math.inf, math.nan, True, "5", 2**53 + 1, 10**400],
    "command_timeout": [0, -0.0, -math.inf, math.nan, False, "600"],
    "groups": [None, "a", [1], ("a",), [None]], "models": [None, "m", [], {}],
    **dict.fromkeys(["user", "identity_file", "known_hosts", "ssh_config", "python", "workdir", "hostname"], _TEXT_EDGES),
}

_MODELS = {"target": "t", "drafter": "d"}
PLAIN_SAMPLES = {"transport": "local", "user": "u", "port": 65535, "identity_file": "k", "known_hosts": "kh",
                 "ssh_config": "c", "python": "p", "workdir": "~", "connect_timeout": 2**53, "command_timeout": 5e-324,
                 "models": _MODELS, "sglang_port": 1, "hostname": "h", "groups": ["g", ""]}
EDGES["models"] += [{"target": "t"}, {"drafter": "d"}, {**_MODELS, "block_size": 0}, {**_MODELS, "block_size": True},
                    {**_MODELS, "block_size": "8"}, {**_MODELS, "prompts": 1}, {**_MODELS, "target": 1},
                    {**_MODELS, "drafter": None}, {**_MODELS, "extra": 1}, {**_MODELS, "block_size": 1, "prompts": "p"}]


@pytest.mark.parametrize("place", ["defaults", "host"])
@pytest.mark.parametrize("key, value", [(key, value) for key, values in EDGES.items() for value in values]
                         + list(PLAIN_SAMPLES.items()))
def test_every_edge_of_every_key_is_decided_alike(place, key, value):
    data = {"hosts": {"a": {key: value} if place == "host" else {}}, **({"defaults": {key: value}} if place == "defaults" else {})}
    plain = plain_inventory(data)
    expected = schema_result(data)
    assert plain is None or same(plain, expected)


@st.composite
def inventories(draw):
    """A file of plain values; in most, one value, key or level made odd."""
    def keys(extra):
        choices = {**PLAIN_VALUES, **extra}
        return {k: draw(choices[k]) for k in draw(st.lists(st.sampled_from(sorted(choices)), unique=True, max_size=6))}

    data = {"hosts": {draw(st.text(min_size=1, max_size=4)): keys(ENTRY_VALUES) for _ in range(draw(st.integers(1, 3)))}}
    if draw(st.booleans()):
        data["defaults"] = keys({})
    if draw(st.integers(0, 3)) == 0:
        return data  # all plain
    spots = [("defaults", data["defaults"])] if "defaults" in data else []
    spots += [(f"hosts.{name}", entry) for name, entry in data["hosts"].items()]
    _, where = draw(st.sampled_from(spots))
    how = draw(st.sampled_from(["value", "value", "value", "unknown key", "model key", "no model key", "level", "host name"]))
    key = draw(st.sampled_from(sorted({**PLAIN_VALUES, **ENTRY_VALUES})))
    if how == "value":
        where[key] = draw(st.one_of(st.sampled_from(EDGES[key]), ODD))
    elif how == "unknown key":
        where[draw(st.sampled_from(["hostnme", "vars", "port "]))] = draw(ODD)
    elif how == "model key":
        where["models"] = {**draw(PLAIN_VALUES["models"]), **draw(st.fixed_dictionaries({}, optional={
            "target": ODD, "drafter": ODD, "block_size": ODD, "prompts": ODD, "extra": ODD}))}
    elif how == "no model key":
        where["models"] = {k: v for k, v in draw(PLAIN_VALUES["models"]).items()
                           if k != draw(st.sampled_from(["target", "drafter", "block_size"]))}
    elif how == "level":
        data[draw(st.sampled_from(["defaults", "hosts", "vars"]))] = draw(ODD)
    else:
        data["hosts"][draw(st.sampled_from([0, 1.5, None, ""]))] = {}
    return data


def schema_result(data):
    try:
        return validate(data, "hosts.yaml")
    except ConfigError as err:
        return err


def same(a, b) -> bool:
    """Equal, NaN aside (never plain, so never compared), and float against float, not 5 == 5.0."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories())
def test_what_the_plain_path_takes_the_schema_takes_alike(data):
    plain = plain_inventory(data)
    if plain is not None:
        assert same(plain, schema_result(data))
    else:  # declined: the schema decides (converts, or names what it refuses)
        schema_result(data)


PLAIN_FILES = [
    EMBEDDED_INVENTORY,
    {"defaults": {"user": "ops", "identity_file": "~/.ssh/id", "known_hosts": "kh", "python": "/opt/venv/bin/python",
                  "connect_timeout": 5, "command_timeout": 600.5, "models": {"target": "/m/t", "drafter": "/m/d"}},
     "hosts": {"gpu-a": {"hostname": "a.example.invalid", "port": 2222, "groups": ["eval"], "sglang_port": 30001},
               "gpu-b": {"workdir": "/srv/dd", "models": {"target": "t", "drafter": "d", "block_size": 8, "prompts": None}},
               "local": {"transport": "local", "hostname": None}}},
]


@pytest.mark.parametrize("data", PLAIN_FILES)
def test_a_file_of_plain_values_is_taken_without_the_schema(data):
    plain = plain_inventory(data)
    assert plain is not None and same(plain, schema_result(data))


@pytest.mark.parametrize("data", [
    {"hosts": {"a": {"port": "22"}}},             # pydantic converts it
    {"hosts": {"a": {"port": True}}},             # refused: not port 1
    {"hosts": {"a": {"connect_timeout": math.inf}}},
    {"hosts": {"a": {"user": ""}}},
    {"hosts": {"a": {"hostnme": "x"}}},
    {"hosts": {"a": None}},
    {"hosts": {"a": {"models": {"target": "t"}}}},
    {"defaults": None, "hosts": {"a": {}}},
])
def test_what_is_not_plain_is_left_to_the_schema(data):
    assert plain_inventory(data) is None


PROBE = """
import json, sys
from ddtree_ops.inventory import load_inventory
hosts = load_inventory(sys.argv[1]).hosts
print(json.dumps({"pydantic": "pydantic" in sys.modules, "ports": [h.port for h in hosts.values()]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("text, pydantic, ports", [
    ("hosts: {a: {port: 2222}, b: {}}\n", False, [2222, None]),
    ("hosts: {a: {port: '2222'}, b: {}}\n", True, [2222, None]),  # converted: by the schema
])
def test_loading_a_plain_file_leaves_pydantic_out(tmp_path: Path, text, pydantic, ports):
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"pydantic": pydantic, "ports": ports}
    assert [h.port for h in load_inventory(path).hosts.values()] == ports


def test_the_plain_path_knows_every_key_of_the_schema():
    from ddtree_ops.inventory_plain import _HOST_KEYS, _MODEL_KEYS
    from ddtree_ops.inventory_schema import HostEntry, HostKeys, ModelsEntry

    assert set(_HOST_KEYS) == set(HostKeys.model_fields)
    assert set(HostEntry.model_fields) - set(HostKeys.model_fields) == {"hostname", "groups"}
    assert _MODEL_KEYS == set(ModelsEntry.model_fields)
