"""The compiled request path is used only where its build matches the sources exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdctl.router import compiled


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pdctl source tree of two files, and an empty place for builds."""
    package = tmp_path / "pdctl"
    (package / "router").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "router" / "legs.py").write_text("X = 1\n")
    monkeypatch.setattr(compiled, "PACKAGE", package)
    monkeypatch.setattr(compiled, "BUILDS", tmp_path / "builds")
    monkeypatch.delenv(compiled.INTERPRETED_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (a build's directory is appended to it)
    return package


def built(key: str) -> Path:
    router = compiled.build_dir(key) / "pdctl" / "router"
    router.mkdir(parents=True)
    return router


def test_a_build_of_these_sources_comes_first_in_the_package_path(sources: Path) -> None:
    router = built(compiled.source_key())
    path = ["/src/pdctl/router"]
    compiled.prefer_build(path)
    assert path == [str(router), "/src/pdctl/router"]


def test_a_build_of_other_sources_is_never_used(sources: Path) -> None:
    built(compiled.source_key())
    (sources / "router" / "legs.py").write_text("X = 2\n")  # edited after the build
    path = ["/src/pdctl/router"]
    compiled.prefer_build(path)
    assert path == ["/src/pdctl/router"]


def test_any_source_file_counts_in_the_key_not_only_the_compiled_ones(sources: Path) -> None:
    before = compiled.source_key()
    (sources / "errors.py").write_text("class E(Exception): ...\n")  # imported by compiled code, not compiled
    assert compiled.source_key() != before


def test_the_sources_run_interpreted_when_asked(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built(compiled.source_key())
    monkeypatch.setenv(compiled.INTERPRETED_ENV, "1")
    path = ["/src/pdctl/router"]
    compiled.prefer_build(path)
    assert path == ["/src/pdctl/router"]


def test_without_any_build_nothing_changes(sources: Path) -> None:
    path = ["/src/pdctl/router"]
    compiled.prefer_build(path)
    assert path == ["/src/pdctl/router"]


def test_a_build_others_may_write_is_never_used(sources: Path) -> None:
    router = built(compiled.source_key())
    router.parent.parent.chmod(0o777)  # the build's directory: anyone could plant code in it
    path = ["/src/pdctl/router"]
    compiled.prefer_build(path)
    assert path == ["/src/pdctl/router"]
