"""docs/configuration.md is generated from the CLI and scheduler definitions; it must not drift."""

from kvgpu.cli import configdoc
from kvgpu.cli.main import operator_cmd


def test_configuration_reference_is_current() -> None:
    assert configdoc.TARGET.read_text() == configdoc.render(), "run `python -m kvgpu.cli.configdoc`"


def test_every_operator_option_is_documented() -> None:
    text = configdoc.render()
    for p in operator_cmd.params:
        assert f"`{p.opts[0]}`" in text
