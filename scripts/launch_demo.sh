#!/usr/bin/env bash
# The first command to run: set up .venv, build the embedded demo model if it is missing, serve it
# on http://127.0.0.1:$PORT (default 30000) and print curl examples; Ctrl-C stops the server.
#   scripts/launch_demo.sh [extra launch_server flags, e.g. --log-requests]
# DEMO_EXIT_AFTER_READY=1: send one /generate request, print "[demo] reply: ...", stop, exit 0.
# DEMO_READY_TIMEOUT: seconds to wait for /health (default 300).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
HOST=127.0.0.1
PORT=${PORT:-30000}
URL="http://$HOST:$PORT"
PY=.venv/bin/python
SERVER=("$PY" -m srt.launch_server --host "$HOST" --port "$PORT" "$@")

scripts/setup_env.sh
if [ ! -f srt/demo_model/model.safetensors ]; then
  echo "[demo] srt/demo_model has no weights; training the demo model (about 10 minutes on one CPU core)"
  "$PY" scripts/train_demo_model.py --out srt/demo_model --report none
fi

# wait_ready PID: poll /health until 200; fail if PID exits first or the timeout passes.
wait_ready() {
  "$PY" - "$URL" "$1" "${DEMO_READY_TIMEOUT:-300}" <<'EOF'
import os, sys, time, urllib.request
url, pid, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"[demo] the server (pid {pid}) exited before it became ready")
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(f"[demo] {url}/health did not answer 200 within {timeout:.0f}s")
EOF
}

# ask_once: one greedy /generate request (retried while the server still warms up), reply printed.
ask_once() {
  "$PY" - "$URL" <<'EOF'
import json, sys, time, urllib.error, urllib.request
url = sys.argv[1] + "/generate"
body = json.dumps({"text": "The license", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).encode()
for attempt in range(30):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        break
    except urllib.error.HTTPError as e:
        if e.code != 503:
            sys.exit(f"[demo] POST {url} -> {e.code}: {e.read().decode(errors='replace')}")
        time.sleep(1)
else:
    sys.exit(f"[demo] POST {url} kept answering 503")
print("[demo] reply: The license" + reply["text"], flush=True)
EOF
}

print_examples() {
  cat <<EOF
[demo] serving the embedded demo model at $URL (Ctrl-C stops it). Try:
  curl -s $URL/generate -H 'Content-Type: application/json' \\
    -d '{"text": "The license", "sampling_params": {"max_new_tokens": 40, "temperature": 0}}'
  curl -s $URL/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Tell me about the GPL-3 license."}], "max_tokens": 60}'
EOF
}

if [ "${DEMO_EXIT_AFTER_READY:-0}" = 1 ]; then
  "${SERVER[@]}" &
  server_pid=$!
  stop_server() {
    kill -TERM "$server_pid" 2>/dev/null || return 0
    for _ in $(seq 1 40); do kill -0 "$server_pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL "$server_pid" 2>/dev/null || true
  }
  trap stop_server EXIT
  wait_ready "$server_pid"
  ask_once
  exit 0
fi

# The server replaces this shell (same pid, so Ctrl-C reaches it directly); a background helper
# prints the examples once /health answers.
( wait_ready $$ && print_examples ) &
exec "${SERVER[@]}"
