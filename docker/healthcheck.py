"""Docker HEALTHCHECK: 200 from /health on this container's internal port, else exit 1.

The service is the one whose DEEPINFER_<SERVICE>_INTERNAL_PORT is set (compose and the chart set exactly one);
without any, each service's default internal port is tried.
"""

import os
import sys
import urllib.request

DEFAULT_PORTS = {"GATEWAY": 8001, "SCHEDULER": 8002, "PREFILL": 8003, "DECODE": 8004, "KVCACHE": 8005}


def main() -> int:
    host = os.environ.get("DEEPINFER_INTERNAL_HOST", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    names = [f"DEEPINFER_{service}_INTERNAL_PORT" for service in DEFAULT_PORTS]
    ports = [os.environ[name] for name in names if name in os.environ]
    for port in ports or DEFAULT_PORTS.values():
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return 0
        except OSError:
            continue
    return 1


if __name__ == "__main__":
    sys.exit(main())
