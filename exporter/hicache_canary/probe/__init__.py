"""The probe engine: one reuse canary against one SGLang server, from its HTTP client and
response parsers to the pure pressure sizing, eviction proof and verdict rules."""
