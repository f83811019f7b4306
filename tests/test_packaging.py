"""What the declared dependency ranges promise, and what CI's two runs rely on.

pyproject.toml declares ranges (a container's torch is kept); constraints.txt pins the newest tested
set (``make test``), constraints-oldest.txt the lower bounds (``make test-oldest``: torch installed
first, the single-process tests and one 2-rank parity test).
"""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.torchrun import REPO

STACK = ("torch", "megatron-core", "megatron-fsdp", "emerging-optimizers")


def _declared() -> dict[str, Requirement]:
    """The package's dependencies and its test extra (where the pinned linters are declared)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    requirements = [Requirement(line) for line in lines]
    return {r.name: r for r in requirements}


def _pins(file_name: str) -> dict[str, Version]:
    pins = {}
    for line in (REPO / file_name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = Version(version.strip())
    return pins


def _lower_bound(requirement: Requirement) -> Version:
    (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
    return Version(bound)


def test_every_pin_of_both_ci_runs_lies_in_the_declared_range():
    declared = _declared()
    for file_name in ("constraints.txt", "constraints-oldest.txt"):
        pins = _pins(file_name)
        assert sorted(name for name in pins if name in STACK) == sorted(STACK), file_name
        for name, version in pins.items():
            assert name in declared, (file_name, name, "pinned but not declared")
            assert declared[name].specifier.contains(version), (file_name, name, version)


def test_the_oldest_run_installs_each_declared_lower_bound():
    declared, oldest = _declared(), _pins("constraints-oldest.txt")
    for name in STACK:
        # torch's bound is 2.8.0a0 (container pre-releases); the run installs the 2.8.0 release.
        assert _lower_bound(declared[name]).release == oldest[name].release, name


@pytest.mark.parametrize(
    ("installed", "kept"),
    [
        ("2.8.0a0+5228986c39.nv25.06", True),  # an NGC container's build of 2.8
        ("2.8.0", True),
        ("2.11.0a0+40b7ee3.nv26.01", True),
        ("2.13.0+cu130", True),
        ("2.14.1", True),
        ("2.15.0", False),  # newer than the newest tested minor (pyproject.toml)
        ("2.7.1", False),
        ("2.7.0a0+7c8ec84dab.nv25.03", False),
        ("3.0.0", False),
    ],
)
def test_an_installed_torch_in_range_is_kept_by_pip(installed, kept):
    # pip keeps an installed distribution when the specifier contains its version, pre-releases
    # allowed (pip's resolver: SpecifierRequirement.is_satisfied_by).
    torch_range = _declared()["torch"].specifier
    assert torch_range.contains(installed, prereleases=True) is kept


def test_install_checks_the_megatron_core_range_that_pyproject_declares():
    from megatron_muon.integrations.megatron_version import SUPPORTED_MEGATRON_CORE

    assert _declared()["megatron-core"].specifier == SpecifierSet(SUPPORTED_MEGATRON_CORE)


def test_a_test_without_the_multirank_marker_cannot_launch_ranks():
    from megatron_muon.testing import run_on_ranks

    with pytest.raises(RuntimeError, match="not marked @pytest.mark.multirank"):
        run_on_ranks(print, 2)


def test_the_version_is_one_in_pyproject_and_the_package_and_has_a_changelog_section():
    import megatron_muon

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert megatron_muon.__version__ == version
    assert f"\n## [{version}] - " in (REPO / "CHANGELOG.md").read_text()
