"""The FFI API check at handler registration: handlers built against one jaxlib's XLA FFI
headers are refused by name under a jaxlib whose FFI API cannot take them."""

import pytest

from baton.emit import ffi
from baton.emit.ffi import FfiApi, ffi_api_mismatch


def test_same_api_accepted():
    assert ffi_api_mismatch(FfiApi("0.7.0", 0, 5), FfiApi("0.7.0", 0, 5)) is None


def test_older_minor_built_accepted_by_newer_runtime():
    # XLA keeps accepting handlers of older minor versions of its major version
    assert ffi_api_mismatch(FfiApi("0.6.0", 0, 3), FfiApi("0.7.0", 0, 5)) is None


def test_newer_minor_built_refused_by_older_runtime():
    why = ffi_api_mismatch(FfiApi("0.8.0", 0, 6), FfiApi("0.6.2", 0, 5))
    assert why is not None
    assert "jaxlib 0.8.0" in why and "jaxlib 0.6.2" in why
    assert "FFI API 0.6" in why and "FFI API 0.5" in why
    assert "Rebuild" in why and "--no-build-isolation" in why


@pytest.mark.parametrize("built,running", [((1, 0), (0, 5)), ((0, 5), (1, 0))])
def test_major_difference_refused(built, running):
    why = ffi_api_mismatch(FfiApi("a", *built), FfiApi("b", *running))
    assert why is not None and "Rebuild" in why


def test_this_build_matches_the_installed_jaxlib():
    built, running = ffi.built_ffi_api(), ffi.running_ffi_api()
    assert built.major >= 0 and built.minor >= 0 and built.jaxlib_version
    assert ffi_api_mismatch(built, running) is None
    ffi.check_ffi_api()


def test_register_refuses_a_mismatch(monkeypatch):
    monkeypatch.setattr(ffi, "_registered", False)
    monkeypatch.setattr(ffi, "running_ffi_api",
                        lambda: FfiApi("0.0.1", ffi.built_ffi_api().major + 1, 0))
    with pytest.raises(RuntimeError, match="installed jaxlib 0.0.1"):
        ffi.register()
    assert ffi._registered is False
