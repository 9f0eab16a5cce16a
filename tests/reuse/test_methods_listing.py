"""``kvrelay methods``: every registered method with every setting, its default and one line of meaning.

The expectations are read straight off the method classes' dataclass fields here, not through the catalog, so a
listing that drops, renames or misreports a setting fails.
"""

from __future__ import annotations

import dataclasses
import json

from kvrelay.cli import main
from kvrelay.reuse import METHODS, get_method, method_class


def _expected(name: str) -> dict[str, object]:
    """setting -> default, from the class itself."""
    cls = method_class(name)
    if not dataclasses.is_dataclass(cls):
        return {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.init:
            out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def _spec_value(value: object) -> str:
    """A default written as a spec parameter's value (``get_method``'s parsing)."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, (int, float)) else str(value)


def _settings_of(method) -> dict[str, object]:
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}


def _listing_json(capsys, *args: str) -> list[dict]:
    assert main(["methods", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_registered_method_with_every_setting_and_default(capsys):
    listing = {m["name"]: m for m in _listing_json(capsys)}
    assert list(listing) == list(METHODS)
    for name, info in listing.items():
        settings = {s["name"]: s for s in info["settings"]}
        assert {k: s["default"] for k, s in settings.items()} == _expected(name), name
        for s in info["settings"]:
            assert s["help"].strip(), f"{name}.{s['name']} has no help line"
            assert "\n" not in s["help"]
        assert info["summary"].startswith(name), info["summary"]


def test_every_listed_setting_is_a_spec_parameter_at_its_default(capsys):
    """A listed setting at its listed default, written into a spec, builds the method the bare name builds."""
    for info in _listing_json(capsys):
        bare = get_method(info["name"])
        for s in info["settings"]:
            spec = f"{info['name']}[{s['name']}={_spec_value(s['default'])}]"
            assert _settings_of(get_method(spec)) == _settings_of(bare), spec


def test_text_shows_each_setting_with_its_default_and_help(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    blocks = {block.split()[0].rstrip(":"): block for block in text.split("\n\n")[1:]}
    assert list(blocks) == list(METHODS)
    for name, defaults in ((n, _expected(n)) for n in METHODS):
        rows = [line.split() for line in blocks[name].splitlines()[1:]]
        if not defaults:
            assert rows == [["(no", "settings)"]]
            continue
        assert [row[0] for row in rows] == list(defaults)
        for row, (setting, default) in zip(rows, defaults.items(), strict=True):
            assert repr(default) in row, (name, setting, row)
            assert len(row) > 3, f"{name}.{setting}: no meaning shown"


def test_names_filter_and_unknown_name(capsys):
    assert [m["name"] for m in _listing_json(capsys, "epic", "relay")] == ["epic", "relay"]
    assert main(["methods", "relayy"]) == 2
    assert "unknown method 'relayy'" in capsys.readouterr().err


def test_relay_lists_its_six_settings_and_none_of_its_internals(capsys):
    """The band and policy ``kvrelay profile`` fixes in advance (``RelayMethod.with_knobs``) is no setting."""
    settings = [s["name"] for s in _listing_json(capsys, "relay")[0]["settings"]]
    assert settings == ["selector", "keep_share", "span_openings", "prune_share", "drift", "band"]


def test_every_method_exposes_at_most_six_settings(capsys):
    """A method a user can read: each shipped method has at most 6 public settings, rksc's branch runner included."""
    listing = _listing_json(capsys)
    assert {m["name"] for m in listing} >= set(METHODS) - {"rksc"}
    too_many = {m["name"]: len(m["settings"]) for m in listing if len(m["settings"]) > 6}
    assert not too_many, f"methods over 6 settings: {too_many}"
