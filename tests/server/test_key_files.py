"""``--api-keys`` and ``--metrics-key`` files: blank lines and ``#`` comments are no keys (a comment above a team's
key was itself a key any client could send), and a line that is no bearer token is refused by its number, not
echoed."""

from __future__ import annotations

import pytest

from kvrelay.errors import ConfigError
from kvrelay.server.access import read_metrics_key
from kvrelay.server.cli import read_api_keys


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_comments_and_blank_lines_are_no_keys(tmp_path):
    keys = read_api_keys(_file(tmp_path, "# team alpha\nkey-alpha\n\n   # team beta, indented\n  key-beta  \n"))
    assert keys == {"key-alpha", "key-beta"}


def test_the_metrics_key_is_the_first_key_line_after_comments(tmp_path):
    assert read_metrics_key(_file(tmp_path, "# the scraper's key\n\nscrape-1\nscrape-2\n")) == "scrape-1"


@pytest.mark.parametrize("line", ["team alpha key", "k\tey", "kéy", "key\x07"])
def test_a_line_that_is_no_bearer_token_is_refused_by_its_number(tmp_path, line):
    path = _file(tmp_path, f"# comment\nkey-ok\n{line}\n")
    with pytest.raises(ConfigError) as error:
        read_api_keys(path)
    message = str(error.value)
    assert "--api-keys" in message and "line 3 is no key" in message and line.strip() not in message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_a_file_of_no_keys_is_refused(tmp_path, text):
    for read, flag in ((read_api_keys, "--api-keys"), (read_metrics_key, "--metrics-key")):
        with pytest.raises(ConfigError, match=f"{flag} .*: the file holds no key"):
            read(_file(tmp_path, text))


def test_a_missing_file_names_its_flag(tmp_path):
    with pytest.raises(ConfigError, match="--api-keys .*: no such file"):
        read_api_keys(str(tmp_path / "none"))


def test_a_byte_order_mark_an_editor_wrote_is_no_part_of_the_first_key(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_bytes("\ufeffkey-alpha\nkey-beta\n".encode())
    assert read_api_keys(str(path)) == {"key-alpha", "key-beta"}


def test_a_file_that_is_no_utf8_text_is_refused_naming_its_flag(tmp_path):
    path = tmp_path / "keys.bin"
    path.write_bytes(b"key-\xff\xfe\n")
    with pytest.raises(ConfigError, match="--api-keys .*keys.bin: is not UTF-8 text"):
        read_api_keys(str(path))
