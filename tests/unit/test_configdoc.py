"""docs/configuration.md is generated from the CLI and scheduler definitions; it must not drift."""

from kvgpu.cli import configdoc
from kvgpu.cli.main import operator_cmd


def test_configuration_reference_is_current() -> None:
    assert configdoc.TARGET.read_text() == configdoc.render(), "run `python -m kvgpu.cli.configdoc`"


def test_every_operator_option_is_documented() -> None:
    text = configdoc.render()
    for p in operator_cmd.params:
        assert f"`{p.opts[0]}`" in text


def test_flags_without_a_default_are_documented_off() -> None:
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip()
            for line in configdoc.render().splitlines() if line.startswith("| `")}
    assert rows["`--leader-elect`"] == "off"
    assert rows["`--dev-webhooks`"] == "off"
    assert rows["`--webhook-workers`"] == "`2`"
