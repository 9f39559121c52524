__version__ = "simulator stand-in (tests/sglang_shim)"
