"""An exec-mode consumer (``runqueueworker --exec``), as a program in any language would be.

Reads the payload from stdin, appends ``id queue kind attempt text`` to the
file named by its argument, and exits with the payload's ``exit`` status.
With ``"nul": true`` it prints NUL characters to stdout and stderr first;
with ``"sleep": S`` it sleeps S seconds first.
"""

import json
import os
import sys
import time

payload = json.load(sys.stdin)
time.sleep(payload.get("sleep", 0))
with open(sys.argv[1], "a") as marks:
    env = os.environ
    marks.write(
        f"{env['DBQUEUE_MESSAGE_ID']} {env['DBQUEUE_QUEUE']} {env['DBQUEUE_KIND']} "
        f"{env['DBQUEUE_ATTEMPT']} {payload.get('text', '')}\n"
    )
status = payload.get("exit", 0)
if payload.get("nul"):
    sys.stdout.write("out\x00put")
    sys.stderr.write("err\x00or\n")
if status:
    print(f"consumer says: cannot do {status}", file=sys.stderr)
sys.exit(status)
