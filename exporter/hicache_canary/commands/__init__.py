"""The command-line faces: `probe`, `check-config` and `demo`, and the text they print."""
