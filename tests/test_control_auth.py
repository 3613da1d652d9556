"""Bearer tokens to principals, grants, and the configuration file (kvsp_moq/control/common/auth.py,
config.py; DESIGN.md §5, kvsp-draft §6.1/§6.2 authorization)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvsp_moq.control.common.auth import (
    Authorizer,
    Grant,
    Principal,
    require_holder,
    require_instance,
    require_scope,
    token_digest,
)
from kvsp_moq.control.common.config import IndexConfig, config_from_mapping, load_config
from kvsp_moq.control.common.errors import ConfigError, Forbidden, Unauthorized
from test_index_support import COMPAT, DESCRIPTOR, H1, H2, II7, SCOPE_A, SCOPE_B

TOKEN = "k3Jm0Qv9-x_LtY2ab8Zr1wE4"
OTHER = "Zz9yXw8vUt7sRq6pOn5mLk4j"


def entry(**kw: object) -> dict[str, object]:
    return {"name": "h1", "token": TOKEN, "scopes": [SCOPE_A.hex()], "holders": [H1]} | kw


# ---------------------------------------------------------------------------------------------
# Authentication


def test_authenticate_maps_a_token_to_its_principal() -> None:
    auth = Authorizer.from_config([entry(), entry(name="h2", token=OTHER, holders=[H2])])
    p = auth.authenticate(f"Bearer {TOKEN}")
    assert p.name == "h1" and p.may_use_scope(SCOPE_A) and not p.may_use_scope(SCOPE_B)
    assert p.may_publish_for(H1) and not p.may_publish_for(H2) and not p.may_report_for(II7)
    assert auth.authenticate(f"bearer   {OTHER}").name == "h2"  # scheme is case-insensitive
    assert auth.principal_for_token(TOKEN.encode()) is p  # transport-neutral (MOQT tokens are bytes)
    assert auth.principal_for_token("nope") is None


@pytest.mark.parametrize(
    ("header", "error"),
    [
        (None, None),
        ("", None),
        (f"Basic {TOKEN}", None),
        ("Bearer", "invalid_token"),
        ("Bearer has space", "invalid_token"),
        ("Bearer bad\"quote", "invalid_token"),
        (f"Bearer {TOKEN}x", "invalid_token"),
        (f"Bearer {TOKEN[:-1]}", "invalid_token"),
    ],
)
def test_authenticate_refuses(header: str | None, error: str | None) -> None:
    auth = Authorizer.from_config([entry()])
    with pytest.raises(Unauthorized) as info:
        auth.authenticate(header)
    assert info.value.error == error
    challenge = info.value.headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer realm="kvsp"')
    assert ("invalid_token" in challenge) == (error is not None)


def test_tokens_are_kept_as_digests() -> None:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    auth = Authorizer.from_config([{"name": "h1", "token_sha256": digest, "scopes": ["*"]}])
    p = auth.authenticate(f"Bearer {TOKEN}")
    assert p.may_use_scope(SCOPE_B)
    assert token_digest(TOKEN).hex() == digest
    assert TOKEN not in repr(auth.__dict__)


def test_require_functions() -> None:
    p = Principal("x", scopes=Grant(frozenset({SCOPE_A})), holders=Grant(frozenset({H1})), instances=Grant(frozenset({II7})))
    require_scope(p, SCOPE_A)
    require_holder(p, H1)
    require_instance(p, II7)
    with pytest.raises(Forbidden, match="scope"):
        require_scope(p, SCOPE_B)
    with pytest.raises(Forbidden, match="holder"):
        require_holder(p, H2)
    with pytest.raises(Forbidden, match="instance"):
        require_instance(p, "https://other.example/")
    anything = Principal("root", scopes=Grant(everything=True), holders=Grant(everything=True))
    require_scope(anything, SCOPE_B)
    require_holder(anything, "moqt://relay.example/x")


def test_holder_urls_compare_as_written() -> None:
    p = Authorizer.from_config([entry()]).authenticate(f"Bearer {TOKEN}")
    assert not p.may_publish_for(H1.rstrip("/"))
    assert not p.may_publish_for(H1.upper())


# ---------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize(
    ("principals", "key"),
    [
        ({"name": "x"}, "principals"),
        ([entry(name="")], "principals[0].name"),
        ([entry(token="short")], "principals[0].token"),
        ([entry(token="has space in it 1234")], "principals[0].token"),
        ([entry(token_sha256="00" * 32)], "principals[0]"),  # both token and token_sha256
        ([{"name": "x"}], "principals[0]"),  # neither
        ([{"name": "x", "token_sha256": "AB" * 32}], "principals[0].token_sha256"),
        ([entry(scopes=["A0" * 16])], "principals[0].scopes[0]"),
        ([entry(scopes=SCOPE_A.hex())], "principals[0].scopes"),
        ([entry(scopes=["*", SCOPE_A.hex()])], "principals[0].scopes"),
        ([entry(holders=["h1.example"])], "principals[0].holders[0]"),
        ([entry(instances=[1])], "principals[0].instances[0]"),
        ([entry(role="admin")], "principals[0].role"),
        ([entry(), entry(token=OTHER)], "h1"),  # duplicate name
        ([entry(), entry(name="h2")], "h2"),  # shared token
        (["x"], "principals[0]"),
    ],
)
def test_bad_principals(principals: object, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Authorizer.from_config(principals)
    assert info.value.key == key


def test_from_tokens_checks_tokens() -> None:
    with pytest.raises(ConfigError):
        Authorizer.from_tokens({"short": Principal("x")})


# ---------------------------------------------------------------------------------------------
# The configuration file


def test_load_config(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.json").write_text(json.dumps(DESCRIPTOR))
    (tmp_path / "kvsp.toml").write_text(f"""
[index]
base_path = "/kvsp/"
max_ttl_ms = 30000
max_block_keys = 512
descriptors = ["models/tiny.json"]

[[principals]]
name = "holder-h1"
token = "{TOKEN}"
scopes = ["{SCOPE_A.hex()}"]
holders = ["{H1}"]

[[principals]]
name = "pc"
token_sha256 = "{hashlib.sha256(OTHER.encode()).hexdigest()}"
scopes = ["*"]
instances = ["*"]
""")
    config = load_config(tmp_path / "kvsp.toml")
    assert config.index.base_path == "/kvsp/" and config.index.max_ttl_ms == 30_000
    assert config.index.max_block_keys == 512 and config.index.max_status_ttl_ms == IndexConfig().max_status_ttl_ms
    assert [d["model"] for d in config.index.descriptors] == ["test/tiny"]
    assert [p.name for p in config.auth.principals] == ["holder-h1", "pc"]
    assert config.auth.authenticate(f"Bearer {OTHER}").may_report_for(II7)
    Authorizer.from_toml(tmp_path / "kvsp.toml").authenticate(f"Bearer {TOKEN}")


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"indx": {}}, "indx"),
        ({"index": {"max_ttl": 5}}, "index.max_ttl"),
        ({"index": {"max_ttl_ms": 0}}, "index.max_ttl_ms"),
        ({"index": {"max_ttl_ms": "5"}}, "index.max_ttl_ms"),
        ({"index": {"max_body_octets": 10}}, "index.max_body_octets"),
        ({"index": {"base_path": "kvsp"}}, "index.base_path"),
        ({"index": {"base_path": 3}}, "index.base_path"),
        ({"index": {"descriptors": "x.json"}}, "index.descriptors"),
        ({"index": {"descriptors": ["missing.json"]}}, "index.descriptors[0]"),
        ({"index": []}, "index"),
    ],
)
def test_bad_config(doc: dict, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(doc, base_dir=tmp_path)
    assert info.value.key == key


def test_bad_descriptor_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps(DESCRIPTOR | {"layers": -1}))
    (tmp_path / "notjson.json").write_text("{")
    for name in ("bad.json", "notjson.json"):
        with pytest.raises(ConfigError) as info:
            config_from_mapping({"index": {"descriptors": [name]}}, base_dir=tmp_path)
        assert info.value.key == "index.descriptors[0]"


def test_bad_toml(tmp_path: Path) -> None:
    (tmp_path / "x.toml").write_text("[index\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "x.toml")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.toml")


def test_configured_descriptors_are_known_to_the_service() -> None:
    from kvsp_moq.control.index.service import IndexService

    service = IndexService.in_memory(IndexConfig(descriptors=(DESCRIPTOR,)))
    assert service.descriptors.get(COMPAT) is not None
