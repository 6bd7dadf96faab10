"""Label values made from names that may not be label values (node names up to 253 characters)."""

from __future__ import annotations

import re

import pytest
from kvgpu.core.keys import label_value

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("name", ["node-1", "a" * 63, "", "x.y.z"])
def test_valid_values_are_kept(name):
    assert label_value(name) == name


@pytest.mark.parametrize("name", ["x" * 62 + ".y", "x" * 62 + "-y", "a" * 200, "node-" + "b" * 60 + ".example.com",
                                  "-" * 70])
def test_long_names_become_valid_and_distinct(name):
    v = label_value(name)
    assert len(v) <= 63 and LABEL_VALUE.match(v), v
    assert label_value(name + "1") != v
