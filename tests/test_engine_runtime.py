"""lab.engine.sglang without the engine installed: what it says, and its version gates agree."""

from __future__ import annotations

import importlib.util

import pytest

from lab.engine import sglang as engine
from lab.engine.sglang import cpu_routing, runtime


def test_the_routing_is_gated_on_the_release_the_lab_supports() -> None:
    assert cpu_routing.WRITTEN_FOR == runtime.SUPPORTED_VERSION == engine.SUPPORTED_VERSION
    with pytest.raises(RuntimeError, match=r"written for sglang 0.5.23, not 0.6.0"):
        cpu_routing.apply_cpu_routing("0.6.0")


def test_every_family_is_supported_or_refused_with_a_reason() -> None:
    status = engine.supported()
    assert set(status) == set(__import__("lab").FAMILY_NAMES)
    assert {n for n, s in status.items() if s == "supported"} == set(engine.ENGINE_FAMILIES)
    for name, why in engine.UNSUPPORTED.items():
        assert status[name] == why and len(why) > 40
        with pytest.raises(ValueError, match=f"family {name!r} is not supported with sglang"):
            engine.engine_family(name)


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="sglang is installed here"
)
def test_without_the_engine_the_refusal_names_the_install_command() -> None:
    assert engine.engine_version() is None
    with pytest.raises(engine.EngineUnavailable, match=r"bash scripts/install_engine.sh"):
        engine.pair_engine("flux")
    from lab.views.cli import main

    assert main(["pair", "--engine", "sglang", "--family", "flux"]) == 2
