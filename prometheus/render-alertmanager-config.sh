#!/bin/sh
# Render alertmanager.yml with the webhook URLs read from secret files.
#
#   render-alertmanager-config.sh TEMPLATE OUTPUT [SECRETS_DIR]   (SECRETS_DIR: /etc/alertmanager/secrets)
#
# Every `https://secret.invalid/<name>` in TEMPLATE becomes the first line of SECRETS_DIR/<name>.
# Why: Alertmanager 0.25 webhooks have no url_file and the config has no env expansion, and secrets
# must not be committed. A missing file leaves the placeholder (it never resolves) and warns.
# POSIX sh + awk only, so it runs in the busybox-based prom/alertmanager image.
set -eu
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 TEMPLATE OUTPUT [SECRETS_DIR]" >&2
  exit 2
fi
template=$1
output=$2
secrets=${3:-/etc/alertmanager/secrets}
if [ ! -r "$template" ]; then
  echo "render-alertmanager-config: cannot read template $template" >&2
  exit 2
fi
tmp="$output.tmp.$$"
awk -v dir="$secrets" '
  {
    line = $0; out = ""
    while (match(line, /https:\/\/secret\.invalid\/[A-Za-z0-9_.-]+/)) {
      name = substr(line, RSTART + 23, RLENGTH - 23)
      value = ""
      file = dir "/" name
      if ((getline value < file) > 0) {
        close(file)
        gsub(/^[ \t\r]+|[ \t\r]+$/, "", value)
      }
      if (value == "") {
        printf "render-alertmanager-config: %s missing or empty; %s keeps its placeholder URL\n", file, name > "/dev/stderr"
        value = substr(line, RSTART, RLENGTH)
      } else if (value !~ /^https?:\/\/[^ \t'\''"]+$/) {
        printf "render-alertmanager-config: %s is not an http(s) URL without spaces or quotes\n", file > "/dev/stderr"
        bad = 1
      }
      out = out substr(line, 1, RSTART - 1) value
      line = substr(line, RSTART + RLENGTH)
    }
    print out line
  }
  END { if (bad) exit 3 }
' "$template" > "$tmp" || { rm -f "$tmp"; exit 3; }
mv "$tmp" "$output"
