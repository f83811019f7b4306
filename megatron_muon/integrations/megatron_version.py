"""The megatron-core versions whose patched functions were read, and the check every patch runs.

Every module of ``megatron_muon.integrations`` that patches Megatron calls
``check_megatron_core_version`` before patching (``megatron_lm.install()`` and the modules it
applies, ``megatron_bridge.install()``, ``megatron_lm_progress.install()``). It lives apart from
``megatron_lm`` so that those modules import it without importing ``megatron_lm``, which imports
them: imports inside ``integrations`` run one way.
"""

from __future__ import annotations

import importlib

__all__ = ["SUPPORTED_MEGATRON_CORE", "check_megatron_core_version"]

# The megatron-core versions whose patched functions were read (``megatron_lm``'s docstring);
# pyproject.toml's dependency on megatron-core is the same range.
SUPPORTED_MEGATRON_CORE = ">=0.19.0,<0.20"


def check_megatron_core_version(patcher: str = "megatron_muon.integrations.megatron_lm") -> None:
    """Raises unless the installed megatron-core is in ``SUPPORTED_MEGATRON_CORE``.

    ``patcher`` names the patching module in the error.

    Raises:
        RuntimeError: another megatron-core version is installed.
    """
    from packaging.specifiers import SpecifierSet

    package_info = importlib.import_module("megatron.core.package_info")
    version = package_info.__version__
    # prereleases=True: a 0.19.x release candidate is in range, a 0.19.0rc is not (< 0.19.0).
    if not SpecifierSet(SUPPORTED_MEGATRON_CORE).contains(version, prereleases=True):
        raise RuntimeError(
            f"{patcher} patches megatron.training functions as they "
            f"are in megatron-core {SUPPORTED_MEGATRON_CORE}; megatron-core {version} is "
            f"installed. Install a supported version (pip install 'megatron-core"
            f"{SUPPORTED_MEGATRON_CORE}'), or check the patched functions (see "
            "megatron_muon.integrations.megatron_lm's docstring) against it and widen "
            "SUPPORTED_MEGATRON_CORE."
        )
