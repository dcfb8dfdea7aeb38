#!/usr/bin/env bash
# Render docs/diagrams/*.mmd to SVG files beside them with a pinned mermaid
# (from the npm registry) in headless Chromium. Run it after editing a diagram
# and commit both files: the site serves the SVG, so neither a build nor a
# reader fetches mermaid.js (5.5 MB) from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
MERMAID_VERSION=12.3.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mermaid@$MERMAID_VERSION" >/dev/null && tar xzf "mermaid-$MERMAID_VERSION.tgz")
for source in docs/diagrams/*.mmd; do
  python3 - "$source" "$work" <<'PY'
import html, json, sys
from pathlib import Path

source, work = Path(sys.argv[1]), Path(sys.argv[2])
page = f"""<!doctype html><meta charset="utf-8"><script src="package/dist/mermaid.min.js"></script>
<textarea id="svg"></textarea><script>
mermaid.initialize({{startOnLoad: false, theme: "neutral", fontFamily: "sans-serif",
                    flowchart: {{htmlLabels: false}}, sequence: {{useMaxWidth: false}}}});
mermaid.render("diagram", {json.dumps(source.read_text())}).then(
  (result) => {{ document.getElementById("svg").textContent = result.svg; }},
  (error) => {{ document.getElementById("svg").textContent = "ERROR " + error; }});
</script>"""
(work / "render.html").write_text(page)
PY
  /usr/bin/chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --allow-file-access-from-files \
    --virtual-time-budget=20000 --dump-dom "file://$work/render.html" 2>/dev/null >"$work/dom.html"
  python3 - "$work/dom.html" "${source%.mmd}.svg" <<'PY'
import html, re, sys

dom = open(sys.argv[1]).read()
svg = html.unescape(re.search(r'<textarea id="svg">(.*?)</textarea>', dom, re.S).group(1))
if not svg.startswith("<svg"):
    sys.exit(f"mermaid failed: {svg[:300]}")
open(sys.argv[2], "w").write(svg + "\n")
print(sys.argv[2], len(svg), "bytes")
PY
done
